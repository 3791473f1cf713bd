"""The rule of where an output goes (output_place.check_output_place), walked over every writer
x every place it must refuse, and wandb.enabled refused in one line before a run without a key."""

import importlib
import os
import shutil
import sys
from pathlib import Path

import pytest

import train
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.config.training import parse_cli
from picollama.convert import main as convert
from picollama.training import metrics

prepare_command = importlib.import_module("data.prepare")

TINY = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=64",
    "--train.seq_len=64",
    "--train.max_steps=3",
    "--eval.interval=0",
    "--train.sample_tokens=0",
    "--train.device=cpu",
]


@pytest.fixture(scope="module")
def places(make_tiny_run, one_thread, tmp_path_factory) -> dict:
    """A tiny run, its dataset and corpus, a training run (train_state/), a GGUF, an HF export and
    a user's folder, side by side."""
    run, data = make_tiny_run(steps=1)
    root = run.parent
    trained = root / "trained"
    shutil.copytree(run, trained)
    (trained / "train_state" / "step_1").mkdir(parents=True)
    (trained / "train_state" / "step_1" / "meta.json").write_text("{}")
    to_gguf = ["to-gguf", "--run", str(run), "--out", str(root / "t.gguf")]
    assert run_command(convert.main, to_gguf) == 0
    assert run_command(convert.main, ["to-hf", "--run", str(run), "--out", str(root / "hf")]) == 0
    user = root / "user"
    (user / "mydir").mkdir(parents=True)
    (user / "README.md").write_text("# my notes\n")
    (user / "notes.txt").write_text("years of work\n")
    return {"root": root, "run": run, "data": data, "corpus": root / "corpus", "trained": trained,
            "gguf": root / "t.gguf", "hf": root / "hf", "user": user}  # fmt: skip


def argv(command: str, p: dict, out: Path) -> tuple:
    """(main, argv) of `command` writing `out` from the inputs in `p` (--force where it has one)."""
    if command == "train.py":
        data = [f"--data.dir={p['data']}", f"--data.source={p['corpus']}"]
        return train.main, [*TINY, *data, f"--train.out_dir={out}"]
    if command == "prepare":
        source = ["--source", str(p["corpus"]), "--tokenizer", str(p["run"])]
        return prepare_command.main, [*source, "--out", str(out), "--force"]
    source = {"from-gguf": ("--gguf", p["gguf"]), "from-hf": ("--hf-dir", p["hf"])}
    flag, given = source.get(command, ("--run", p["run"]))
    return convert.main, [command, flag, str(given), "--out", str(out), "--force"]


# each writer's own input (for "is" and "inside" it), and where it writes a file, not a folder
OWN_INPUT = {"train.py": "corpus", "prepare": "corpus", "to-hf": "run", "to-gguf": "run",
             "from-gguf": "gguf", "from-hf": "hf"}  # fmt: skip
PLACES = {  # name: (out, under the root; {command: the message's words}, "" = any one line)
    "its own input": ("{own}", {"": "overlaps the input"}),
    "inside its own input": ("{own}/sub", {"": "(it lies inside it)"}),
    "inside a dataset": ("data/sub", {"": "lies inside"}),
    "inside a training run": ("trained/sub", {"": "lies inside"}),
    "inside an imported run": ("run/sub", {"": "lies inside"}),
    "a training run, --force": ("trained", {"train.py": None, "to-gguf": "", "": "not replacing"}),
    "a dataset, --force": (
        "data",
        {"prepare": None, "train.py": " is ", "to-gguf": "", "": "not replacing"},
    ),  # fmt: skip
    "a user's folder": ("user", {"train.py": "not a run directory", "": ""}),
}


def tree(root: Path) -> dict:
    """Every path under root, a file's with its size and modification time: what a refusal must
    not change (a folder's own time changes with check_writable's test of writing there)."""
    found = {}
    for folder, names, files in os.walk(root):
        found |= {Path(folder) / name: None for name in names}
        for name in files:
            path = Path(folder) / name
            found[path] = (path.stat().st_size, path.stat().st_mtime_ns)
    return found


def words(command: str, place: str) -> str | None:
    """What `command`'s refusal of `place` says (None: it writes there itself, and its own checks,
    resume or reuse, decide)."""
    said = PLACES[place][1]
    return said.get(command, said[""])


CASES = [(c, p) for c in OWN_INPUT for p in PLACES if words(c, p) is not None]


@pytest.mark.parametrize(("command", "place"), CASES)
def test_no_writer_writes_into_an_input_or_another_commands_folder(command, place, places, capsys):
    out, said = PLACES[place][0], words(command, place)
    out = places["root"] / out.format(own=places[OWN_INPUT[command]].name)
    if command == "to-gguf":
        out = out / "m.gguf" if "inside" in place else out
    before = tree(places["root"])
    main, args = argv(command, places, out)
    assert run_command(main, args) == 2, (command, place)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert tree(places["root"]) == before, (command, place)


@pytest.mark.parametrize("command", OWN_INPUT)
def test_a_new_folder_beside_the_inputs_is_fine(command, places, tmp_path):
    """The rule refuses places, not writers: each command still writes a fresh output (train.py's
    checks only: training is other tests')."""
    out = tmp_path / ("m.gguf" if command == "to-gguf" else "out")
    main, args = argv(command, places, out)
    if command == "train.py":
        from picollama.training.checks import check_out_dir

        check_out_dir(parse_cli(args)[0])
        (out / "metrics.jsonl").parent.mkdir()
        (out / "metrics.jsonl").write_text("")  # a run interrupted before its first checkpoint
        check_out_dir(parse_cli(args)[0])
        return
    assert run_command(main, args) == 0
    assert out.exists()


# ---------------------------------------------------------------- wandb: a key, or one error line


def no_wandb(monkeypatch, tmp_path):
    """wandb fails to import: as if it were not installed."""
    monkeypatch.setitem(sys.modules, "wandb", None)


def no_key(monkeypatch, tmp_path):
    """wandb installed, no login: no WANDB_API_KEY, no ~/.netrc (wandb.login's own lookup)."""
    pytest.importorskip("wandb", reason="wandb (a dev dependency) is not installed")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))


WANDB_CASES = {  # name: (the setting up, the words of the error line)
    "not installed": (no_wandb, "wandb.enabled needs the wandb package"),
    "no API key": (no_key, "WANDB_MODE=offline"),
}


@pytest.mark.parametrize("case", WANDB_CASES)
def test_wandb_without_a_key_is_one_error_line_before_any_work(
    case, places, tmp_path, monkeypatch, capsys
):
    set_up, said = WANDB_CASES[case]
    set_up(monkeypatch, tmp_path)
    out = tmp_path / "run"
    _, args = argv("train.py", places, out)
    assert run_command(train.main, [*args, "--wandb.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert not out.exists()


def test_offline_wandb_needs_no_key_and_a_refusing_server_is_one_line(
    places, tmp_path, monkeypatch
):
    wandb = pytest.importorskip("wandb", reason="wandb (a dev dependency) is not installed")
    no_key(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = parse_cli([*argv("train.py", places, tmp_path / "run")[1], "--wandb.enabled=true"])[0]
    metrics.check_wandb(cfg)  # no error

    def refused(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refused)
    with pytest.raises(UserError, match="wandb.enabled: wandb cannot log this run: No API key"):
        metrics.RunLog(cfg, tmp_path / "run", 0, 3, True)
