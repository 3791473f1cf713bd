"""Refusals of broken runs, GGUFs, Hugging Face folders and a full disk name the file, key or value
that is wrong, in our words (the misleading lines of issue 47's sweep)."""

import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_reliability_rules import edited_gguf

import generate
from picollama.cli.command import run_command
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.run_files import load_run

U32 = 4  # gguf.GGUFValueType.UINT32


@pytest.fixture(scope="module")
def run_dir(make_tiny_run, one_thread) -> Path:
    return make_tiny_run(steps=1)[0]


@pytest.fixture(scope="module")
def tiny_gguf(run_dir, tmp_path_factory) -> Path:
    """The tiny run (dim 32, 4 heads of 8) as a GGUF file."""
    from picollama.convert.to_gguf import write_gguf

    model, _, tokenizer = load_run(run_dir, "cpu", torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, tokenizer, path, "f32", "tiny")
    return path


def gguf_without(source: Path, out: Path, prefix: str) -> Path:
    """A copy of GGUF `source` without the metadata keys that start with `prefix`."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture", prefix)):
            item = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=item)
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        writer.add_tensor(tensor.name, tensor.data.copy(), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def with_config(folder: Path, config: bytes) -> Path:
    """`folder` with config.json holding `config`."""
    (folder / "config.json").write_bytes(config)
    return folder


def run_copy(run_dir: Path, copy: Path, config: bytes) -> Path:
    """A copy of the run at `copy` whose config.json holds `config`."""
    return with_config(shutil.copytree(run_dir, copy), config)


def hf_copy(run_dir: Path, hf: Path, config: bytes) -> Path:
    """The run exported as a Hugging Face folder `hf` whose config.json holds `config`."""
    hf_format.export_hf(run_dir, hf)
    return with_config(hf, config)


@pytest.fixture(scope="module")
def broken(run_dir, tiny_gguf, tmp_path_factory) -> dict:
    """{case: (main, argv with OUT for the output, the words the error line holds)}, the broken
    inputs made once."""
    tmp = tmp_path_factory.mktemp("broken")
    sample = ["--prompt", "a", "--max-new-tokens", "2"]
    latin = hf_copy(run_dir, tmp / "latin", b'{"x": "\xff"}')
    hf_json = hf_copy(run_dir, tmp / "hf_json", b"{")
    notok = gguf_without(tiny_gguf, tmp / "notok.gguf", "tokenizer.")
    lie = edited_gguf(tiny_gguf, tmp / "lie.gguf", {"llama.embedding_length": (64, U32)})
    heads = edited_gguf(tiny_gguf, tmp / "heads.gguf", {"llama.attention.head_count": (2, U32)})
    text = tmp / "notes.txt"
    text.write_text("notes")
    run_json = run_copy(run_dir, tmp / "run_json", b"{")
    no_model = run_copy(run_dir, tmp / "no_model", b'{"train": {}}')
    return {
        "HF config.json not UTF-8": (
            convert.main,
            ["from-hf", "--hf-dir", str(latin), "--out", "OUT"],
            f"{latin}/config.json is not UTF-8 text (byte 7)",
        ),
        "HF config.json not JSON": (
            convert.main,
            ["from-hf", "--hf-dir", str(hf_json), "--out", "OUT"],
            f"{hf_json}/config.json is not valid JSON (line 1, column 2)",
        ),
        "GGUF without a tokenizer": (
            convert.main,
            ["from-gguf", "--gguf", str(notok), "--out", "OUT"],
            f"{notok}: metadata tokenizer.ggml.model is missing",
        ),
        "GGUF embedding_length lies": (
            convert.main,
            ["from-gguf", "--gguf", str(lie), "--out", "OUT"],
            f"{lie}: metadata llama.embedding_length 64 is not the width of tensor "
            "token_embd.weight, 32",
        ),
        "GGUF head_count lies": (
            convert.main,
            ["from-gguf", "--gguf", str(heads), "--out", "OUT"],
            f"{heads}: llama.rope.dimension_count 8 is not the head size 16 "
            "(llama.embedding_length 32 / llama.attention.head_count 2)",
        ),
        "--run a file in no run": (
            generate.main,
            ["--run", str(text), *sample],
            f"{text} is a file, neither a run directory nor a .gguf file",
        ),
        "--run a file in a run": (
            generate.main,
            ["--run", str(run_dir / "config.json"), *sample],
            f"pass the run directory that holds it, {run_dir}",
        ),
        "to-hf --run a GGUF": (
            convert.main,
            ["to-hf", "--run", str(tiny_gguf), "--out", "OUT"],
            f"{tiny_gguf} is a GGUF file, not a run directory; import it first",
        ),
        "a run's config.json not JSON": (
            generate.main,
            ["--run", str(run_json), *sample],
            f"{run_json}/config.json is corrupt: not valid JSON (line 1, column 2)",
        ),
        "a run's config.json without model": (
            generate.main,
            ["extrapolate", "--run", str(no_model), "--out", "OUT"],
            f'{no_model}/config.json is corrupt: it has no "model" key',
        ),
    }


CASES = [
    "HF config.json not UTF-8",
    "HF config.json not JSON",
    "GGUF without a tokenizer",
    "GGUF embedding_length lies",
    "GGUF head_count lies",
    "--run a file in no run",
    "--run a file in a run",
    "to-hf --run a GGUF",
    "a run's config.json not JSON",
    "a run's config.json without model",
]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_input_is_named_in_one_line(case, broken, tmp_path, capsys):
    main, argv, said = broken[case]
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_command(main, [str(out) if a == "OUT" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert not out.exists()


def test_a_gguf_past_a_full_disk_says_so_naming_the_output(run_dir, tmp_path, monkeypatch, capsys):
    """A write past the file-size limit stops short as on a full disk (numpy reports only "N
    requested and M written"); with the disk's free space below the write, to-gguf says the disk is
    full and names --out, leaving nothing there."""
    whole = tmp_path / "whole.gguf"
    assert run_command(convert.main, ["to-gguf", "--run", str(run_dir), "--out", str(whole)]) == 0
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0)
    )
    out = tmp_path / "out.gguf"
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a short write, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (whole.stat().st_size // 2, limits[1]))
    try:
        status = run_command(convert.main, ["to-gguf", "--run", str(run_dir), "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot write {out}: No space left on device"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["whole.gguf"]
