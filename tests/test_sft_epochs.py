"""Fine-tuning sized by the data: train.epochs fixes the step count from the training split's
packed rows before the first step (so the wsd decay ends on the last), the first step says how
long the run will take, train.early_stop stops once the held-out loss stops improving and keeps the
best weights, a resume continues both, and bad values are one error line."""

import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_sft_train import TINY, metrics, settings, trained, write_dataset

import train
from data.loader import RandomBatches
from data.packing import Documents, PackedBatches, validation_batches
from picollama.cli import UserError
from picollama.config.checks import check_config
from picollama.config.training import build_config, parse_cli
from picollama.run_files import load_model
from picollama.training import metrics as metrics_module
from picollama.training.dataset import epoch_length, held_out_metrics
from picollama.training.metrics import Pace
from picollama.training.resume import checkpoints

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")
SEQ_LEN = 64  # rows of 65 tokens: ~16 of the fixture's conversations an epoch
EARLY = ("--train.early_stop=2", "--eval.interval=1", "--eval.interim_batches=0")
ONLY_IMPROVING = "--checkpoint.interval=0"  # train.early_stop's saves alone


def conversations(rng: random.Random, count: int, replies: range) -> list[tuple]:
    """(ids, mask) conversations: BOS, a user turn of ids 3-99, a reply of `replies` ids, masked."""
    made = []
    for _ in range(count):
        user = rng.choices(range(3, 100), k=rng.randint(4, 12))
        reply = rng.choices(replies, k=rng.randint(4, 12))
        made.append(([1, *user, *reply], [0] * (1 + len(user)) + [1] * len(reply)))
    return made


@pytest.fixture(scope="module")
def tiny(make_tiny_run) -> Path:
    return make_tiny_run(steps=1)[0]


@pytest.fixture(scope="module")
def drifting(tiny, tmp_path_factory) -> Path:
    """60 conversations to train on and 6 held out, whose replies use ids (300-319) that no
    training reply does (200-299). Training makes them less likely: the held-out loss rises after
    the first step, deterministically (it did by 0.02 and 0.05 a step)."""
    rng = random.Random(0)
    splits = {
        "train": conversations(rng, 60, range(200, 300)),
        "val": conversations(rng, 6, range(300, 320)),
    }
    folder = tmp_path_factory.mktemp("drifting") / "data"
    return write_dataset(folder, tiny / "tokenizer.model", splits)


def tiny_flags(data: Path, *flags: str) -> list[str]:
    """A tiny model's flags on `data`, rows of SEQ_LEN, the length left to train.epochs."""
    model = [f"--model.{key}={value}" for key, value in TINY.items()]
    chosen = settings(data, train=[("seq_len", SEQ_LEN), ("batch_size", 4)])
    return [*model, *(f for f in chosen if not f.startswith("--train.max_steps=")), *flags]


def epoch_rows(data: Path) -> int:
    """The rows of the first epoch's packing, train.seed 1337's (default.toml's)."""
    documents = Documents(data, "train", SEQ_LEN + 1, conversations=True)
    return len(PackedBatches(documents, 4, SEQ_LEN, seed=1337).rows)


def test_epochs_set_the_steps_the_schedule_ends_on_and_the_first_step_says_their_time(
    drifting, tmp_path, capsys
):
    rows = epoch_rows(drifting)
    steps = math.ceil(1.5 * rows / 4)
    assert rows >= 12 and steps > 2
    flags = tiny_flags(drifting, "--train.epochs=1.5", "--optim.min_lr=1e-3")
    assert trained(tmp_path / "run", *flags) == 0
    lr = metrics(tmp_path / "run", "lr")
    # warmed up in 1 step, held, then decayed (wsd) to min_lr at the epochs' last step
    assert max(lr) == steps and lr[1] == pytest.approx(1e-2) and lr[steps] == pytest.approx(1e-3)
    said = capsys.readouterr().out.splitlines()
    line = next(i for i, text in enumerate(said) if "epochs of" in text)
    # said once, after step 3 (the first, which sets up, untimed), before anything of step 4
    assert [i for i, text in enumerate(said) if "epochs of" in text] == [line]
    assert line < next(i for i, text in enumerate(said) if text.startswith("step 4:")), said
    sized = f"1.5 epochs of 60 conversations ({rows} rows of {SEQ_LEN} tokens an epoch): "
    sized += f"{steps} steps of 4 rows, about "
    assert said[line].startswith(sized), said[line]
    pace = r"about \d+(\.\d)? (s|min|h) at steps 2-3's pace \(\d+\.\d\d s a step;"
    assert re.search(pace, said[line]), said[line]


def test_the_pace_leaves_out_the_first_step_and_is_said_again_when_load_changes(monkeypatch):
    times = [0, 10, 13, 16, 22, 28, 34, 40, 46]  # a first step of 10 s, then 3 s, then 6 s

    def now() -> float:
        return times.pop(0)

    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=now))
    cfg = build_config({"train": {"max_steps": 40}, "eval": {"interval": 10}}, [])
    pace = Pace("40 steps", cfg, 0, eval_rows=3 * cfg.train.batch_size)  # evaluations: a step's
    said = {step: pace.lap(step) for step in range(1, 9)}
    counted = "evaluations counted, saves not)"
    # 40 steps and 4 evaluations of 3 s
    assert said[3] == f"40 steps, about 2.2 min at steps 2-3's pace (3.00 s a step; {counted}"
    assert said[8] == "32 steps left, about 3.6 min at steps 4-8's pace"
    assert [step for step, line in said.items() if line] == [3, 8]
    times[:] = [0, 5]
    pace = Pace("3 steps", build_config({"train": {"max_steps": 3}}, []), 0, eval_rows=0)
    assert pace.lap(1) == f"3 steps, about 15 s at step 1's pace (5.00 s a step; {counted}"


def test_an_epoch_of_text_is_its_windows(make_tiny_run):
    _, data = make_tiny_run(steps=1)
    cfg = build_config({"train": {"epochs": 2, "batch_size": 8}, "optim": {"warmup_steps": 1}}, [])
    loader = RandomBatches(data, "train", 8, cfg.train.seq_len)
    windows = (len(loader.tokens) - 1) // cfg.train.seq_len
    steps, warmup, sized = epoch_length(cfg, loader)
    assert steps == math.ceil(2 * windows / 8) and warmup == 1
    assert sized.startswith(f"2 epochs of {len(loader.tokens):,} tokens ({windows:,} rows of ")
    short = build_config({"train": {"epochs": 2, "batch_size": 8}}, [])  # 100 warmup steps
    assert epoch_length(short, loader)[1] == math.ceil(steps / 10) < 100


def test_an_epochs_run_resumes_exactly_and_then_has_nothing_left(drifting, tmp_path, capsys):
    epochs = tiny_flags(drifting, "--train.epochs=1", ONLY_IMPROVING)
    first = [flag.replace("--train.epochs=1", "--train.max_steps=2") for flag in epochs]
    assert trained(tmp_path / "whole", *epochs) == 0
    assert trained(tmp_path / "split", *first) == 0  # flat lr: the length changes no step
    assert trained(tmp_path / "split", *epochs, "--resume") == 0
    whole = metrics(tmp_path / "whole", "loss")
    assert metrics(tmp_path / "split", "loss") == whole and max(whole) == math.ceil(
        epoch_rows(drifting) / 4
    )
    capsys.readouterr()
    assert trained(tmp_path / "whole", *epochs, "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: nothing to do: {tmp_path / 'whole'}") and err.count("\n") == 1
    assert "raise train.epochs to train on" in err


def held_out_loss(run: Path, data: Path) -> float:
    """The saved model's loss on the held-out replies, read as the run's evaluations read them."""
    model, _ = load_model(run)
    documents = Documents(data, "val", SEQ_LEN + 1, conversations=True)
    dist = train.Dist("cpu")
    try:
        return held_out_metrics(model, validation_batches(documents, 4, SEQ_LEN, 2), dist)[
            "val_loss"
        ]
    finally:
        dist.close()


def test_early_stop_stops_when_the_held_out_loss_rises_and_keeps_the_best_weights(
    drifting, tmp_path, capsys
):
    flags = tiny_flags(drifting, "--train.max_steps=30", *EARLY, ONLY_IMPROVING)
    assert trained(tmp_path / "run", *flags) == 0
    losses = metrics(tmp_path / "run", "val_loss")
    # the best at step 1, then 2 evaluations without improving on it: stopped at step 3 of 30
    assert list(losses) == [1, 2, 3] and losses[1] < losses[2] < losses[3]
    assert max(metrics(tmp_path / "run", "loss")) == 3
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step_000001"]
    assert held_out_loss(tmp_path / "run", drifting) == pytest.approx(losses[1], abs=1e-5)
    assert metrics(tmp_path / "run", "kept_step") == {3: 1}
    stop = (
        f"step 3: the validation loss has not improved on step 1's {losses[1]:.4f} in 2 "
        "evaluations (train.early_stop 2): stopping; the run keeps step 1's weights"
    )
    assert stop in capsys.readouterr().out
    # --resume goes on from the best, evaluated again, and stops alike
    assert trained(tmp_path / "run", *flags, "--resume") == 0
    assert metrics(tmp_path / "run", "val_loss") == losses
    assert stop in capsys.readouterr().out
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step_000001"]
    # a run that ends first keeps its best too, and says so
    ending = [flag.replace("--train.max_steps=30", "--train.max_steps=2") for flag in flags]
    assert trained(tmp_path / "short", *ending) == 0
    assert held_out_loss(tmp_path / "short", drifting) == pytest.approx(losses[1], abs=1e-5)
    assert "improved on step 1's" in capsys.readouterr().out


def test_a_fine_tune_that_never_improves_on_the_model_as_given_saves_nothing(
    tiny, drifting, tmp_path, capsys
):
    flags = settings(drifting, train=[("max_steps", 30)], checkpoint=[("interval", 0)])
    args = [f"--train.init_from={tiny}", *flags, *EARLY]
    assert trained(tmp_path / "run", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: step 2: the validation loss has not improved on step 0's"), err
    assert "nothing was saved" in err and err.count("\n") == 1
    assert list(metrics(tmp_path / "run", "val_loss")) == [0, 1, 2]
    assert not (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train.epochs=0"], "--train.epochs must be positive, not 0.0"),
        (["--train.epochs=nan"], "--train.epochs must be finite"),
        (["--train.early_stop=-1"], "--train.early_stop must be zero or more, not -1"),
        (
            ["--train.epochs=2", "--train.max_minutes=5"],
            "the command line sets both train.max_minutes and train.epochs; keep one",
        ),
        (["--train.epochs=2", "--optim.decay_start=1"], "optim.decay_start is a step, and"),
        (["--train.epochs=1", "--data.task=retrieval"], "train.epochs needs a dataset"),
        (["--train.epochs=1", *EARLY[:2]], "eval.interim_batches (6) makes evaluations read"),
        (["--train.epochs=1", *EARLY], "checkpoint.interval (2) saves would replace the best"),
        (
            ["--train.epochs=1", EARLY[0], ONLY_IMPROVING, "--eval.interval=0"],
            "eval.interval 0 evaluates at the end alone",
        ),
    ],
)
def test_bad_epochs_and_early_stops_are_one_error_line(drifting, tmp_path, capsys, flags, message):
    assert trained(tmp_path / "run", *tiny_flags(drifting, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_sft_toml_trains_three_epochs_and_stops_early():
    sft = ["--config", str(REPO / "configs" / "sft.toml")]
    cfg, _ = parse_cli(sft)
    t = cfg.train
    assert (t.epochs, t.max_minutes, t.early_stop, cfg.checkpoint.interval) == (3, None, 2, 0)
    check_config(cfg, 1)
    assert parse_cli([*sft, "--train.max_steps=5"])[0].train.epochs is None  # a length given
    with pytest.raises(UserError, match="the config file sets both train.max_steps and train.ep"):
        build_config({"train": {"epochs": 3, "max_steps": 5}}, [])
