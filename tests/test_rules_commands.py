"""The command-level rules of docs/guarantees.md, each walked over the commands it covers: one value
per flag, --help offers what is taken, a resume keeps its source, sizes from one place, outputs
writable before the work, bounded file counts, .gguf in any case, messages in our words."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_reliability_rules import edited_gguf

import generate
import train
from data import prepare, shards
from picollama import device
from picollama.cli import UserError, outputs
from picollama.cli.command import run_command
from picollama.config.training import build_config, parse_cli
from picollama.convert import main as convert
from picollama.lab.measure import data as bench_data
from picollama.run_files import is_gguf_file, load_run

LIBRARY_WORDS = ("codec can't decode", "invalid enumerator", "Seed must be between", "Traceback")


@pytest.fixture(scope="module")
def tiny(make_tiny_run, one_thread) -> tuple[Path, Path]:
    return make_tiny_run(steps=1)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory) -> Path:
    from picollama.convert.to_gguf import write_gguf

    model, _, tokenizer = load_run(tiny[0], "cpu", torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, tokenizer, path, "f32", "tiny")
    return path


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert not any(words in err for words in LIBRARY_WORDS), err
    return err


def hashes(folder: Path) -> dict:
    return {
        p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- one value per flag

TWICE = {  # command: (how it parses argv, argv with the flag twice, what the refusal names)
    "convert to-hf --run A --run B": (
        convert.parser().parse_args,
        ["to-hf", "--run", "A", "--run", "B", "--out", "O"],
        "--run was given twice (A, then B)",
    ),
    "convert to-hf --run A B OUT": (
        convert.parser().parse_args,
        ["to-hf", "--run", "A", "B", "OUT"],
        "--run and the positional IN OUT were given (A, then B)",
    ),
    "convert to-gguf --checkpoint": (
        convert.parser().parse_args,
        ["to-gguf", "--run", "A", "--checkpoint", "B", "--out", "O"],
        "--run and --checkpoint were given (A, then B)",
    ),
    "convert from-gguf --out": (
        convert.parser().parse_args,
        ["from-gguf", "--gguf", "g", "--out", "O", "--out", "P"],
        "--out was given twice (O, then P)",
    ),
    "generate --prompt": (
        generate.parser().parse_args,
        ["--run", "A", "--prompt", "x", "--prompt", "y"],
        "--prompt was given twice (x, then y)",
    ),
    "generate --compile --no-compile": (
        generate.parser().parse_args,
        ["--run", "A", "--compile", "--no-compile"],
        "--compile and --no-compile were given; give one",
    ),
    "generate extrapolate --run": (
        generate.parser().parse_args,
        ["extrapolate", "--run", "A,B", "--run", "C"],
        "--run was given twice (A,B, then C)",
    ),
    "prepare --source": (
        prepare.parse_args,
        ["--source", "a.txt", "--source", "b.txt"],
        "--source was given twice (a.txt, then b.txt)",
    ),
    "train --seed": (
        parse_cli,
        ["--seed", "1", "--seed", "2"],
        "--seed was given twice (1, then 2)",
    ),
    "train --out": (parse_cli, ["--out", "a", "--out", "b"], "--out was given twice (a, then b)"),
    "bench.data --out": (
        bench_data.parse_args,
        ["--smoke", "--out", "a.json", "--out", "b.json"],
        "--out was given twice (a.json, then b.json)",
    ),
}


@pytest.mark.parametrize("command", TWICE)
def test_a_flag_given_twice_with_different_values_is_refused(command):
    parse, argv, said = TWICE[command]
    with pytest.raises(UserError) as refused:
        parse(argv)
    assert said in str(refused.value)


@pytest.mark.parametrize(
    "parse, argv",
    [
        (convert.parser().parse_args, ["to-hf", "--run", "A", "--run", "A", "--out", "O"]),
        (generate.parser().parse_args, ["--run", "A", "--seed", "3", "--seed", "3"]),
        (parse_cli, ["--train.max_steps=3", "--train.max_steps=4"]),  # a later layer wins
        (parse_cli, ["--train.out_dir=a", "--train.out_dir=b"]),
    ],
    ids=["the same path twice", "the same seed twice", "a setting layered", "a path layered"],
)
def test_what_is_not_two_values_passes(parse, argv):
    parse(argv)


def test_convert_to_hf_run_a_b_out_exports_nothing(tiny, tmp_path, capsys):
    """The issue's example: `to-hf --run A B OUT` exported B, exit 0."""
    other = tmp_path / "other"
    shutil.copytree(tiny[0], other)
    out = tmp_path / "hf"
    assert run_command(convert.main, ["to-hf", "--run", str(tiny[0]), str(other), str(out)]) == 2
    assert "--run and the positional IN OUT were given" in one_error(capsys)
    assert not out.exists()


# ---------------------------------------------------------------- --help offers what is taken


def help_of(main, argv: list[str], flag: str, capsys) -> set[str]:
    """The words `flag`'s paragraph of a command's --help offers."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    paragraph = re.search(rf" {flag} [A-Z]+ (.*?)(?= --[a-z]|$)", text)[1]
    return set(re.findall(r"[a-z0-9:]+", paragraph.replace("cuda:N", "cuda:0")))


def train_takes(key: str, value: str) -> bool:
    try:
        build_config({}, [(key, value)])
    except UserError:
        return False
    return True


def sampling_takes(key: str, value: str) -> bool:
    try:
        if key == "train.dtype":
            device.pick_dtype(value, torch.device("cpu"))
        else:
            device.pick_device(value)
    except UserError as e:  # a device this machine lacks is taken, and said to be missing
        return "not available" in str(e)
    return True


COMMANDS = {  # (main, argv before --help, whether it takes a value for a key)
    "train.py": (train.main, [], train_takes),
    "generate.py study": (generate.main, ["study"], train_takes),  # it runs train.py
    "generate.py": (generate.main, [], sampling_takes),
    "generate.py extrapolate": (generate.main, ["extrapolate"], sampling_takes),
}
VALUES = {
    "--dtype": ("train.dtype", ("auto", "float32", "bfloat16", "float16")),
    "--device": ("train.device", ("auto", "cpu", "cuda", "cuda:0", "mps")),
}


@pytest.mark.parametrize("flag", VALUES)
@pytest.mark.parametrize("command", COMMANDS)
def test_help_offers_only_what_the_command_takes(command, flag, capsys):
    """train.py's --help offered float16 and cuda:N, which its config refuses."""
    main, argv, takes = COMMANDS[command]
    offered = help_of(main, argv, flag, capsys)
    key, values = VALUES[flag]
    for value in values:
        assert (value in offered) == takes(key, value), (command, flag, value)


# ---------------------------------------------------------------- a resume keeps its source

TINY_TRAIN = [
    *("--train.max_steps=2", "--checkpoint.interval=1", "--eval.interval=0"),
    *("--train.sample_tokens=0", "--train.batch_size=2", "--train.seq_len=32"),
    "--train.dtype=float32",
    "--train.compile=false",  # the default config compiles: not for two steps
]


@pytest.fixture(scope="module")
def fine_tune(tiny, tmp_path_factory) -> Path:
    """A run started from the tiny run (train.init_from), two checkpoints."""
    out = tmp_path_factory.mktemp("ft") / "ft"
    argv = [*TINY_TRAIN, f"--train.init_from={tiny[0]}", f"--data.dir={tiny[1]}"]
    assert run_command(train.main, [*argv, f"--train.out_dir={out}"]) == 0
    return out


def init_from_cases(source: Path, copy: Path) -> dict:
    """name: (this resume's train.init_from flag, whether meta.json records it, refusal)."""
    return {
        "another run": (
            [f"--train.init_from={copy}"],
            True,
            f"this resume gives train.init_from={copy}",
        ),
        "none": ([], True, "this resume gives no train.init_from"),
        "another, before meta.json recorded it": ([f"--train.init_from={copy}"], False, "gives"),
        "the same run, spelled otherwise": ([f"--train.init_from={source}/."], True, None),
    }


@pytest.mark.parametrize("case", init_from_cases(Path(), Path()))
def test_a_resume_from_another_source_is_refused(case, tiny, fine_tune, tmp_path, capsys):
    run = tmp_path / "ft"
    shutil.copytree(fine_tune, run)
    copy = tmp_path / "copy"
    shutil.copytree(tiny[0], copy)
    flags, recorded, said = init_from_cases(tiny[0], copy)[case]
    if not recorded:  # as checkpoints were saved before they recorded it: config.json says
        meta = run / "train_state" / "step_000002" / "meta.json"
        settings = json.loads(meta.read_text())
        del settings["settings"]["train.init_from"]
        meta.write_text(json.dumps(settings))
    before = hashes(run)
    argv = [*TINY_TRAIN, f"--data.dir={tiny[1]}", f"--train.out_dir={run}", "--resume", *flags]
    argv.append("--train.max_steps=3")  # a later setting wins
    if said is None:
        assert run_command(train.main, argv) == 0
        return
    assert run_command(train.main, argv) == 2
    err = one_error(capsys)
    assert f"the run was started with train.init_from={tiny[0]}" in err and said in err, err
    assert hashes(run) == before


def test_a_scratch_run_resumed_from_a_source_is_refused(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TINY_TRAIN, f"--data.dir={tiny[1]}", f"--train.out_dir={run}"]
    tiny_model = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2"]
    assert run_command(train.main, [*argv, *tiny_model, "--model.vocab_size=320"]) == 0
    again = [*argv, "--resume", f"--train.init_from={tiny[0]}", "--train.max_steps=3"]
    assert run_command(train.main, again) == 2
    assert "started with no train.init_from, this resume gives train.init_from" in one_error(capsys)


# ---------------------------------------------------------------- one size, from one place


def test_prepare_refuses_a_vocabulary_size_beside_a_tokenizer(tiny, tmp_path, capsys):
    source, out = str(tiny[1].parent / "corpus"), tmp_path / "d"
    argv = ["--source", source, "--tokenizer", str(tiny[0]), "--vocab-size", "100", "--out"]
    assert run_command(prepare.main, [*argv, str(out)]) == 2
    err = one_error(capsys)
    assert "--vocab-size 100 and --tokenizer" in err and not out.exists()


# ---------------------------------------------------------------- outputs writable before the work


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` read-only: its mode for a user, a read-only bind mount for root (who writes
    anywhere else)."""
    if os.geteuid():
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    mount = ["mount", "--bind", "-o", "ro", str(folder), str(folder)]
    done = subprocess.run(mount, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount {folder} read-only here ({done.stderr.strip()}): needs root")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def read_only_cases(tiny, fine_tune, tmp_path: Path) -> dict:
    """command: (main, argv, the existing folder it writes into)."""
    run, hf, data = tmp_path / "run", tmp_path / "hf", tmp_path / "data"
    shutil.copytree(fine_tune, run)
    hf.mkdir()
    shutil.copytree(tiny[1], data)
    resume = [*TINY_TRAIN, f"--data.dir={tiny[1]}", f"--train.init_from={tiny[0]}", "--resume"]
    resume.append("--train.max_steps=3")
    corpus = str(tiny[1].parent / "corpus")
    return {
        "train.py --resume": (train.main, [*resume, f"--train.out_dir={run}"], run),
        "convert to-hf --force": (
            convert.main,
            ["to-hf", "--run", str(tiny[0]), "--out", str(hf), "--force"],
            hf,
        ),
        "prepare --force": (
            prepare.main,
            ["--source", corpus, "--tokenizer", str(tiny[0]), "--out", str(data), "--force"],
            data,
        ),
    }


@pytest.mark.parametrize(
    "command", ["train.py --resume", "convert to-hf --force", "prepare --force"]
)
def test_a_read_only_output_folder_is_refused_before_any_work(
    command, tiny, fine_tune, tmp_path, capsys
):
    """`--resume` into a read-only run trained, then failed at the save with a traceback."""
    main, argv, folder = read_only_cases(tiny, fine_tune, tmp_path)[command]
    before = hashes(folder)
    with read_only(folder):
        assert run_command(main, argv) == 2
    err = one_error(capsys)
    assert f"cannot write {folder}" in err, err
    assert hashes(folder) == before


# ---------------------------------------------------------------- file counts bounded


@pytest.mark.parametrize("tokenizer", [False, True], ids=["trained tokenizer", "--tokenizer"])
def test_prepare_refuses_a_shard_size_that_makes_too_many_files(tiny, tmp_path, tokenizer, capsys):
    """`--shard-tokens 1` wrote 90,000 files of Shakespeare, silently."""
    corpus, out = str(tiny[1].parent / "corpus"), tmp_path / "d"
    given = ["--tokenizer", str(tiny[0])] if tokenizer else ["--vocab-size", "300"]
    argv = ["--source", corpus, *given, "--shard-tokens", "1", "--out", str(out)]
    assert run_command(prepare.main, argv) == 2
    err = one_error(capsys)
    count = int(re.search(r"would make ([\d,]+) shard files", err)[1].replace(",", ""))
    assert "--shard-tokens 1 " in err and count > 70_000 and f"at most {shards.MAX_SHARDS:,}" in err
    assert list(tmp_path.iterdir()) == []  # not the output, not its .partial folder
    least = re.search(r"give --shard-tokens (\d+) or more", err)[1]
    assert int(least) * shards.MAX_SHARDS >= count


def test_the_shard_size_suggested_is_taken_and_the_writer_holds_the_bound(
    tiny, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(shards, "MAX_SHARDS", 20)
    corpus, out = str(tiny[1].parent / "corpus"), tmp_path / "d"
    argv = ["--source", corpus, "--tokenizer", str(tiny[0]), "--out", str(out), "--shard-tokens"]
    assert run_command(prepare.main, [*argv, "1000"]) == 2
    least = re.search(r"give --shard-tokens (\d+) or more", one_error(capsys))[1]
    assert run_command(prepare.main, [*argv, least]) == 0
    for split in ("train", "val"):
        assert 0 < len(list(out.glob(f"{split}-*.bin"))) <= 20
    (tmp_path / "w").mkdir()
    writer = shards.ShardWriter(tmp_path / "w", "train", np.uint16, 4)
    ids = np.arange(200, dtype=np.uint16)
    with pytest.raises(UserError, match="--shard-tokens 4 would make 50 shard files"):
        writer.write(ids, np.array([200]), 400)
    writer.close()
    assert len(list((tmp_path / "w").glob("train-*.bin"))) <= 20


# ---------------------------------------------------------------- .gguf in any case


@pytest.mark.parametrize(
    "name, is_gguf",
    [("m.gguf", True), ("M.GGUF", True), ("m.GgUf", True), ("m.gguf.txt", False), ("m", False)],
)
def test_a_gguf_file_is_known_by_its_suffix_in_any_case(name, is_gguf, tmp_path):
    (tmp_path / name).write_bytes(b"GGUF")
    assert is_gguf_file(tmp_path / name) == is_gguf
    (tmp_path / "folder.gguf").mkdir()
    assert not is_gguf_file(tmp_path / "folder.gguf")


def test_an_upper_case_gguf_samples_as_it_converts(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    upper = tmp_path / "TINY.GGUF"
    shutil.copyfile(tiny_gguf, upper)
    argv = ["from-gguf", "--gguf", str(upper), "--out", str(tmp_path / "r")]
    assert run_command(convert.main, argv) == 0
    sample = ["--run", str(upper), "--prompt", "a", "--max-new-tokens", "2", "--dtype", "float32"]
    assert run_command(generate.main, sample) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- messages in our words


def library_cases(tiny, tiny_gguf, tmp_path: Path) -> dict:
    """case: (main, argv, what the one line must say): inputs that once reached a library's
    message, naming no file, key or flag."""
    import gguf

    bad_types = {"tokenizer.ggml.token_type": ([1] * 319 + [99], gguf.GGUFValueType.ARRAY, 4)}
    types_gguf = edited_gguf(tiny_gguf, tmp_path / "types.gguf", bad_types)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[train]\nsample_prompt = 'caf\xe9'\n")
    seed = tmp_path / "seed.toml"
    seed.write_text("[train]\nseed = 4294967296\n")
    run = tmp_path / "run"
    shutil.copytree(tiny[0], run)
    (run / "config.json").write_bytes(b"\xff{}")
    sample = ["--prompt", "a", "--max-new-tokens", "2"]
    return {
        "GGUF token type 99, sampled": (
            generate.main,
            ["--run", str(types_gguf), *sample],
            f"{types_gguf}: metadata tokenizer.ggml.token_type item 319 is 99",
        ),
        "GGUF token type 99, converted": (
            convert.main,
            ["from-gguf", "--gguf", str(types_gguf), "--out", str(tmp_path / "r")],
            "tokenizer.ggml.token_type item 319 is 99, not a token type",
        ),
        "a config file not UTF-8": (
            train.main,
            ["--config", str(latin1)],
            f"{latin1} is not UTF-8 text (byte 28)",
        ),
        "a run's config.json not UTF-8": (
            generate.main,
            ["--run", str(run), *sample],
            f"{run}/config.json is corrupt: not UTF-8 (byte 0)",
        ),
        "train.seed 2^32 in a config file": (
            train.main,
            ["--config", str(seed)],
            "config key train.seed must be below 4,294,967,296 (torch keeps a seed's low 32 bits), "
            "not 4294967296",
        ),
        "--train.seed 2^32": (
            train.main,
            ["--train.seed=4294967296"],
            "--train.seed must be below 4,294,967,296",
        ),
    }


CASES = [
    "GGUF token type 99, sampled",
    "GGUF token type 99, converted",
    "a config file not UTF-8",
    "a run's config.json not UTF-8",
    "train.seed 2^32 in a config file",
    "--train.seed 2^32",
]


@pytest.mark.parametrize("case", CASES)
def test_a_librarys_message_becomes_ours(case, tiny, tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    main, argv, said = library_cases(tiny, tiny_gguf, tmp_path)[case]
    assert run_command(main, argv) == 2
    assert said in one_error(capsys)


# ---------------------------------------------------------------- sizes in units that show them


@pytest.mark.parametrize(
    "count, said",
    [
        (0, "0 bytes"),
        (1, "1 byte"),
        (999, "999 bytes"),
        (1000, "1 KB"),
        (3_100, "3.1 KB"),
        (1_234_567, "1.23 MB"),
        (52_000_000_000, "52 GB"),
        (3 * 10**15, "3 PB"),
    ],
)
def test_a_size_is_said_in_the_unit_that_shows_it(count, said):
    assert outputs.byte_size(count) == said


@pytest.mark.parametrize("command", ["prepare", "convert to-hf"])
def test_a_full_disk_names_the_path_and_sizes_that_show(
    command, tiny, tmp_path, monkeypatch, capsys
):
    """A full disk read "need about 0.00 GB and 0.00 GB are free"."""
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0)
    )
    out = tmp_path / "out"
    argv = {
        "prepare": (
            prepare.main,
            ["--source", str(tiny[1].parent / "corpus"), "--vocab-size", "300"],
        ),
        "convert to-hf": (convert.main, ["to-hf", "--run", str(tiny[0])]),
    }[command]
    assert run_command(argv[0], [*argv[1], "--out", str(out)]) == 2
    err = one_error(capsys)
    assert str(tmp_path) in err and "not enough disk space (0 bytes free, about " in err, err
    needed = re.search(r"about ([\d.]+) (bytes|KB|MB) needed", err)
    assert needed and float(needed[1]) > 0, err
    assert list(tmp_path.iterdir()) == []
