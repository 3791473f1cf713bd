"""data/retrieval.py: rows deterministic for a seed, targets only where retrieval is possible,
exact resume, and train.py training the task and validating its accuracy."""

import json

import numpy as np
import pytest
import torch

import train
from data.retrieval import FILLER, RetrievalBatches, RetrievalTask
from picollama.cli import UserError
from picollama.cli.command import run_command

# torch on one thread, as training is: on a busy 2-core machine two threads stall each other
# (train.py's test: ~5 s against ~1.6 s)
pytestmark = pytest.mark.usefixtures("one_thread")
TASK = RetrievalTask(keys=16, values=16, pairs=4)


def earlier_value(row: np.ndarray, position: int) -> tuple[int, int]:
    """The value after the latest earlier occurrence of row[position]'s key, and that
    occurrence's distance."""
    earlier = np.flatnonzero(row[:position] == row[position])
    return int(row[earlier[-1] + 1]), position - int(earlier[-1])


def test_rows_are_deterministic_for_a_seed_and_differ_for_another():
    a = TASK.train_rows(np.random.default_rng(3), 8, 65)
    b = TASK.train_rows(np.random.default_rng(3), 8, 65)
    c = TASK.train_rows(np.random.default_rng(4), 8, 65)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("length", [33, 64, 65])
def test_every_target_is_the_value_of_an_earlier_occurrence_of_its_key(length):
    rows, targets = TASK.train_rows(np.random.default_rng(0), 32, length)
    assert targets.sum() > 32 * 2  # many queries per row
    for row, mask in zip(rows, targets):
        for position in np.flatnonzero(mask):
            assert 1 <= row[position - 1] <= TASK.keys and row[position] > TASK.keys
            assert earlier_value(row, position - 1)[0] == row[position]
        keys = row[0::2][(row[0::2] != FILLER)]
        assert len(set(keys.tolist())) <= TASK.pairs


def test_filler_turns_that_fraction_of_the_queries_into_filler_and_leaves_the_rest():
    plain_rows, plain_targets = TASK.train_rows(np.random.default_rng(5), 64, 65)
    rows, targets = TASK.train_rows(np.random.default_rng(5), 64, 65, filler=0.3)
    changed = rows != plain_rows
    assert (rows[changed] == FILLER).all() and not (targets & ~plain_targets).any()
    dropped = (plain_targets & ~targets).sum() / plain_targets.sum()
    assert 0.25 < dropped < 0.35
    changed_slots = changed[:, 0:64:2] | changed[:, 1:65:2]  # a slot: a key and its value
    assert np.array_equal(changed_slots, (plain_targets & ~targets)[:, 1:65:2])


@pytest.mark.parametrize("length, distance", [(64, 8), (256, 100), (1024, 1000)])
def test_evaluation_queries_sit_at_the_given_distance_from_their_key(length, distance):
    rows, targets = TASK.eval_rows(np.random.default_rng(1), 16, length, distance)
    assert (targets.sum(1) == TASK.pairs).all()  # each key queried once
    for row, mask in zip(rows, targets):
        for position in np.flatnonzero(mask):
            assert earlier_value(row, position - 1) == (row[position], distance)


def test_evaluation_rows_without_a_distance_query_at_the_end_of_the_row():
    rows, targets = TASK.eval_rows(np.random.default_rng(1), 16, 128)
    assert targets[:, -2 * TASK.pairs :].sum() == targets.sum() == 16 * TASK.pairs


def test_the_loader_resumes_exactly_from_its_state():
    loader = RetrievalBatches(TASK, 4, 32, seed=7)
    loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))  # plain data
    expected = [loader.next_batch() for _ in range(3)]
    other = RetrievalBatches(TASK, 4, 32, seed=99)
    other.load_state_dict(state)
    for (x, y), (xr, yr) in zip(expected, (other.next_batch() for _ in range(3))):
        assert torch.equal(x, xr) and torch.equal(y, yr)
    with pytest.raises(UserError, match="not the retrieval task's"):
        other.load_state_dict({"rank": 0, "world_size": 1, "rng": state["rng"]})


def test_targets_are_minus_100_but_at_the_queries_values():
    x, y = RetrievalBatches(TASK, 4, 32, seed=0).next_batch()
    kept = y != -100
    assert (
        kept.any()
        and (y[kept] > TASK.keys).all()
        and ((x[kept] >= 1) & (x[kept] <= TASK.keys)).all()
    )
    fixed = TASK.fixed_batches(2, 4, 32)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(fixed, TASK.fixed_batches(2, 4, 32)))


def test_bad_task_is_refused():
    with pytest.raises(UserError, match="exceeds"):
        RetrievalTask(4, 8, 5)
    with pytest.raises(UserError, match="distance"):
        TASK.eval_rows(np.random.default_rng(0), 1, 64, 7)
    with pytest.raises(UserError, match="cannot hold"):
        RetrievalBatches(TASK, 2, 12)


CONFIG = """
[model]
dim = 32
n_layers = 2
n_heads = 2
vocab_size = 33
max_seq_len = 32
[data]
task = "retrieval"
retrieval_keys = 16
retrieval_values = 16
retrieval_pairs = 4
[train]
max_steps = 8
batch_size = 8
seq_len = 32
log_interval = 1
sample_tokens = 0
dtype = "float32"
[optim]
lr = 3e-3
min_lr = 3e-3
warmup_steps = 2
weight_decay = 0.0
[eval]
interval = 4
batches = 2
batch_size = 8
[checkpoint]
interval = 4
"""


def run(tmp_path, out: str, *args: str) -> int:
    config = tmp_path / "retrieval.toml"
    config.write_text(CONFIG)
    return run_command(
        train.main, ["--config", str(config), f"--train.out_dir={tmp_path / out}", *args]
    )


def logged(run_dir, key: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line[key] for line in lines if key in line}


def test_train_py_trains_the_task_validates_its_accuracy_and_resumes_exactly(tmp_path, capsys):
    assert run(tmp_path, "whole") == 0
    accuracy = logged(tmp_path / "whole", "val_acc")
    assert set(accuracy) == {4, 8} and all(0 <= a <= 1 for a in accuracy.values())
    assert not (tmp_path / "whole" / "tokenizer.model").exists()
    assert run(tmp_path, "cut", "--train.max_steps=4") == 0
    # another row stream: refused
    assert run(tmp_path, "cut", "--resume", "--data.retrieval_filler=0.25") == 2
    assert "data.retrieval_filler 0.0 → 0.25" in capsys.readouterr().err
    assert run(tmp_path, "cut", "--resume") == 0
    assert logged(tmp_path / "cut", "loss") == logged(tmp_path / "whole", "loss")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.vocab_size=32"], "set --model.vocab_size=33"),
        (["--train.sample_tokens=10"], "set train.sample_tokens = 0"),
        (["--data.retrieval_pairs=9"], "cannot hold 9 retrieval pairs"),
        (["--data.task=images"], "--data.task must be one of text, retrieval"),
    ],
)
def test_bad_retrieval_config_is_one_line(tmp_path, capsys, args, message):
    assert run(tmp_path, "bad", *args) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1, stderr
