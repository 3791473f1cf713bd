"""train.py over many shards: two torchrun ranks read disjoint rows of each batch; exact resume."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_train import TINY, config_file, losses, run_in_process

from data.build import prepare
from data.loader import RandomBatches, load_meta, open_tokens
from data.tokenizer_training import train_tokenizer

REPO = Path(__file__).resolve().parent.parent
# one torch thread for the in-process runs (conftest's one_thread); the torchrun ranks get one too
pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = (
    "the king queen lord lady sword crown night day love death speak hath thou thee my good noble "
    "fair"
).split()

# train.py on torchrun ranks, each saving the x of each step it trains on to sys.argv[1]/rank<N>.npy
RECORDING = """
import os, sys
sys.path.insert(0, {repo!r})
import numpy as np
import train
from picollama.cli.command import run_command
seen, step = [], train.train_step
def recording(model, optimizer, x, y, *args):
    seen.append(x.cpu().numpy())
    return step(model, optimizer, x, y, *args)
train.train_step = recording
code = run_command(train.main, sys.argv[2:])
np.save(os.path.join(sys.argv[1], f"rank{{os.environ['RANK']}}.npy"), np.stack(seen))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny play corpus prepared into train shards of 3,000 tokens."""
    root = tmp_path_factory.mktemp("sharded")
    rng = random.Random(1)
    (root / "corpus").mkdir()
    for i in range(4):
        speeches = [
            f"{rng.choice(['LEAR', 'KENT'])}.\n" + " ".join(rng.choices(WORDS, k=9))
            for _ in range(300)
        ]
        (root / "corpus" / f"play{i}.txt").write_text(".\n\n".join(speeches) + ".\n")
    out = prepare(
        str(root / "corpus"), 300, out_dir=root / "prepared", shard_tokens=3000, command=["test"]
    )
    assert len(load_meta(out)["splits"]["train"]["shards"]) >= 5
    return out


def window_starts(tokens: np.ndarray, rows: np.ndarray) -> list[int]:
    """Where in the split each row (a window of its tokens) starts; the first match."""
    found = []
    for row in rows:
        candidates = np.flatnonzero(tokens[: len(tokens) - len(row) + 1] == row[0])
        found.append(
            next(int(i) for i in candidates if np.array_equal(tokens[i : i + len(row)], row))
        )
    return found


def test_two_torchrun_ranks_read_disjoint_rows_of_each_global_batch_over_all_shards(
    sharded, tmp_path
):
    steps = 3
    config = config_file(
        tmp_path,
        sharded,
        train={"max_steps": steps, "seed": 5},
        eval={"interval": 0},
        checkpoint={"interval": 0},
    )
    script = tmp_path / "recording.py"
    script.write_text(RECORDING.format(repo=str(REPO)))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
        ]
        + [str(tmp_path), "--config", str(config), f"--train.out_dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr
    ranks = [np.load(tmp_path / f"rank{rank}.npy") for rank in (0, 1)]
    batch, seq_len = TINY["train"]["batch_size"], TINY["train"]["seq_len"]
    assert all(rows.shape == (steps, batch // 2, seq_len) for rows in ranks)
    # the global batch one process draws with the run's seed, row for row: rank 0 the first half,
    # rank 1 the second
    loader = RandomBatches(sharded, "train", batch, seq_len, seed=5)
    for step in range(steps):
        x, _ = loader.next_batch()
        assert np.array_equal(ranks[0][step], x[: batch // 2].numpy())
        assert np.array_equal(ranks[1][step], x[batch // 2 :].numpy())
    tokens = np.asarray(open_tokens(sharded, "train"), dtype=np.int64)
    starts = [window_starts(tokens, rows.reshape(-1, seq_len)) for rows in ranks]
    assert not set(starts[0]) & set(starts[1])  # no window is read by both ranks
    assert len({start // 3000 for start in starts[0] + starts[1]}) >= 3  # drawn across the shards


def test_training_on_many_shards_resumes_exactly(sharded, tmp_path):
    config = config_file(
        tmp_path, sharded, train={"max_steps": 6}, eval={"interval": 0}, checkpoint={"interval": 3}
    )
    assert run_in_process(config, tmp_path / "whole") == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "train_state" / "step_000006")  # resume from step 3
    assert run_in_process(config, tmp_path / "resumed", "--resume") == 0
    for key in ("loss", "val_loss"):
        whole, resumed = losses(tmp_path / "whole", key), losses(tmp_path / "resumed", key)
        assert sorted(whole) == sorted(resumed) and whole == resumed, key
    assert losses(tmp_path / "whole")[6] < losses(tmp_path / "whole")[1]


@pytest.mark.parametrize("swap", ["tokenizer", "bytes_per_token"])
def test_a_tampered_dataset_is_refused_before_training(sharded, tmp_path, capsys, swap):
    """Another dataset's tokenizer.model copied in trained silently; a bytes_per_token of 0 failed
    after training (bits per byte divide by it). Both are one line, before any step."""
    data = tmp_path / "data"
    shutil.copytree(sharded, data)
    if swap == "tokenizer":
        (data / "tokenizer.model").write_bytes(train_tokenizer(["another corpus\n" * 40], 280, 0))
        wanted = f"{data / 'tokenizer.model'} is not the tokenizer {data} was prepared with"
    else:
        meta = load_meta(data)
        (data / "meta.json").write_text(json.dumps(meta | {"bytes_per_token": 0}))
        wanted = f"{data}/meta.json bytes_per_token must be a positive number, not 0"
    config = config_file(tmp_path, data, train={"max_steps": 2}, eval={"interval": 1})
    assert run_in_process(config, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and wanted in err, err
    assert not (tmp_path / "run").exists()
