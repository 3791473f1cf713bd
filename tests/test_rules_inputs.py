"""The input rules of docs/guarantees.md, each walked over the commands it covers: small text files
the user names, a study that stops at once, relations between config keys, a dataset's meta.json
counts, a benchmark's --smoke and --config, and a copy probe that must fit."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import generate
import train
from data.loader import checked_meta
from picollama import REPO_ROOT
from picollama.chat_template import load_chat_template
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.user_files import SMALL_TEXT_BYTES
from picollama.config.checks import check_config
from picollama.config.training import parse_cli
from picollama.lab import study
from picollama.lab.bench import common
from picollama.lab.bench import decode as bench_decode
from picollama.lab.bench import memory as bench_memory
from picollama.lab.bench import train as bench_train
from picollama.lab.measure import switches
from picollama.lab.recipe import load_recipe
from picollama.lab.trainings import Trainings
from picollama.sampling.prompts import prompt_file_size


@pytest.fixture(scope="module")
def tiny(make_tiny_run, one_thread) -> tuple[Path, Path]:
    return make_tiny_run(steps=1)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- small text files the user names


def read_config(path):
    return parse_cli(["--config", str(path)])


def read_template(path):
    return load_chat_template(None, path)


def read_bench_config(path):
    return common.model_args(str(path))


def read_prompt_file(path):
    return prompt_file_size(path)


READERS = {  # flag: (what reads it, whether it reads the text: size and UTF-8 checked)
    "--config": (read_config, True),
    "--chat-template": (read_template, True),
    "--recipe": (load_recipe, True),
    "--config (benchmarks)": (read_bench_config, True),
    "--prompt-file": (read_prompt_file, False),
}
FILES = {  # case: (what the file is, the refusal's words)
    "/dev/zero": ("device", "is a character device, not a regular file"),
    "a FIFO": ("fifo", "is a FIFO, not a regular file"),
    "a directory": ("dir", "is a directory, not a regular file"),
    "absent": ("absent", "No such file or directory"),
    "over the size limit": ("big", f"holds {SMALL_TEXT_BYTES + 1:,} bytes: at most"),
    "not UTF-8": ("latin1", "is not UTF-8 text (byte 1)"),
}
FILES_KINDS = ("/dev/zero", "a FIFO", "a directory", "absent")


def hostile_file(kind: str, folder: Path) -> Path:
    """A path named x.toml (the benchmarks take a config by that suffix) that is `kind`."""
    path = folder / "x.toml"
    target = folder / "target"
    if kind == "device":
        target = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind == "big":
        target.write_bytes(b"#" * (SMALL_TEXT_BYTES + 1))
    elif kind == "latin1":
        target.write_bytes(b"#\xe9\n")
    if kind != "absent":
        path.symlink_to(target)
    return path


# --prompt-file's size and text are read_prompts' (a limit of its own): only its kind here
FILE_CASES = [
    (flag, case) for flag in READERS for case in FILES if READERS[flag][1] or case in FILES_KINDS
]


@pytest.mark.parametrize("flag, case", FILE_CASES)
def test_a_small_text_file_is_a_regular_bounded_file(flag, case, tmp_path):
    """--config /dev/zero read until the OOM killer, a FIFO blocked for ever: every small text file
    the user names is refused, before it is opened, unless it is a regular file of at most 1 MB."""
    read, _ = READERS[flag]
    kind, words = FILES[case]
    path = hostile_file(kind, tmp_path)
    with pytest.raises(UserError) as refusal:
        read(path)
    message = str(refusal.value)
    if flag == "--config (benchmarks)" and kind == "absent":  # a name or a path: its own words
        assert message.startswith(f"no config '{path}'"), message
        return
    assert words in message and message.startswith(f"{flag.split()[0]} {path}"), message


def test_train_refuses_config_dev_zero_in_one_line(capsys):
    assert run_command(train.main, ["--config", "/dev/zero"]) == 2
    assert "--config /dev/zero is a character device" in one_error(capsys)


# ---------------------------------------------------------------- a study stops at once


def test_a_stopped_queue_starts_nothing_and_stops_its_runs(monkeypatch, tmp_path):
    """Ctrl-C during a study stopped the running trainings, then trained every queued run (82 s):
    the first failure or interrupt now stops the running ones and starts no other."""
    started = []

    def fake_train_run(name, command, out, trainings):
        if name == "interrupted":
            time.sleep(0.5)  # the others are running
            raise KeyboardInterrupt
        process = trainings.start(["sleep", "30"])
        started.append(process)
        os.waitpid(process.pid, 0)
        trainings.ended(process)
        return {}

    monkeypatch.setattr(study, "train_run", fake_train_run)
    runs = [SimpleNamespace(name=name, source=None) for name in ["a", "interrupted", *"bcdefg"]]
    clock = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        study.train_all(runs, {run.name: [] for run in runs}, tmp_path, jobs=3)
    assert time.perf_counter() - clock < 10
    assert len(started) == 2  # a and b, running when the interrupt came; c..g never started


def test_a_stopped_group_refuses_to_start():
    trainings = Trainings()
    process = trainings.start(["sleep", "30"])
    waiter = threading.Thread(target=os.waitpid, args=(process.pid, 0))
    waiter.start()
    trainings.stop()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    with pytest.raises(UserError, match="interrupted"):
        trainings.start(["true"])


# ---------------------------------------------------------------- relations between config keys

RELATIONS = {  # case: (overrides, the refusal or None)
    "min_lr above lr": (["--optim.lr=0.001", "--optim.min_lr=1"], "optim.min_lr (1) must be at"),
    "min_lr equal to lr": (["--optim.lr=0.001", "--optim.min_lr=0.001"], None),
    "min_lr below lr": (["--optim.lr=0.001", "--optim.min_lr=0.0001"], None),
}


@pytest.mark.parametrize("source", ["flags", "TOML"])
@pytest.mark.parametrize("case", RELATIONS)
def test_min_lr_is_at_most_lr(case, source, tmp_path):
    overrides, refusal = RELATIONS[case]
    argv = ["--config", str(REPO_ROOT / "configs" / "default.toml")]
    if source == "TOML":
        values = dict(o.removeprefix("--optim.").split("=") for o in overrides)
        toml = tmp_path / "c.toml"
        toml.write_text("[optim]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
        argv = ["--config", str(toml)]
    else:
        argv += overrides
    cfg, _ = parse_cli(argv)
    if refusal is None:
        check_config(cfg, 1)
        return
    with pytest.raises(UserError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        check_config(cfg, 1)


# ---------------------------------------------------------------- a dataset's meta.json counts

META = {  # case: (key path, value, the refusal)
    "vocab_size 0": (["vocab_size"], 0, "meta.json vocab_size must be 1 to 4,194,304, not 0"),
    "vocab_size negative": (["vocab_size"], -5, "vocab_size must be 1 to 4,194,304, not -5"),
    "vocab_size too large": (["vocab_size"], 1 << 23, "not 8,388,608"),
    "train tokens lie": (["splits", "train", "tokens"], 10**12, "splits.train.tokens is 1,000,"),
    "val tokens lie": (["splits", "val", "tokens"], 1, "splits.val.tokens is 1, but its shards"),
}


@pytest.mark.parametrize("case", META)
def test_meta_json_counts_are_checked(case, tiny, tmp_path):
    keys, value, refusal = META[case]
    data_dir = tmp_path / "data"
    shutil.copytree(tiny[1], data_dir)
    checked_meta(data_dir)  # the dataset as prepared
    meta = json.loads((data_dir / "meta.json").read_text())
    inner = meta
    for key in keys[:-1]:
        inner = inner[key]
    inner[keys[-1]] = value
    (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=refusal):
        checked_meta(data_dir)


# ---------------------------------------------------------------- benchmarks: --smoke, --config

SMOKE_OWN_MODEL = {"train": bench_train, "memory": bench_memory, "decode": bench_decode}


@pytest.mark.parametrize("name", SMOKE_OWN_MODEL)
def test_smoke_with_config_is_refused(name, tmp_path):
    """bench.train --smoke --config nonexistent ignored --config: where --smoke measures its own
    tiny model, a --config with it is refused; without it, --smoke runs."""
    out = str(tmp_path / "r.json")
    with pytest.raises(UserError, match="--smoke measures its own tiny model, not --config"):
        SMOKE_OWN_MODEL[name].parse_args(["--smoke", "--config", "nonexistent", "--out", out])
    assert SMOKE_OWN_MODEL[name].parse_args(["--smoke", "--out", out]).smoke


@pytest.mark.parametrize("given", [None, "mine.toml"])
def test_switches_config_from_any_folder(given, tmp_path, monkeypatch):
    """bench.switches failed outside the repository ("cannot read config configs/default.toml"):
    the default is the repository's; a given relative path is the caller's (train.py runs in the
    repository)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO_ROOT / "configs" / "default.toml", tmp_path / "mine.toml")
    argv = ["--smoke", "--out", str(tmp_path / "s.json")]
    args = switches.parse_args(argv + (["--config", given] if given else []))
    expected = tmp_path / given if given else REPO_ROOT / "configs" / "default.toml"
    assert Path(args.config_file) == expected and Path(args.config_file).is_absolute()
    parse_cli(["--config", args.config_file])  # readable from here


# ---------------------------------------------------------------- extrapolate: a probe that fits


@pytest.mark.parametrize(
    "span, refused", [(100000, True), (33, True), (32, False)], ids=["huge", "one over", "fits"]
)
def test_probe_span_must_fit(span, refused, tiny, tmp_path, capsys):
    """--probes 2 --probe-span 100000 dropped the probe and reported "--probes 0": a span that no
    tested length holds twice is refused, naming --probe-span and the limit (longest / 2)."""
    argv = ["extrapolate", "--run", str(tiny[0]), "--lengths", "64", "--methods", "none"]
    argv += ["--num-windows", "1", "--probes", "2", "--probe-span", str(span)]
    status = run_command(generate.main, [*argv, "--out", str(tmp_path / "e")])
    if refused:
        assert status == 2
        assert f"--probe-span {span} does not fit" in one_error(capsys)
    else:
        assert status == 0
        report = json.loads((tmp_path / "e" / "extrapolation.json").read_text())
        assert report["probe"]["count"] == 2 and report["probe"]["distances"]


def test_probe_span_limit_named(tiny, tmp_path, capsys):
    argv = ["extrapolate", "--run", str(tiny[0]), "--lengths", "64", "--methods", "none"]
    argv += ["--probes", "2", "--probe-span", "40", "--out", str(tmp_path / "e")]
    assert run_command(generate.main, argv) == 2
    assert "within the longest length, 64 tokens, so at most 32" in one_error(capsys)


def test_fifo_config_in_a_process_answers_at_once(tmp_path):
    """`train.py --config FIFO` blocked for ever; now one line, at once."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "--config", str(fifo)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and done.stderr.strip() == (
        f"error: --config {fifo} is a FIFO, not a regular file"
    ), done.stderr
