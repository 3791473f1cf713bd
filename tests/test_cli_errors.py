"""Wrong commands, for every command: a non-zero exit, exactly one `error:` line, no traceback, and every file that
was there before byte for byte unchanged (nothing written, nothing removed)."""

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
import train
from data import prepare
from picollama import cli, convert
from picollama.cli import UserError, run_command

REPO = Path(__file__).resolve().parent.parent
TRAIN = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.batch_size=8",
    "--train.max_steps=2",
    "--train.sample_tokens=0",
    "--eval.batches=1",
]


def small_tokenizer() -> bytes:
    """A real sentencepiece model with fewer pieces (280) than the runs' 320, of another text."""
    return prepare.train_tokenizer(["the cat sat on the mat.\n"] * 50, 280, 0)


@pytest.fixture(scope="module")
def ws(make_tiny_run, tmp_path_factory):
    """A workspace of good and broken inputs; every case runs in it and must leave it as it was."""
    run_dir, data_dir = make_tiny_run(steps=5)
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(run_dir, ws / "run")
    shutil.copytree(data_dir, ws / "data")
    shutil.copytree(data_dir.parent / "corpus", ws / "corpus")
    (ws / "file").write_text("a regular file\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert (
        run_command(
            train.main, [*TRAIN, f"--data.dir={ws / 'data'}", f"--train.out_dir={ws / 'trained'}"]
        )
        == 0
    )
    convert.export_hf(ws / "run", ws / "hf")
    torch.set_num_threads(threads)

    shutil.copytree(ws / "run", ws / "nan_run")  # weights that are not finite
    state = load_file(ws / "nan_run" / "model.safetensors")
    state["tok_embeddings.weight"][3, 5] = float("nan")
    save_file(state, ws / "nan_run" / "model.safetensors")

    shutil.copytree(ws / "run", ws / "mismatch_run")  # config.json does not describe the weights
    config = json.loads((ws / "mismatch_run" / "config.json").read_text())
    config["model"]["dim"] = 64
    (ws / "mismatch_run" / "config.json").write_text(json.dumps(config))

    shutil.copytree(
        ws / "run", ws / "small_tokenizer_run"
    )  # another, smaller tokenizer than the model's
    (ws / "small_tokenizer_run" / "tokenizer.model").write_bytes(small_tokenizer())

    shutil.copytree(
        ws / "data", ws / "other_tokenizer_data"
    )  # the same shards, claimed by another tokenizer
    (ws / "other_tokenizer_data" / "tokenizer.model").write_bytes(small_tokenizer())
    meta = json.loads((ws / "other_tokenizer_data" / "meta.json").read_text())
    meta["tokenizer_sha256"] = hashlib.sha256(small_tokenizer()).hexdigest()
    (ws / "other_tokenizer_data" / "meta.json").write_text(json.dumps(meta))

    shutil.copytree(ws / "data", ws / "truncated_data")  # the val shard one token short
    val = ws / "truncated_data" / "val-00000.bin"
    val.write_bytes(val.read_bytes()[:-2])

    shutil.copytree(
        ws / "data", ws / "data_with_text"
    )  # a prepared dataset holding a text the command reads
    (ws / "data_with_text" / "notes.txt").write_text(
        "a few words to tokenize, read from inside the output\n" * 40
    )

    (ws / "home" / "Documents").mkdir(
        parents=True
    )  # a folder picollama did not write: --force leaves it alone
    (ws / "home" / "Documents" / "thesis.txt").write_text("years of work\n")
    (ws / "home" / ".bashrc").write_text("export EDITOR=vi\n")
    make_device(
        ws / "null"
    )  # an output that is not a file (never /dev/null itself: old code replaced it)
    (ws / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))  # not UTF-8
    edit_json(
        ws,
        "run",
        "bool_as_string_run",
        "config.json",
        lambda c: c["model"].update(tie_embeddings="yes"),
    )
    edit_json(ws, "run", "null_dim_run", "config.json", lambda c: c["model"].update(dim=None))
    edit_json(ws, "data", "string_vocab_data", "meta.json", lambda m: m.update(vocab_size="320"))
    edit_json(
        ws, "hf", "hf_string_tie", "config.json", lambda c: c.update(tie_word_embeddings="false")
    )
    edit_json(ws, "hf", "hf_null_eps", "config.json", lambda c: c.update(rms_norm_eps=None))
    edit_json(
        ws,
        "trained",
        "string_step_trained",
        "train_state/step_000002/meta.json",
        lambda m: m.update(step="2"),
    )
    for name, key, value in [  # sizes no model has: once "out of memory", a traceback or a hang
        ("huge_context_run", "max_seq_len", 10**12),
        ("zero_context_run", "max_seq_len", 0),
        ("huge_dim_run", "dim", 10**12),
        ("many_layers_run", "n_layers", 10**8),
        ("more_layers_run", "n_layers", 1000),
    ]:
        edit_json(
            ws,
            "run",
            name,
            "config.json",
            lambda c, key=key, value=value: c["model"].update({key: value}),
        )
    edit_json(ws, "run", "no_bos_run", "config.json", lambda c: c.pop("tokenizer_sha256"))
    (ws / "no_bos_run" / "tokenizer.model").write_bytes(
        without_bos((ws / "run" / "tokenizer.model").read_bytes())
    )
    meta = "train_state/step_000002/meta.json"
    edit_json(
        ws, "trained", "huge_context_trained", meta, lambda m: m["model"].update(max_seq_len=10**12)
    )
    return ws


def without_bos(model_proto: bytes) -> bytes:
    """The sentencepiece model with no BOS token (its piece kept as an ordinary one), as some imported models have."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
    model.trainer_spec.bos_id = -1
    model.pieces[1].type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return model.SerializeToString()


def make_device(path: Path):
    """A character device like /dev/null at path (root only), else a FIFO: neither may be replaced by an output."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(path)


def edit_json(ws: Path, source: str, copy: str, name: str, edit):
    """A copy of ws/source whose JSON file `name` is changed by edit(dict)."""
    shutil.copytree(ws / source, ws / copy)
    value = json.loads((ws / copy / name).read_text())
    edit(value)
    (ws / copy / name).write_text(json.dumps(value))


def snapshot(root: Path) -> dict:
    """Every path under root, with its bytes' hash for files."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


def bench_main(name: str):
    """A benchmark's main (picollama.lab.bench.NAME)."""
    return importlib.import_module(f"picollama.lab.bench.{name}").main


def train_args(*args):
    return [*TRAIN, "--data.dir={ws}/data", "--train.out_dir={ws}/new", *args]


# (command, argv, a piece of the one error line); {ws} is the workspace
CASES = [
    # train.py: outputs, values, sizes, resumes, data
    ("train", train_args("--train.out_dir={ws}/file/run"), "is a file, not a directory"),
    (
        "train",
        train_args("--train.out_dir=/proc/picollama-run"),
        "cannot write /proc/picollama-run",
    ),
    ("train", train_args("--optim.lr=nan"), "--optim.lr must be finite, not nan"),
    ("train", train_args("--optim.lr=-1"), "--optim.lr must be positive"),
    ("train", train_args("--train.batch_size=0"), "--train.batch_size must be positive, not 0"),
    ("train", train_args("--checkpoint.interval=-1"), "--checkpoint.interval must be zero or more"),
    ("train", train_args("--model.multiple_of=0"), "--model.multiple_of must be positive"),
    ("train", train_args("--model.rope_theta=-1"), "--model.rope_theta must be positive"),
    (
        "train",
        train_args("--model.vocab_size=100000000000"),
        "[model] vocab_size must be at most 4,194,304",
    ),
    ("train", train_args("--model.vocab_size=4000000", "--model.dim=65536"), "out of memory"),
    (
        "train",
        train_args("--train.out_dir={ws}/huge_context_trained", "--resume"),
        "model.max_seq_len must be at most",
    ),
    ("train", train_args("--no_such.key=1"), "unknown config key no_such.key"),
    ("train", train_args("--config", "{ws}/missing.toml"), "cannot read config"),
    ("train", train_args("--resume"), "nothing to resume"),
    ("train", train_args("--train.out_dir={ws}/trained"), "already holds a run"),
    (
        "train",
        train_args("--train.out_dir={ws}/trained", "--resume", "--model.dim=64"),
        "different model",
    ),
    (
        "train",
        train_args(
            "--train.out_dir={ws}/trained",
            "--resume",
            "--train.max_steps=3",
            "--data.dir={ws}/other_tokenizer_data",
        ),
        "trained with another tokenizer",
    ),
    ("train", train_args("--data.dir={ws}/truncated_data"), "truncated"),
    # train.py: a run is continued only by --resume, never written into the dataset; --resume is exact or refused
    ("train", train_args("--train.out_dir={ws}/run"), "already holds a run (model.safetensors)"),
    ("train", train_args("--train.out_dir={ws}/data"), "overlaps the input"),
    ("train", train_args("--train.out_dir={ws}/data/run"), "overlaps the input"),
    ("train", train_args("--train.out_dir={ws}/trained", "--resume"), "nothing to do"),
    (
        "train",
        train_args("--train.out_dir={ws}/trained", "--resume", "--train.batch_size=16"),
        "train.batch_size 8 → 16",
    ),
    (
        "train",
        train_args("--train.out_dir={ws}/trained", "--resume", "--train.seq_len=16"),
        "train.seq_len 32 → 16",
    ),
    (
        "train",
        train_args("--train.out_dir={ws}/string_step_trained", "--resume"),
        "step must be int, not str '2'",
    ),
    (
        "train",
        train_args("--data.dir={ws}/string_vocab_data"),
        "meta.json vocab_size must be int, not str",
    ),
    (
        "train",
        train_args("--train.sample_tokens=40"),
        "train.sample_tokens (40) and the prompt (1 tokens): 41 tok",
    ),
    (
        "train",
        train_args("--train.sample_tokens=20", "--train.sample_prompt=" + "a b c d " * 8),
        "and the prompt (",
    ),
    # generate.py
    ("generate", ["--run", "{ws}/missing"], "not a picollama run directory"),
    ("generate", ["--run", "{ws}/run/model.safetensors"], "pass the run directory"),
    # a Hugging Face directory is imported (into the cache): a broken one fails there, in one line
    ("generate", ["--run", "{ws}/hf_null_eps"], "rms_norm_eps must be float, not NoneType"),
    ("generate", ["--run", "{ws}/nan_run"], "NaN or infinite weights"),
    ("generate", ["--run", "{ws}/mismatch_run"], "model.dim is 64 there, 32 in the weights"),
    (
        "generate",
        ["--run", "{ws}/huge_context_run"],
        "config.json is corrupt: model.max_seq_len must be at most",
    ),
    (
        "generate",
        ["--run", "{ws}/zero_context_run"],
        "corrupt: model.max_seq_len must be positive, not 0",
    ),
    (
        "generate",
        ["--run", "{ws}/huge_dim_run"],
        "config.json is corrupt: model.dim must be at most 65,536",
    ),
    (
        "generate",
        ["--run", "{ws}/many_layers_run"],
        "config.json is corrupt: model.n_layers must be at most",
    ),
    (
        "generate",
        ["--run", "{ws}/more_layers_run"],
        "model.n_layers is 1000 there, 2 in the weights",
    ),
    (
        "generate",
        ["--run", "{ws}/no_bos_run"],
        "no_bos_run: its tokenizer has no BOS token to begin an empty",
    ),
    (
        "generate",
        ["--run", "{ws}/small_tokenizer_run"],
        "not the tokenizer the model was saved with",
    ),
    (
        "generate",
        ["--run", "{ws}/run", "--temperature", "nan"],
        "temperature must be a finite number",
    ),
    (
        "generate",
        ["--run", "{ws}/run", "--rope-scaling", "ntk", "--rope-factor", "0"],
        "--rope-factor",
    ),
    (
        "generate",
        ["--run", "{ws}/run", "--rope-scaling", "yarn", "--rope-factor", "inf"],
        "--rope-factor",
    ),
    (
        "generate",
        ["--run", "{ws}/run", "--rope-scaling", "none", "--rope-factor", "4"],
        "--rope-factor",
    ),
    ("generate", ["--run", "{ws}/run", "--prompt-file", "{ws}/missing.txt"], "--prompt-file"),
    ("generate", ["--run", "{ws}/run", "--top-k", "0"], "--top-k"),
    (
        "generate",
        ["--run", "{ws}/run", "--prompt-file", "{ws}/latin1.txt"],
        "is not UTF-8 text (byte 3)",
    ),
    ("generate", ["--run", "{ws}/run", "--device", "mps"], "MPS (Apple's GPU) is not available"),
    ("generate", ["--run", "{ws}/run", "--device", "meta"], "picollama runs on cpu, cuda"),
    (
        "generate",
        ["--run", "{ws}/bool_as_string_run"],
        "model.tie_embeddings must be bool, not str 'yes'",
    ),
    ("generate", ["--run", "{ws}/null_dim_run"], "model.dim must be int, not NoneType None"),
    # generate.py extrapolate
    (
        "generate",
        ["extrapolate", "--run", "{ws}/run", "--out", "{ws}/file"],
        "is a file, not a directory",
    ),
    ("generate", ["extrapolate", "--run", "{ws}/run", "--out", "/proc/picollama"], "cannot write"),
    (
        "generate",
        ["extrapolate", "--run", "{ws}/run", "--lengths", "100,abc"],
        "'abc' is not a positive int",
    ),
    (
        "generate",
        ["extrapolate", "--run", "{ws}/run", "--seed", "-1"],
        "--seed: invalid non-negative int value: '-1'",
    ),
    (
        "generate",
        ["extrapolate", "--run", "{ws}/run", "--data", "{ws}/other_tokenizer_data"],
        "tokenizer",
    ),
    (
        "generate",
        [
            "extrapolate",
            "--run",
            "{ws}/run",
            "--data",
            "{ws}/truncated_data",
            "--out",
            "{ws}/report",
        ],
        "truncated",
    ),
    ("generate", ["extrapolate", "--run", "{ws}/nan_run"], "NaN or infinite weights"),
    (
        "generate",
        ["extrapolate", "--run", "{ws}/huge_context_run"],
        "corrupt: model.max_seq_len must be at",
    ),
    (
        "generate",
        ["extrapolate", "--run", "{ws}/run", "--device", "mps"],
        "MPS (Apple's GPU) is not available",
    ),
    # convert.py
    (
        "convert",
        ["to-hf", "--run", "{ws}/run", "--out", "{ws}/run", "--force"],
        "overlaps the input",
    ),
    ("convert", ["to-hf", "--run", "{ws}/run", "--out", "{ws}", "--force"], "overlaps the input"),
    (
        "convert",
        ["to-hf", "--run", "{ws}/run", "--out", "{ws}/run/hf", "--force"],
        "overlaps the input",
    ),
    ("convert", ["to-hf", "--run", "{ws}/run", "--out", "{ws}/hf"], "pass --force to replace it"),
    (
        "convert",
        ["to-hf", "--run", "{ws}/run", "--out", "{ws}/file/hf"],
        "is a file, not a directory",
    ),
    ("convert", ["to-hf", "--run", "{ws}/run", "--out", "/proc/picollama-hf"], "cannot write"),
    ("convert", ["to-hf", "--run", "{ws}/nan_run", "--out", "{ws}/out"], "NaN or infinite weights"),
    (
        "convert",
        ["to-gguf", "--run", "{ws}/huge_dim_run", "--out", "{ws}/o.gguf"],
        "config.json is corrupt: model.dim",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/run", "--out", "{ws}/out"],
        "not a Hugging Face Llama config",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/hf", "--out", "{ws}/hf", "--force"],
        "overlaps the input",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/hf_string_tie", "--out", "{ws}/out"],
        "tie_word_embeddings must be bool, not str 'false'",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/hf_null_eps", "--out", "{ws}/out"],
        "rms_norm_eps must be float, not NoneType",
    ),
    ("convert", ["to-gguf", "--run", "{ws}/run", "--out", "{ws}/null", "--force"], "null: it is a"),
    ("convert", ["to-hf", "--run", "{ws}/run", "--out", "{ws}/null", "--force"], "null: it is a"),
    (
        "convert",
        ["to-hf", "--run", "{ws}/run", "--out", "{ws}/home", "--force"],
        "not replacing {ws}/home: it holds",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/hf", "--out", "{ws}/home", "--force"],
        "so picollama did not write it",
    ),
    (
        "convert",
        ["from-hf", "--hf-dir", "{ws}/hf", "--out", "{ws}/home/Documents", "--force"],
        "holds thesis.txt",
    ),
    (
        "convert",
        ["to-gguf", "--run", "{ws}/run", "--out", "{ws}/file", "--force"],
        "file: it is not a GGUF file, so",
    ),
    # data/prepare.py
    ("prepare", ["--source", "{ws}/missing", "--out", "{ws}/out"], "no such file or directory"),
    ("prepare", ["--source", "{ws}/corpus", "--out", "/proc/picollama-data"], "cannot write"),
    ("prepare", ["--source", "{ws}/corpus", "--out", "{ws}/file"], "is not a prepared dataset"),
    (
        "prepare",
        ["--source", "{ws}/corpus", "--out", "{ws}/out", "--vocab-size", "0"],
        "--vocab-size",
    ),
    (
        "prepare",
        ["--source", "{ws}/corpus", "--out", "{ws}/out", "--max-bytes", "lots"],
        "not a size",
    ),
    (
        "prepare",
        ["--source", "{ws}/data_with_text/notes.txt", "--out", "{ws}/data_with_text", "--force"],
        "overlaps",
    ),
    # bench/
    (
        "bench.train",
        ["--config", "no-such-config", "--out", "{ws}/bench.json"],
        "no config 'no-such-config'",
    ),
    (
        "bench.train",
        ["--threads", "0", "--out", "{ws}/bench.json"],
        "--threads: invalid positive int value: '0'",
    ),
    ("bench.decode", ["--positions", "16,abc", "--out", "{ws}/bench.json"], "--positions"),
    ("bench.memory", ["--smoke", "--out", "{ws}/file/bench.json"], "is a file, not a directory"),
    ("bench.data", ["--smoke", "--out", "/proc/picollama.json"], "cannot write"),
    ("bench.data", ["--smoke", "--out", "{ws}/null"], "null: it is a"),
    ("bench.memory", ["--smoke", "--out", "{ws}/null"], "null: it is a"),
]
MAINS = {
    "train": train.main,
    "generate": generate.main,
    "convert": convert.main,
    "prepare": prepare.main,
}


@pytest.mark.parametrize(
    "command, argv, message", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)]
)
def test_a_wrong_command_is_one_line_and_changes_nothing(
    ws, one_thread, capsys, monkeypatch, tmp_path, command, argv, message
):
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path))  # where generate imports a model
    main = bench_main(command[6:]) if command.startswith("bench.") else MAINS[command]
    before = snapshot(ws)
    status = run_command(main, [arg.replace("{ws}", str(ws)) for arg in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message.replace("{ws}", str(ws)) in err, err
    assert snapshot(ws) == before


def test_as_scripts_too(ws, tmp_path):
    """A few of the cases above as real processes, all at once: the `error:` line and the exit status come from the
    scripts' own entry points."""
    commands = [
        ["train.py", *train_args("--train.out_dir=/proc/picollama-run")],
        ["generate.py", "--run", "{ws}/hf_null_eps"],
        ["-m", "picollama.convert", "to-hf", "--run", "{ws}/run", "--out", "{ws}/run", "--force"],
        ["data/prepare.py", "--source", "{ws}/corpus", "--out", "/proc/picollama-data"],
        ["-m", "picollama.lab.bench.decode", "--positions", "16,abc", "--out", "{ws}/bench.json"],
    ]
    before = snapshot(ws)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PICOLLAMA_CACHE": str(tmp_path)}
    processes = [
        subprocess.Popen(
            [sys.executable, *(arg.replace("{ws}", str(ws)) for arg in command)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for command in commands
    ]
    for command, process in zip(commands, processes, strict=True):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (command, err)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert (
            len(errors) == 1 and err.rstrip("\n").endswith(errors[0]) and "Traceback" not in err
        ), (command, err)
    assert snapshot(ws) == before


# ---------------------------------------------------------------- outputs that are not files, locks, signals, disks


def test_outputs_that_are_not_files_are_refused_and_left_alone(ws, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    make_device(tmp_path / "device")
    outputs = {
        tmp_path / "fifo": "a FIFO",
        tmp_path / "loop": "a symbolic link loop",
        tmp_path / "device": "it is a",
    }
    for path, kind in outputs.items():
        for argv in (
            ["to-gguf", "--run", str(ws / "run"), "--out", str(path), "--force"],
            ["to-hf", "--run", str(ws / "run"), "--out", str(path)],
        ):
            assert run_command(convert.main, argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"cannot write {path}: " in err and kind in err, err
        with pytest.raises(UserError, match=kind):
            with cli.atomic_output(path) as tmp:
                tmp.write_text("never renamed over it")
    assert (
        stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and not (tmp_path / "device").is_file()
    )
    assert (tmp_path / "loop").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [
        "device",
        "fifo",
        "loop",
    ]


def test_force_replaces_what_picollama_wrote(ws, tmp_path, capsys):
    """--force replaces an export, a run with its training state, a GGUF file, and what an interrupted save left."""
    shutil.copytree(ws / "trained", tmp_path / "trained")
    shutil.copytree(ws / "hf", tmp_path / "hf")
    (tmp_path / "hf" / ".model.safetensors.tmp-4242").write_bytes(b"half a save")
    for argv in (
        ["from-hf", "--hf-dir", str(ws / "hf"), "--out", str(tmp_path / "trained"), "--force"],
        ["to-hf", "--run", str(ws / "run"), "--out", str(tmp_path / "hf"), "--force"],
        ["to-gguf", "--run", str(ws / "run"), "--out", str(tmp_path / "m.gguf")],
        ["to-gguf", "--run", str(ws / "run"), "--out", str(tmp_path / "m.gguf"), "--force"],
    ):
        assert run_command(convert.main, argv) == 0, capsys.readouterr().err
    imported = sorted(p.name for p in (tmp_path / "trained").iterdir())
    # the export's files, with the tokenizer_config.json beside its tokenizer; none of the old run
    assert imported == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert not (tmp_path / "hf" / ".model.safetensors.tmp-4242").exists()


def test_a_second_prepare_into_one_out_waits_for_none(ws, tmp_path, capsys):
    """The one-writer lock: while a process holds --out, another prepare says who and writes nothing."""
    out = tmp_path / "data"
    with cli.exclusive(out):
        assert (tmp_path / ".data.lock").read_text() == f"{os.getpid()}\n"
        assert run_command(prepare.main, ["--source", str(ws / "corpus"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is in use by another process (pid {os.getpid()}" in err, err
    assert list(tmp_path.iterdir()) == []  # no output, and the lock file is gone with its holder


def test_a_swallowed_interrupt_still_ends_in_one_error_line(capsys):
    """Ctrl-C that lands in a __del__ is printed by Python as "Exception ignored" and swallowed: the command would
    exit 0. run_command still ends it with one `error:` line and status 130."""

    class Interrupting:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, inside __del__

    def main(argv):
        Interrupting()
        return 0

    assert run_command(main, []) == 130
    err = capsys.readouterr().err
    assert err == "error: interrupted\n", err


def test_compile_without_a_compiler_is_refused_before_work(ws, capsys):
    import torch._inductor.config as inductor

    # inductor's own patch: a monkeypatched config entry reads as "does not exist" once restored
    with inductor.patch({"cpp.cxx": (None, "/no/such/g++")}):
        argv = [*train_args("--train.compile=true")]
        assert run_command(train.main, [arg.replace("{ws}", str(ws)) for arg in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--compile needs a working C++ compiler" in err, err
        assert not (ws / "new").exists()
        args = generate.parser().parse_args(["--run", str(ws / "run"), "--compile"])
        with pytest.raises(UserError, match="--compile needs a working C\\+\\+ compiler"):
            generate.sample_command(args)
