"""Training on conversations: packed rows (document masking, positions restarting), the loss on
supervised tokens only, token-weighted over the whole batch, resume, refusals, train/serve
agreement; the SFT benchmark's smoke run."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from data.build_conversations import prepare_conversations
from data.chat_rows import conversation_ids
from data.packing import Documents, PackedBatches, best_fit, document_mask, validation_batches
from data.tokenizer import tokenizer_sha256
from data.tokenizer_training import train_tokenizer
from model import ModelArgs, Transformer
from picollama.chat_template import DEFAULT_TEMPLATE, load_chat_template, run_chat_template
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.config.training import build_config
from picollama.run_files import load_model, load_run
from picollama.serve.rows import ServedModel
from picollama.training import step as training_step

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")
TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 320}
WORDS = "the cat sat on a mat and the dog ran far away from home".split()
ROW = 257  # train.seq_len + 1: a few conversations of the fixture's a row
QUIET = ("--eval.interval=0", "--checkpoint.interval=0")  # evaluated and saved at the end alone


def settings(dataset: Path, **sections) -> list[str]:
    """train.py's flags for a tiny fp32 run on `data`, with each section's keys changed."""
    flags = {
        "data.dir": dataset,
        "model.max_seq_len": ROW - 1,
        "train.max_steps": 4,
        "train.batch_size": 8,
        "train.seq_len": ROW - 1,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "train.dtype": "float32",
        "optim.lr": 1e-2,
        "optim.min_lr": 1e-2,
        "optim.final_weight_decay": 0.1,  # flat, as lr is: a resume then needs no max_steps
        "optim.warmup_steps": 1,
        "eval.interval": 2,
        "eval.batches": 2,
        "eval.batch_size": 4,
        "checkpoint.interval": 2,
        "train.weight_average": 0,  # the weights themselves: these runs check the mask, not the EMA
        "train.compile": "false",  # the default config's; a compile costs more than these runs
    }
    flags |= {f"{name}.{key}": value for name, keys in sections.items() for key, value in keys}
    return [f"--{key}={value}" for key, value in flags.items()]


def tiny_model(data: Path) -> list[str]:
    """The flags of a tiny model of the dataset's vocabulary (no train.init_from)."""
    return [f"--model.{key}={value}" for key, value in TINY.items()] + settings(data)


def trained(out: Path, *flags: str) -> int:
    """train.py in this process (a python start and a torch import saved)."""
    return run_command(train.main, [f"--train.out_dir={out}", *flags])


def metrics(out: Path, key: str) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {e["step"]: e[key] for e in map(json.loads, lines) if key in e}


def write_dataset(folder: Path, tokenizer: Path, splits: dict) -> Path:
    """A conversations dataset written as data/build_conversations.py lays it out, of given
    (ids, mask) conversations per split: what a test needs exactly (cut, unreplied ones)."""
    folder.mkdir()
    shutil.copy(tokenizer, folder / "tokenizer.model")
    meta = {"format": 3, "kind": "conversations", "vocab_size": TINY["vocab_size"]}
    meta |= {"dtype": "uint16", "bytes_per_token": 1.0, "splits": {}, "conversations": {}}
    meta["tokenizer_sha256"] = tokenizer_sha256(tokenizer)
    for split, conversations in splits.items():
        ids = np.concatenate([np.asarray(c[0]) for c in conversations]).astype(np.uint16)
        mask = np.concatenate([np.asarray(c[1]) for c in conversations]).astype(np.uint8)
        starts = np.cumsum([0] + [len(c[0]) for c in conversations[:-1]])
        ids.tofile(folder / f"{split}-00000.bin")
        mask.tofile(folder / f"{split}-00000.mask.bin")
        np.save(folder / f"{split}-00000.docs.npy", starts.astype(np.int64))
        shard = {"file": f"{split}-00000.bin", "tokens": len(ids), "docs": len(conversations)}
        meta["splits"][split] = {"tokens": len(ids), "shards": [shard]}
        meta["conversations"][split] = len(conversations)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture(scope="module")
def tiny(make_tiny_run) -> Path:
    """A tiny run trained here: its tokenizer (320 pieces, byte fallback) and default template."""
    return make_tiny_run(steps=1)[0]


def salad(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))


def chat(rng: random.Random, turns: int = 1, system: bool = False) -> list[dict]:
    """A conversation of word salad: `turns` user and assistant messages, a system one first."""
    messages = [{"role": "system", "content": salad(rng)}] if system else []
    for _ in range(turns):
        messages += [
            {"role": "user", "content": salad(rng)},
            {"role": "assistant", "content": salad(rng)},
        ]
    return messages


@pytest.fixture(scope="module")
def chats(tiny, tmp_path_factory) -> tuple[Path, list]:
    """(dataset, conversations): 80 conversations prepared by data/prepare.py's conversations
    path with the tiny run's tokenizer and template."""
    root = tmp_path_factory.mktemp("chats")
    rng = random.Random(0)
    conversations = [chat(rng, turns=1 + i % 3, system=i % 4 == 0) for i in range(80)]
    source = root / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    # For rows of ROW tokens: the tokenizer's run has a context of 32, these tests' models more.
    data = prepare_conversations(str(source), root / "data", tokenizer=str(tiny), context=ROW - 1)
    return data, conversations


# ---------------------------------------------------------------- packing


def test_best_fit_puts_each_item_in_the_fullest_bin_that_holds_it():
    assert best_fit([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    assert best_fit([3, 3, 2, 4], 6) == [[0, 1], [2, 3]]
    lengths = [random.Random(1).randint(1, 40) for _ in range(500)]
    bins = best_fit(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert sum(lengths) / (64 * len(bins)) > 0.95  # rows nearly full


def test_the_document_mask_is_block_causal():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(document_mask(positions)[0], expected)


def test_rows_hold_each_conversation_whole_once_an_epoch_and_resume_exactly(chats):
    data, _ = chats
    tokens = np.fromfile(data / "train-00000.bin", dtype=np.uint16).astype(np.int64)
    mask = np.fromfile(data / "train-00000.mask.bin", dtype=np.uint8).astype(bool)
    starts = np.append(np.load(data / "train-00000.docs.npy"), len(tokens))
    spans = list(zip(starts[:-1], starts[1:]))
    whole = {tuple(tokens[a:b]): mask[a + 1 : b] for a, b in spans}
    assert max(b - a for a, b in spans) <= ROW < sum(b - a for a, b in spans) / 8
    documents = Documents(data, "train", ROW, conversations=True)
    loader = PackedBatches(documents, 4, ROW - 1, seed=3)
    seen = []
    for row in loader.rows:  # the first epoch
        ids, supervised, positions = documents.row(row, ROW)
        cuts = [*np.flatnonzero(positions == 0), ROW]
        for a, b in zip(cuts[:-1], cuts[1:]):
            if ids[a] == 0:  # the padding after the last conversation: no target
                assert (ids[a:] == 0).all() and not supervised[a:].any() and b == ROW
                continue
            seen.append(tuple(ids[a:b]))
            assert np.array_equal(positions[a:b], np.arange(b - a)) and not supervised[a]
            assert np.array_equal(supervised[a + 1 : b], whole[seen[-1]])
    assert sorted(seen) == sorted(tuple(tokens[a:b]) for a, b in spans)
    x, y, positions = loader.next_batch()
    assert x.shape == y.shape == positions.shape == (4, ROW - 1)
    supervised = np.stack([documents.row(row, ROW)[1][1:] for row in loader.rows[:4]])
    assert torch.equal(y != -100, torch.from_numpy(supervised))
    for _ in range(len(loader.rows) // 4):  # into the second epoch: another order
        loader.next_batch()
    state = loader.state_dict()
    ahead = [loader.next_batch() for _ in range(2)]
    resumed = PackedBatches(documents, 4, ROW - 1, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert state["epoch"] == 1 and resumed.rows != PackedBatches(documents, 4, ROW - 1, seed=3).rows
    for batch, again in zip(ahead, (resumed.next_batch() for _ in range(2))):
        assert all(torch.equal(a, b) for a, b in zip(batch, again))


def test_a_long_conversation_is_cut_to_the_row_and_one_left_without_a_reply_is_dropped(
    tiny, tmp_path, capsys
):
    short = ([1, 5, 6, 7, 2], [0, 0, 1, 1, 1])
    long = ([1] + [5] * 20 + [6] * 3 + [2], [0] * 21 + [1] * 4)  # its reply past 17 tokens
    longer = ([1] + [5] * 10 + [6] * 20 + [2], [0] * 11 + [1] * 21)
    data = write_dataset(
        tmp_path / "d", tiny / "tokenizer.model", {"train": [short, long, longer], "val": [short]}
    )
    documents = Documents(data, "train", 17, conversations=True)
    assert (documents.cut, documents.dropped, len(documents)) == (2, 1, 2)
    assert documents.lengths.tolist() == [5, 17]
    ids, supervised, _ = documents.row([1], 17)
    assert ids.tolist() == longer[0][:17] and supervised.tolist() == [
        m == 1 for m in longer[1][:17]
    ]
    none = (
        r"the val split of .* holds 1 conversation\(s\), 1 of them longer than a row "
        r"\(train.seq_len \+ 1 = 2 tokens\)"
    )
    with pytest.raises(UserError, match=none):
        Documents(data, "val", 2, conversations=True)
    # train.py says it once, at the start
    flags = [f"--model.{key}={value}" for key, value in TINY.items()] + settings(data)
    assert trained(tmp_path / "run", *flags, "--train.seq_len=16", "--train.max_steps=1") == 0
    said = capsys.readouterr().out
    cut = "2 longer than a row of train.seq_len + 1 = 17 tokens cut to it, 1 of them left out"
    assert said.count(cut) == 1, said


@pytest.mark.parametrize("damage", ["mask of 7s", "offsets reversed", "kept shorter than a row"])
def test_a_damaged_dataset_is_refused_before_training(tiny, tmp_path, capsys, damage):
    """A loss mask of 7s and reversed offsets trained silently; a dataset whose conversations were
    kept to fewer tokens than a row holds would be taken for whole. Each is one line, and no run."""
    short = ([1, 5, 6, 7, 2], [0, 0, 1, 1, 1])
    splits = {"train": [short] * 3, "val": [short]}
    data = write_dataset(tmp_path / "d", tiny / "tokenizer.model", splits)
    if damage == "mask of 7s":
        (data / "train-00000.mask.bin").write_bytes(b"\7" * 15)
        said = "d/train-00000.mask.bin holds 7 at token 0: a loss mask holds 0 or 1 a token"
    elif damage == "offsets reversed":
        np.save(data / "train-00000.docs.npy", np.array([0, 10, 5], dtype=np.int64))
        said = "d/train-00000.docs.npy: offset 2 (5) falls below the one before"
    else:  # prepared for a context of 8: 10 tokens kept, one conversation that long
        meta = json.loads((data / "meta.json").read_text())
        meta |= {"inputs": {"keep_tokens": 10}, "conversations_at_keep": 1}
        (data / "meta.json").write_text(json.dumps(meta))
        said = "keeps 1 conversation(s) to their first 10 tokens (prepared for a context of 8)"
    flags = [f"--model.{key}={value}" for key, value in TINY.items()] + settings(data)
    assert trained(tmp_path / "run", *flags, "--train.seq_len=16", "--train.max_steps=1") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "run").exists()


def test_text_documents_are_cut_into_row_long_pieces_covering_them(make_tiny_run):
    _, data = make_tiny_run(steps=1)
    documents = Documents(data, "train", ROW, conversations=False)
    tokens = np.fromfile(data / "train-00000.bin", dtype=np.uint16)
    starts = np.load(data / "train-00000.docs.npy").tolist()
    assert documents.cut == len(starts) and len(documents) > len(tokens) // ROW
    assert documents.starts.tolist() == sorted(documents.starts.tolist())
    ends = documents.starts + documents.lengths
    # each piece starts where the one before it ends, or at a document's start
    assert set(documents.starts[1:].tolist()) - set(ends[:-1].tolist()) <= set(starts)
    assert (documents.lengths <= ROW).all() and ends[-1] == len(tokens)
    ids, supervised, positions = documents.row([0], ROW)
    assert ids.tolist() == tokens[:ROW].tolist() and supervised.sum() == ROW - 1
    assert positions.tolist() == list(range(ROW))


# ---------------------------------------------------------------- the model on packed rows


def packed_and_alone(chats) -> tuple:
    """A tiny fp32 model (weights at a wider init, so that attention is far from uniform), and
    (x, y, positions) of packed rows."""
    data, _ = chats
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY, max_seq_len=ROW - 1, multiple_of=16))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.2)
    documents = Documents(data, "train", ROW, conversations=True)
    x, y, positions = validation_batches(documents, 4, ROW - 1, 1)[0]
    return model, x, y, positions


def test_packed_losses_equal_the_losses_of_each_conversation_alone(chats):
    model, x, y, positions = packed_and_alone(chats)
    with torch.no_grad():
        logits = model(x, positions=positions, mask=document_mask(positions))
        packed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        unmasked = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    checked = later = 0
    for row in range(len(x)):
        cuts = [*torch.nonzero(positions[row] == 0).flatten().tolist(), x.shape[1]]
        for a, b in zip(cuts[:-1], cuts[1:]):
            # the conversation alone, padded to the row's length: causal, positions 0..
            alone = torch.zeros_like(x[row : row + 1])
            alone[0, : b - a] = x[row, a:b]
            with torch.no_grad():
                losses = F.cross_entropy(model(alone)[0, : b - a], y[row, a:b], reduction="none")
            torch.testing.assert_close(packed[row, a:b], losses, atol=1e-5, rtol=0)
            checked += int((y[row, a:b] != -100).sum())
            later += a > 0
    assert checked == int((y != -100).sum()) and later >= 4
    # without the mask and positions the later conversations would see the earlier ones
    assert not torch.allclose(unmasked.view_as(y), packed, atol=1e-3)


def test_masked_positions_get_no_gradient_and_their_labels_do_not_count(chats):
    model, x, y, positions = packed_and_alone(chats)
    inputs = {"positions": positions, "mask": document_mask(positions)}
    logits = []

    def keep(module, args, out):
        logits.append(out)

    model.output.register_forward_hook(keep)
    loss = training_step.loss_terms(model, x, y, inputs, 0.0)["loss"]
    logits[0].retain_grad()
    loss.backward()
    grad = logits[0].grad.abs().sum(-1)
    masked = y == -100
    assert masked.any() and (grad[masked] == 0).all() and (grad[~masked] > 0).all()
    # the labels under the mask: any value gives the same loss; a supervised one changes it
    raw = torch.where(masked, x.roll(-1, 1), y)
    with torch.no_grad():
        for where, same in ((masked, True), (~masked, False)):
            changed = torch.where(where, (raw + 1) % TINY["vocab_size"], raw)
            labels = torch.where(masked, -100, changed)
            again = training_step.loss_terms(model, x, labels, inputs, 0.0)["loss"]
            assert (again.item() == loss.item()) == same, where


def test_the_loss_is_the_mean_over_the_targets_of_the_whole_accumulated_batch(chats):
    model, x, y, positions = packed_and_alone(chats)
    y = y.clone()
    y[:2, 60:] = -100  # the first micro-batch holds far fewer targets than the second
    assert 0 < (y[:2] != -100).sum() < (y[2:] != -100).sum() / 3
    inputs = {"positions": positions, "mask": document_mask(positions)}
    with torch.no_grad():
        logits = model(x, **inputs)
        each = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    expected = each.sum() / (y != -100).sum()
    dist = train.Dist("cpu")
    steps = {}
    for accum in (1, 2):
        cfg = build_config({"model": TINY, "train": {"grad_accum": accum}}, [])
        copy = Transformer(model.args)
        copy.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(copy.parameters(), lr=1.0)
        losses, _, applied = train.train_step(copy, optimizer, x, y, 1.0, cfg, dist, inputs)
        assert applied
        steps[accum] = (losses["loss"].item(), copy.state_dict())
    dist.close()
    for loss, weights in steps.values():
        assert loss == pytest.approx(expected.item(), abs=1e-6)
        torch.testing.assert_close(weights, steps[1][1], atol=1e-6, rtol=0)
    halves = [each.view_as(y)[rows][y[rows] != -100].mean() for rows in (slice(0, 2), slice(2, 4))]
    assert abs((halves[0] + halves[1]).item() / 2 - expected.item()) > 0.01  # not a mean of means


# ---------------------------------------------------------------- train.py on conversations


def test_sft_resumes_exactly_and_two_ranks_train_as_one_process(chats, tmp_path):
    data, _ = chats
    once = "--checkpoint.interval=0"
    assert trained(tmp_path / "whole", *tiny_model(data), once) == 0
    assert trained(tmp_path / "split", *tiny_model(data), once, "--train.max_steps=2") == 0
    assert trained(tmp_path / "split", *tiny_model(data), once, "--resume") == 0
    whole, split = metrics(tmp_path / "whole", "loss"), metrics(tmp_path / "split", "loss")
    assert split == whole and whole[4] < whole[1]
    assert metrics(tmp_path / "split", "val_loss") == metrics(tmp_path / "whole", "val_loss")
    assert not any("val_bpb" in line for line in (tmp_path / "whole" / "metrics.jsonl").open())
    # the dataset's chat template goes with the run
    assert run_chat_template(tmp_path / "whole") == run_chat_template(data)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    flags = [f"--train.out_dir={tmp_path / 'two'}", *tiny_model(data), once]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [*command, "train.py", *flags], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert two.returncode == 0, two.stderr
    # every rank's rows hold other counts of targets: the ranks' losses weigh by them (then the
    # updates, reduced in another order, drift apart by ~1e-5 a step at this learning rate)
    ranks = metrics(tmp_path / "two", "loss")
    assert abs(ranks[1] - whole[1]) < 2e-6 and all(abs(ranks[s] - whole[s]) < 2e-4 for s in whole)


SECRET = list(range(100, 108))  # the sentence in every user turn, ids no reply uses


def secret_chats(rng: random.Random, count: int, supervise_all: bool) -> list[tuple]:
    """(ids, mask) conversations: BOS, a user turn of filler and SECRET, a reply of other ids, EOS;
    the mask on the reply and EOS (every token but BOS: the control)."""
    conversations = []
    for _ in range(count):
        user = rng.choices(range(3, 100), k=rng.randint(2, 6)) + SECRET
        reply = rng.choices(range(200, 300), k=rng.randint(3, 8)) + [2]
        ids = [1, *user, *reply]
        mask = [0] + [int(supervise_all)] * len(user) + [1] * len(reply)
        conversations.append((ids, mask))
    return conversations


def secret_loss(run: Path, data: Path) -> float:
    """The mean loss of SECRET's tokens after its first, in the held-out conversations."""
    model, _ = load_model(run)
    ids = np.fromfile(data / "val-00000.bin", dtype=np.uint16).astype(np.int64)
    x = torch.from_numpy(ids)[None]
    with torch.no_grad():
        each = F.cross_entropy(model(x[:, :-1])[0], x[0, 1:], reduction="none")
    starts = [i for i in range(len(ids) - 8) if ids[i : i + 8].tolist() == SECRET]
    return torch.stack([each[s : s + 7] for s in starts]).mean().item()


def test_a_secret_in_every_user_turn_stays_unlearned_under_the_mask(tiny, tmp_path):
    losses = {}
    for supervise_all in (False, True):
        rng = random.Random(0)
        splits = {
            "train": secret_chats(rng, 200, supervise_all),
            "val": secret_chats(rng, 4, supervise_all),
        }
        data = write_dataset(tmp_path / f"data{supervise_all}", tiny / "tokenizer.model", splits)
        out = tmp_path / f"run{supervise_all}"
        assert trained(out, *tiny_model(data), "--train.max_steps=20", *QUIET) == 0
        losses[supervise_all] = secret_loss(out, data)
    # 7 guesses among 320 ids at first: ln 320 = 5.8; the control learns them, the mask never
    assert losses[True] < 0.5 and losses[False] > 4.0, losses


def test_the_server_prompt_is_a_token_prefix_of_the_conversation_s_training_row(
    tiny, chats, tmp_path
):
    data, conversations = chats
    flags = settings(data, train=[("max_steps", 1)], checkpoint=[("interval", 0)])
    assert trained(tmp_path / "sft", f"--train.init_from={tiny}", *flags) == 0
    model, _, tokenizer = load_run(tmp_path / "sft", "cpu", torch.float32)
    template = load_chat_template(tmp_path / "sft")
    assert template == run_chat_template(data) == DEFAULT_TEMPLATE
    served = ServedModel(model, tokenizer, template, "sft")
    documents = Documents(data, "train", 2049, conversations=True)
    rows = {tuple(documents.row([i], 2049)[0][:n]) for i, n in enumerate(documents.lengths)}
    for messages in conversations:
        ids, _ = conversation_ids(tokenizer, template, messages)
        if tuple(ids) not in rows:
            continue  # held out
        for end in range(len(messages)):
            if messages[end]["role"] == "assistant":
                prompt = served.chat_prompt(messages[:end])
                assert ids[: len(prompt)] == prompt, (messages, end)


def test_a_run_trained_on_text_gets_the_default_chat_template(make_tiny_run, tmp_path):
    _, data = make_tiny_run(steps=1)
    flags = [f"--model.{key}={value}" for key, value in TINY.items()]
    flags += settings(data, train=[("max_steps", 1)], data=[("pack_documents", True)])
    assert trained(tmp_path / "run", *flags) == 0
    assert run_chat_template(tmp_path / "run") == DEFAULT_TEMPLATE


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.position=alibi"], "model.position alibi cannot train on packed documents"),
        (["--model.position=fox"], "model.position fox cannot train on packed documents"),
        (["--model.ssmax=true"], "model.ssmax cannot train on packed documents"),
        (["--train.random_positions=2"], "train.random_positions cannot train on packed"),
        (["--data.copy_fraction=0.5"], "data.copy_fraction cannot train on packed documents"),
    ],
)
def test_a_setting_that_would_cross_packed_conversations_is_one_error_line(
    chats, tmp_path, capsys, flags, message
):
    data, _ = chats
    assert trained(tmp_path / "run", *tiny_model(data), *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_dataset_made_with_another_tokenizer_than_init_from_s_is_one_error_line(
    tiny, chats, make_tiny_run, tmp_path, capsys
):
    data, _ = chats
    other = tmp_path / "other"
    shutil.copytree(data, other)
    # another tokenizer, trained here: the repository's data/ holds none of its own
    (other / "tokenizer.model").write_bytes(train_tokenizer(["another tokenizer\n"] * 20, 280, 0))
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer_sha256"] = tokenizer_sha256(other / "tokenizer.model")
    (other / "meta.json").write_text(json.dumps(meta))
    assert trained(tmp_path / "run", f"--train.init_from={tiny}", *settings(other)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"data.dir {other} was made with another tokenizer than train.init_from {tiny}" in err
    meta["kind"] = "pictures"
    (other / "meta.json").write_text(json.dumps(meta))
    assert trained(tmp_path / "run", *tiny_model(other)) == 2
    assert "a dataset of kind 'pictures'; train.py reads text and conversations" in (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------- the benchmark


def test_the_sft_benchmark_smoke_run(bench_main, tmp_path, capsys):
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    try:
        args = [
            "--smoke",
            "--threads",
            "1",
            "--dtype",
            "float32",
            "--out",
            str(tmp_path / "s.json"),
        ]
        code = run_command(bench_main("sft"), args)
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    (result,) = json.loads((tmp_path / "s.json").read_text())["results"]
    assert abs(result["initial_loss"]["ours"] - result["initial_loss"]["hf"]) < 1e-4
    assert result["ours"]["tokens_per_second"] > 0 and result["hf"]["tokens_per_second"] > 0
