"""The data-limited regime's training components: dropout hooks, the weight average, and the
switches benchmark's quality table trained for train.py's own minute budget."""

import json

import numpy as np
import pytest
import torch
from conftest import write_corpus
from safetensors.torch import load_file
from test_train import config_file, run_in_process, run_killed_then_resumed

from data.build import prepare
from data.epochs import EpochBatches
from data.loader import RandomBatches, eval_batches
from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.config.training import build_config
from picollama.lab.measure import switches
from picollama.run_files import load_model
from picollama.training.dropout import add_dropout
from picollama.training.weight_average import WeightAverage

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16)


def test_dropout_acts_while_training_only_on_the_residual_writes():
    torch.manual_seed(0)
    model, plain = Transformer(ARGS), Transformer(ARGS)
    plain.load_state_dict(model.state_dict())
    add_dropout(model, 0.5)
    tokens = torch.randint(0, 64, (2, 16))
    model.eval()
    assert torch.equal(model(tokens), plain(tokens))  # evaluation: no dropout
    model.train()
    assert not torch.allclose(model(tokens), plain(tokens))
    seen = []
    model.layers[0].attention.wo.register_forward_hook(lambda m, a, out: seen.append(out))
    model(tokens)
    # zeroed with probability 0.5, the rest scaled by 2
    assert 0.35 < (seen[0] == 0).float().mean() < 0.65
    hooked = [name for name, m in model.named_modules() if m._forward_hooks]
    assert set(hooked) == {
        "tok_embeddings",
        *(f"layers.{i}.{part}" for i in range(2) for part in ("attention.wo", "feed_forward.w2")),
    }


def test_no_dropout_adds_no_hook():
    model = Transformer(ARGS)
    add_dropout(model, 0.0)
    assert not any(m._forward_hooks for m in model.modules())


def test_the_weight_average_starts_at_start_lerps_and_is_applied_then_restored():
    model = torch.nn.Linear(3, 1, bias=False)
    average = WeightAverage(model, beta=0.5)
    for step, value in enumerate([1.0, 2.0, 4.0, 8.0], start=1):
        model.weight.data.fill_(value)
        average.update(step, start=2)  # step 1's weights are before the average
    # 2, then 0.5·2 + 0.5·4 = 3, then 0.5·3 + 0.5·8 = 5.5
    with average.applied():
        assert torch.equal(model.weight.data, torch.full((1, 3), 5.5))
    assert torch.equal(model.weight.data, torch.full((1, 3), 8.0))


def test_an_average_not_begun_leaves_the_weights():
    model = torch.nn.Linear(3, 1, bias=False)
    average = WeightAverage(model, beta=0.9)
    average.update(step=3, start=10)
    before = model.weight.detach().clone()
    with average.applied():
        assert torch.equal(model.weight, before)


@pytest.mark.parametrize("key", ["train.dropout", "train.weight_average"])
@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_dropout_and_average_outside_zero_to_one_are_refused(key, value):
    section, name = key.split(".")
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        build_config({section: {name: value}}, [])


def test_quality_table_trains_each_seed_for_train_py_s_own_minutes(tmp_path, monkeypatch):
    trained, prepared = [], []

    def train(config, overrides, out_dir):
        trained.append(overrides)
        return [{"step": 7, "tokens_per_s": 1.0, "loss": 5.0}, {"step": 7, "val_bpb": 2.0}]

    monkeypatch.setattr(switches, "train", train)

    def prepare(*args, **kwargs):
        prepared.append((*args, kwargs["tokenizer_type"]))

    monkeypatch.setattr(switches, "prepare", prepare)
    monkeypatch.setattr(switches.common, "REPO_ROOT", tmp_path)  # where train.py's data.dir is
    out = tmp_path / "q.json"
    argv = ["--table", "quality", "--minutes", "0.5", "--seeds", "0,1", "--only", "vocab 1024"]
    assert run_command(switches.main, [*argv, "--out", str(out)]) == 0
    assert len(trained) == 2  # no probe: train.py sizes the run from its own budget
    for seed, overrides in enumerate(trained):
        assert "--train.max_minutes=0.5" in overrides and f"--train.seed={seed}" in overrides
        assert not any(o.startswith("--train.max_steps") for o in overrides)
    # the other vocabulary's dataset is prepared once, before any run is timed, with the default's
    # tokenizer type
    data_dir = tmp_path / "data/shakespeare-unigram-1024"
    assert prepared == [("shakespeare", 1024, data_dir, "unigram")]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    corpus = write_corpus(root / "corpus", num_docs=4, words_per_doc=600)
    return prepare(str(corpus), vocab_size=300, out_dir=root / "data", command=["test"])


def test_an_epoch_takes_every_window_once_from_one_phase(prepared):
    loader = EpochBatches(prepared, "train", batch_size=5, seq_len=16, seed=3)
    n = len(loader.tokens)
    seen = []
    while len(seen) < (n - 17) // 16 - 5:  # within the first epoch
        x, y = loader.next_batch()
        seen.extend(x[:, 0].tolist())
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert loader.taken == len(seen)
    starts = loader.order[: len(seen)]
    assert len(set(starts.tolist())) == len(starts)  # no window twice
    assert len({int(s) % 16 for s in loader.order}) == 1  # one phase: windows do not overlap
    assert seen == [int(loader.tokens[s]) for s in starts]


def test_epochs_go_on_with_a_new_order_and_resume_exactly(prepared):
    loader = EpochBatches(prepared, "train", batch_size=7, seq_len=16, seed=0)
    for _ in range(3):
        loader.next_batch()
    first = loader.order.copy()
    epoch = len(first)
    while np.array_equal(first, loader.order):  # into the next epoch
        loader.next_batch()
    # the batch that began it took the old epoch's last windows and the new one's first
    assert loader.taken == 7 * (epoch // 7 + 1) - epoch
    state = json.loads(json.dumps(loader.state_dict()))  # plain Python, as checkpoints hold it
    expected = [loader.next_batch()[0] for _ in range(4)]
    resumed = EpochBatches(prepared, "train", batch_size=7, seq_len=16, seed=99)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch()[0], x) for x in expected)


def test_the_run_evaluates_and_exports_the_average_of_its_decay(prepared, tmp_path):
    """A wsd run of 12 steps averages steps 10..12 (decay_fraction 0.2): its last validation
    loss is the exported model's, and that model is not the plain run's last weights."""
    data_dir = prepared
    config = config_file(tmp_path, data_dir, optim={"schedule": "wsd"}, checkpoint={"interval": 0})
    extra = ("--data.sampling=epochs", "--train.dropout=0.1")
    assert run_in_process(config, tmp_path / "plain", *extra) == 0
    assert run_in_process(config, tmp_path / "avg", *extra, "--train.weight_average=0.5") == 0
    plain, _ = load_model(tmp_path / "plain")
    model, _ = load_model(tmp_path / "avg")
    assert not torch.equal(plain.output.weight, model.output.weight)
    with torch.no_grad():
        batches = list(eval_batches(data_dir, "val", 8, 32, 2))
        loss = sum(model(x, y).item() for x, y in batches) / len(batches)
    logged = [json.loads(line) for line in (tmp_path / "avg" / "metrics.jsonl").open()]
    assert [e["val_loss"] for e in logged if "val_loss" in e][-1] == pytest.approx(loss, abs=1e-5)


def test_a_run_killed_inside_its_average_resumes_it_exactly(prepared, tmp_path, capsys):
    """The average is in every checkpoint from its first step: a run killed after it began ends
    with the uninterrupted run's averaged model, to the bit."""
    data_dir = prepared
    # lr = min_lr: the decay, from step 2, leaves the losses independent of max_steps
    config = config_file(
        tmp_path,
        data_dir,
        optim={"schedule": "wsd", "decay_start": 2},
        train={"weight_average": 0.7},
    )
    assert run_in_process(config, tmp_path / "whole") == 0
    resumed_at = run_killed_then_resumed(
        1, config, tmp_path / "resumed", kill_after=4, max_steps=12, capsys=capsys
    )
    assert 4 <= resumed_at < 12
    whole, resumed = (
        load_file(tmp_path / run / "model.safetensors") for run in ("whole", "resumed")
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_random_windows_state_goes_on_in_epochs(prepared):
    """A checkpoint from before data.sampling holds RandomBatches' state: it resumes in epochs."""
    old = RandomBatches(prepared, "train", batch_size=4, seq_len=16, seed=5)
    old.next_batch()
    loader = EpochBatches(prepared, "train", batch_size=4, seq_len=16, seed=0)
    loader.load_state_dict(json.loads(json.dumps(old.state_dict())))
    loader.next_batch()
    assert loader.taken == 4 and len(set(loader.order.tolist())) == len(loader.order)


def test_two_lengths_for_the_runs_are_refused(tmp_path, capsys):
    argv = ["--table", "quality", "--minutes", "5", "--steps", "900"]
    assert run_command(switches.main, [*argv, "--out", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err
    assert err == "error: --minutes and --steps each set a run's length: give one\n"
