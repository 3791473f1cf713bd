"""Issue 47's rules on the import cache (a failed import never kept, stale ones evicted, its size
said, killed writers' temporaries removed), on paths a file names (kept in its folder), on sampling
with attention sinks (memory bounded by the window) and on refusals naming the flag that caused
them, each walked over the commands it covers."""

import json
import os
import shutil
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import torch
from test_reliability_rules import edited_gguf

import generate
from data import loader
from data.shards import docs_name, mask_name
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.convert import cache as import_cache
from picollama.convert import main as convert
from picollama.kernels.caches import Sinks
from picollama.run_files import load_run
from picollama.sampling import memory as memory_budget
from picollama.sampling.decode import DecodeOptions, TokenRing
from picollama.sampling.decode import generate as sample_rows
from picollama.sampling.prompts import TextStream
from picollama.sampling.sampler import Sampling


@pytest.fixture(scope="module")
def tiny(make_tiny_run, one_thread) -> tuple[Path, Path]:
    return make_tiny_run(steps=1)


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory) -> dict:
    """The tiny run as a GGUF file and as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("sources")
    run = str(tiny[0])
    for command, out in (("to-gguf", "tiny.gguf"), ("to-hf", "hf")):
        assert convert.main([command, "--run", run, "--out", str(folder / out)]) == 0
    return {"gguf": folder / "tiny.gguf", "hf": folder / "hf"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "imported"


def ended_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def copied(source: Path, folder: Path) -> Path:
    """A copy of a source (file or folder) in `folder`, so that a test may change it."""
    folder.mkdir(exist_ok=True)
    target = folder / source.name
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    return target


# ---------------------------------------------------------------- rule 6: the cache is a cache


# metadata that lies: {case: (its key, its value, what the refusal names beside the file)}
LYING = {
    "no heads": ("llama.attention.head_count", 0, "llama.attention.head_count"),
    "a width its tensors lack": ("llama.feed_forward_length", 999, "do not match its metadata"),
    "fewer layers than its tensors": ("llama.block_count", 1, "blk.1"),
}


@pytest.mark.parametrize("case", LYING)
def test_a_failed_import_is_never_cached(case, sources, cache, tmp_path, capsys):
    import gguf

    key, value, named = LYING[case]
    bad = edited_gguf(
        sources["gguf"], tmp_path / "lies.gguf", {key: (value, gguf.GGUFValueType.UINT32)}
    )
    commands = {  # --run imports into the cache; from-gguf writes a run
        generate.main: ["--run", str(bad), "--prompt", "a"],
        convert.main: ["from-gguf", "--gguf", str(bad), "--out", str(tmp_path / "r")],
    }
    for command, argv in commands.items():
        assert run_command(command, argv) == 2
        err = one_error(capsys)
        assert str(bad) in err and named in err, err
        assert not (tmp_path / "r").exists()
        assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())


@pytest.mark.parametrize("change", ["changed", "gone"])
@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_a_stale_import_is_listed_then_evicted_and_the_cache_cleared(
    kind, change, sources, cache, tmp_path, capsys
):
    source = copied(sources[kind], tmp_path / "src")
    first = import_cache.imported_run(source)
    said = capsys.readouterr().err
    assert f"imported {source}" in said and "the cache holds 1 import, 0." in said, said
    assert import_cache.imported_run(source) == first and not capsys.readouterr().err  # once
    touched = source / "config.json" if kind == "hf" else source
    if change == "changed":
        os.utime(touched, ns=(1, 1))
    else:
        (shutil.rmtree if kind == "hf" else Path.unlink)(source)
    assert convert.main(["cache"]) == 0
    listed = capsys.readouterr().out
    assert f"{first.name}  from {source.resolve()} (its source {change}" in listed.replace(
        "is gone", "gone"
    ), listed
    if change == "changed":  # seen again: imported anew, the stale one evicted, said
        second = import_cache.imported_run(source)
        said = capsys.readouterr().err
        assert second != first and "stale imports were removed" in said, said
        assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [second.name]
    else:
        assert import_cache.imported_run(tmp_path / "other") == tmp_path / "other"  # a run dir
    assert convert.main(["cache", "--clear"]) == 0
    assert "removed" in capsys.readouterr().out and list(cache.iterdir()) == []


def test_a_killed_writers_temporary_is_removed_by_the_next_run(sources, tiny, cache, tmp_path):
    """A SIGKILL during `convert to-gguf` left a hidden 281 MB file, and during a `--run x.gguf`
    import a 417 MB folder: the next run of either removes it (its pid is gone)."""
    dead = ended_pid()
    out = tmp_path / "out.gguf"
    left_file = tmp_path / f".out.gguf.tmp-{dead}"
    left_file.write_bytes(b"GGUF half")
    assert convert.main(["to-gguf", "--run", str(tiny[0]), "--out", str(out)]) == 0
    cache.mkdir(parents=True)
    key = import_cache.stamp([sources["gguf"]])
    left_folder = cache / f".tiny.gguf-{key}.tmp-{dead}"
    (left_folder / "sub").mkdir(parents=True)
    (cache / f".tiny.gguf-0123456789ab.tmp-{dead}").mkdir()  # an older source's
    import_cache.imported_run(sources["gguf"])
    assert not left_file.exists() and out.is_file()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------- rule 3: paths stay inside


# what each reader of a name opens: the file a name gives, or a file beside it
OPENED = {
    "tokens": (loader.open_tokens, str),
    "documents": (loader.doc_offsets, docs_name),
    "loss mask": (loader.open_mask, mask_name),
}
OUT_CASES = ("../x", "absolute", "a link out")


def names_out(folder: Path, opened, real: Path) -> dict:
    """{case: a name leading out of `folder`}: climbing out, absolute, and a link inside leading
    out; each reaching a copy of `real` (what the reader opens, named opened(name))."""
    outside = folder.parent / "outside"
    outside.mkdir()
    shutil.copyfile(real, outside / opened("x.bin"))
    (folder / opened("link.bin")).symlink_to(outside / opened("x.bin"))
    return {
        "../x": "../outside/x.bin",
        "absolute": str(outside / "x.bin"),
        "a link out": "link.bin",
    }


@pytest.mark.parametrize("case", OUT_CASES)
@pytest.mark.parametrize("reader", [*OPENED, "HF index"])
def test_a_path_a_file_names_stays_in_its_folder(reader, case, tiny, sources, tmp_path, capsys):
    if reader == "HF index":
        folder = copied(sources["hf"], tmp_path / "src")
        name = names_out(folder, str, folder / "model.safetensors")[case]
        index = {"weight_map": {"model.norm.weight": name}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "model.safetensors").unlink()
        argv = ["from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "r")]
        assert run_command(convert.main, argv) == 2
        err = one_error(capsys)
        source, key = folder / "model.safetensors.index.json", "weight_map"
    else:
        read, opened = OPENED[reader]
        folder = copied(tiny[1], tmp_path / "src")
        real = folder / opened("val-00000.bin")
        if not real.exists():  # a text dataset has no loss mask: one byte a token
            real.write_bytes(b"\1" * len(loader.open_tokens(folder, "val")))
        name = names_out(folder, opened, real)[case]
        meta = json.loads((folder / "meta.json").read_text())
        meta["splits"]["val"]["shards"][0]["file"] = name
        if reader == "loss mask":  # only a conversations dataset is read for its masks
            meta["kind"] = "conversations"
        (folder / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(UserError) as refused:
            read(folder, "val")
        err, source, key = str(refused.value), folder / "meta.json", "splits.val.shards"
    assert f"{source}: {key} names {opened(name) if reader != 'HF index' else name!r}" in err, err
    assert f"must lie in {folder}" in err, err


def test_a_name_inside_its_folder_still_reads(tiny, tmp_path):
    """The rule's control: a shard named through a folder inside the dataset is read."""
    folder = copied(tiny[1], tmp_path / "src")
    (folder / "sub").mkdir()
    for name in ("val-00000.bin", "val-00000.docs.npy"):
        (folder / name).rename(folder / "sub" / name)
    meta = json.loads((folder / "meta.json").read_text())
    meta["splits"]["val"]["shards"][0]["file"] = "sub/./val-00000.bin"
    (folder / "meta.json").write_text(json.dumps(meta))
    assert len(loader.open_tokens(folder, "val")) == len(loader.open_tokens(tiny[1], "val"))
    assert loader.doc_offsets(folder, "val")[0] == 0


# ---------------------------------------------------------------- rule 4: sinks bounded by --window


def test_sinks_pass_the_memory_check_for_any_length_and_allocate_little(tiny, monkeypatch):
    """64 samples × 2·10⁷ tokens allocated 20 GB whatever --window said: with sinks the token ids
    are the prompts and TokenRing's two, and one streamed row keeps nothing, so any length passes
    a check of a few MiB; the samples kept for several rows, or no window, are refused."""
    model, _, _ = load_run(tiny[0], "cpu", torch.float32)
    check = memory_budget.check_memory
    free = 4 * 2**20
    check(model, 1, (2, 2 + 10**12), True, free, window=16, longest=2, kept=False)
    for window, rows, kept in ((None, 1, False), (16, 2, True), (16, 1, True)):
        with pytest.raises(UserError, match="lower --num-samples or --max-new-tokens"):
            check(model, rows, (2, 2 + 2 * 10**7), True, free, window, longest=2, kept=kept)
    made = []
    monkeypatch.setattr(TokenRing, "slot", record_ring(made, TokenRing.slot))
    peaks = {}
    for new in (100, 1000):
        streamed = []
        tracemalloc.start()
        rows = sample_rows(
            model,
            [[1, 5, 7]],
            Sampling(new, temperature=1.0, seed=0),
            on_token=appender(streamed),
            options=DecodeOptions(sinks=Sinks(4, 16), keep=False),
        )
        peaks[new] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert rows == [[]] and len(streamed) == new
    assert {ring.ids.shape for ring in made} == {(1, 3 + TokenRing.RING)}
    assert peaks[1000] < 2 * peaks[100] + 65536, peaks  # the sample streamed out, not kept
    kept = sample_rows(
        model,
        [[1, 5, 7]],
        Sampling(1000, temperature=1.0, seed=0),
        options=DecodeOptions(sinks=Sinks(4, 16)),
    )
    assert kept == [streamed]  # the same tokens, kept where asked


def appender(tokens: list):
    """An on_token appending each token to `tokens`."""

    def on_token(row: int, token: int):
        tokens.append(token)

    return on_token


def record_ring(made: list, slot):
    """TokenRing.slot recording each ring it is called on (the buffers generate made)."""

    def recorded(ring, pos):
        if not made or made[-1] is not ring:
            made.append(ring)
        return slot(ring, pos)

    return recorded


def test_a_long_stream_keeps_few_ids_and_prints_the_whole_text(tiny):
    """TextStream decoded the whole sequence at each token (memory and time growing with it); it
    now keeps the last ids only, and prints exactly what decoding every id at once gives."""
    import io

    _, _, tokenizer = load_run(tiny[0], "cpu", torch.float32)
    ids = torch.randint(
        3, tokenizer.get_piece_size(), (3000,), generator=torch.Generator().manual_seed(0)
    )
    out = io.StringIO()
    stream = TextStream(tokenizer, [1], out)
    longest = 0
    for token in ids.tolist():
        stream.add(token)
        longest = max(longest, len(stream.ids))
    stream.flush_new()
    assert out.getvalue() == tokenizer.decode([1, *ids.tolist()])
    assert longest <= 5 * TextStream.KEPT and stream.added == 3000


# ---------------------------------------------------------------- one message: the flag to lower


@pytest.mark.parametrize("flag", ["--num-windows", "--probes", "--passkeys"])
def test_a_refusal_names_the_flag_that_caused_it(flag, tiny, tmp_path, capsys):
    """`extrapolate --passkeys 1e9` said "use fewer --num-windows or --probes"."""
    argv = ["extrapolate", "--run", str(tiny[0]), "--out", str(tmp_path / "x"), flag, str(10**9)]
    assert run_command(generate.main, argv) == 2
    err = one_error(capsys)
    assert err.rstrip().endswith(f"use fewer {flag}"), err
    assert not (tmp_path / "x").exists()
