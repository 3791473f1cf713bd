"""The rules of docs/guarantees.md, each enforced in one place, walked over the commands it covers:
ownership of outputs, one writer, locks of killed processes, one gate for GGUF metadata, bounded
resources, signals inside long forwards."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import generate
from picollama import REPO_ROOT
from picollama.cli import UserError, outputs
from picollama.cli.command import run_command
from picollama.config.training import build_config
from picollama.config.values import PATH_KEYS
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.kernels import decode_ops
from picollama.lab import cost, extrapolate
from picollama.lab.bench.common import module_of
from picollama.lab.measure import data as bench_data
from picollama.lab.measure import switches
from picollama.run_files import load_run
from picollama.sampling import memory as memory_budget

BENCH = ("data", "decode", "heldout", "memory", "perplexity", "quantize", "switches", "train")


@pytest.fixture(scope="module")
def run_dir(make_tiny_run, one_thread) -> Path:
    return make_tiny_run(steps=1)[0]


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def ended_pid() -> int:
    """The id of a process that has ended (as a SIGKILL-ed lock holder's)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


# ---------------------------------------------------------------- ownership: one rule, every --out

RESULT = {"machine": {}, "runs": []}
OUT_CASES = {  # name: (the file there, whether --out may replace it, with --force)
    "absent": (None, True, True),
    "empty": ("", True, True),
    "its own result": ("SELF", True, True),
    "another benchmark's": ("OTHER", False, True),
    "a README": ("# my project\n\nyears of notes\n", False, False),
    "a JSON of the user's": ('{"benchmark": "mine"}\n', False, False),
}


@pytest.mark.parametrize("case", OUT_CASES)
@pytest.mark.parametrize("bench", BENCH)
def test_every_benchmark_writes_only_its_own_out(bench, case, tmp_path):
    held, allowed, forced = OUT_CASES[case]
    other = "train" if bench != "train" else "data"
    if held in ("SELF", "OTHER"):
        name = bench if held == "SELF" else other
        held = json.dumps(RESULT | {"benchmark": name})
    out = tmp_path / "out.json"
    if held is not None:
        out.write_text(held)
    parse_args = importlib.import_module(module_of(bench)).parse_args
    for force, ok in (([], allowed), (["--force"], forced)):
        if ok:
            assert parse_args(["--smoke", "--out", str(out), *force]).out == out
            continue
        with pytest.raises(UserError, match=f"not replacing {out}: it") as refused:
            parse_args(["--smoke", "--out", str(out), *force])
        assert ("pass --force" in str(refused.value)) == (held.startswith('{"machine"'))
        assert out.read_text() == held


def test_the_readme_is_never_a_benchmarks_output(tmp_path, bench_main, capsys):
    readme = tmp_path / "README.md"
    readme.write_bytes((REPO_ROOT / "README.md").read_bytes())
    for flags in ([], ["--force"]):
        assert run_command(bench_main("data"), ["--smoke", "--out", str(readme), *flags]) == 2
        assert "is not a result of picollama.lab.measure.data" in one_error(capsys)
    assert readme.read_bytes() == (REPO_ROOT / "README.md").read_bytes()


def extrapolate_report(run_dir: Path, out: Path) -> dict:
    """What an evaluation's extrapolation.json records of its command line."""
    command = ["python", "generate.py", "extrapolate", "--run", str(run_dir)]
    return {"command": [*command, "--out", str(out)]}


@pytest.mark.parametrize(
    "files, message",
    [
        ({"notes.txt": "mine\n"}, "it holds notes.txt, so picollama did not write it all"),
        ({"extrapolation.json": '{"runs": []}\n'}, "it is not a result of generate.py extrapolate"),
        ({"extrapolation.md": "# before\n", "extrapolation.json": "OWN"}, None),
    ],
    ids=["a user's file", "a JSON of the user's", "its own report"],
)
def test_extrapolate_and_study_write_only_into_a_folder_of_their_own(
    run_dir, tmp_path, files, message, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        own = json.dumps(extrapolate_report(run_dir, out))
        (out / name).write_text(own if text == "OWN" else text)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    if message is None:
        extrapolate.check_own_folder(out)
        return
    for argv in (  # the evaluation, and the study (whose folder must be new or empty)
        ["extrapolate", "--run", str(run_dir), "--num-windows", "1", "--out", str(out)],
        ["study", "--quick", "--out", str(out)],
    ):
        assert run_command(generate.main, argv) == 2
        assert f"{out}" in one_error(capsys)
    with pytest.raises(UserError, match=message):
        extrapolate.check_own_folder(out)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_a_second_writer_of_one_output_is_refused_everywhere(run_dir, tmp_path, bench_main, capsys):
    commands = {f"bench.{b}": (bench_main(b), ["--smoke", "--out"]) for b in BENCH}
    evaluation = ["extrapolate", "--run", str(run_dir), "--num-windows", "1", "--out"]
    commands["extrapolate"] = (generate.main, evaluation)
    commands["study"] = (generate.main, ["study", "--quick", "--out"])
    for name, (main, argv) in commands.items():
        out = tmp_path / name
        with outputs.exclusive(out):  # as another process would: flock is per open file
            assert run_command(main, [*argv, str(out)]) == 2, name
        err = one_error(capsys)
        assert f"{out} is in use by another process (pid {os.getpid()}" in err, (name, err)
        assert not out.exists()


# ---------------------------------------------------------------- locks and leftovers of the killed


def test_a_lock_whose_holder_is_gone_is_taken_over_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    dead = ended_pid()
    (tmp_path / ".run.lock").write_text(f"{dead}\n")  # what a SIGKILL leaves
    with outputs.exclusive(out) as gone:
        assert gone == dead
        assert (tmp_path / ".run.lock").read_text() == f"{os.getpid()}\n"
    err = capsys.readouterr().err
    assert (
        err == f"note: took over the lock of {out} left by pid {dead}, which ended without "
        "releasing it (killed?)\n"
    )
    assert not (tmp_path / ".run.lock").exists()
    with outputs.exclusive(out) as gone:  # released cleanly: nothing to say
        assert gone is None
    assert capsys.readouterr().err == ""


def test_a_build_killed_in_compile_leaves_no_lock_for_ever(tmp_path, capsys):
    folder = tmp_path / "key"
    folder.mkdir()
    dead = ended_pid()
    (folder / "lock").write_text("")  # torch's FileBaton: every later build waited for it
    (tmp_path / ".key.lock").write_text(f"{dead}\n")
    started = time.perf_counter()
    with decode_ops.build_lock(folder):
        assert not (folder / "lock").exists()
    assert time.perf_counter() - started < 1
    assert capsys.readouterr().err.count("\n") == 1  # exclusive's line names the pid
    (folder / "lock").write_text("")  # left by a build that held no lock of ours (an old one)
    with decode_ops.build_lock(folder):
        assert not (folder / "lock").exists()
    assert (
        capsys.readouterr().err
        == f"note: removed {folder / 'lock'}, left by a build that was killed\n"
    )


def test_a_killed_writers_temporaries_are_removed_by_the_next(tmp_path):
    dead, alive = ended_pid(), os.getppid()
    for pid in (dead, alive):
        (tmp_path / f".out.json.tmp-{pid}").write_text("half")
    (tmp_path / f".out.json.old-{dead}").mkdir()
    with outputs.atomic_output(tmp_path / "out.json") as tmp:
        tmp.write_text("{}\n")
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == [f".out.json.tmp-{alive}", "out.json"]  # a running writer's is its own


# ---------------------------------------------------------------- one gate for values that come in


def edited_gguf(source: Path, out: Path, changes: dict) -> Path:
    """A copy of GGUF `source` with metadata changed: {key: (value, GGUFValueType[, item type])}."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changes:
            continue
        item = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=item)
    for name, (value, *kinds) in changes.items():
        writer.add_key_value(name, value, *kinds)
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def sources(run_dir, tmp_path_factory) -> tuple[Path, dict]:
    """(a GGUF file of the tiny run, the Hugging Face config.json of its model)."""
    from picollama.convert.to_gguf import write_gguf

    model, _, tokenizer = load_run(run_dir, "cpu", torch.float32)
    gguf_file = tmp_path_factory.mktemp("gate") / "tiny.gguf"
    write_gguf(model, tokenizer, gguf_file, "f32", "tiny")
    return gguf_file, hf_format.hf_config(model.args)


def gate_cases():
    """(GGUF changes, config.json changes, what the refusal says): what from-hf refuses."""
    import gguf

    kind = gguf.GGUFValueType
    linear = {"rope_type": "linear", "factor": 0.5, "rope_theta": 10000.0}
    return {
        "context 0": (
            {"llama.context_length": (0, kind.UINT32)},
            {"max_position_embeddings": 0},
            "context_length must be positive, not 0",
        ),
        "context 2^31": (
            {"llama.context_length": (2**31, kind.UINT32)},
            {"max_position_embeddings": 2**31},
            "must be at most 16,777,216, not 2147483648",
        ),
        "epsilon 0": (
            {"llama.attention.layer_norm_rms_epsilon": (0.0, kind.FLOAT32)},
            {"rms_norm_eps": 0.0},
            "must be positive, not 0.0",
        ),
        "epsilon NaN": (
            {"llama.attention.layer_norm_rms_epsilon": (float("nan"), kind.FLOAT32)},
            {"rms_norm_eps": float("nan")},
            "must be finite, not nan",
        ),
        "negative theta": (
            {"llama.rope.freq_base": (-10000.0, kind.FLOAT32)},
            {"rope_theta": -10000.0, "rope_parameters": None},
            "must be positive, not -10000.0",
        ),
        "RoPE factor below 1": (
            {
                "llama.rope.scaling.type": ("linear", kind.STRING),
                "llama.rope.scaling.factor": (0.5, kind.FLOAT32),
            },
            {"rope_parameters": linear, "rope_scaling": linear},
            "must be >= 1, not 0.5",
        ),
        "no heads": (
            {"llama.attention.head_count": (0, kind.UINT32)},
            {"num_attention_heads": 0},
            "head_count must be positive, not 0",
        ),
        "integer tokens": (
            {"tokenizer.ggml.tokens": (list(range(320)), kind.ARRAY, kind.INT32)},
            None,
            "tokenizer.ggml.tokens must be a list of strings, but item 0 is 0",
        ),
    }


GGUF_KEYS = {  # the key each refusal names, as the file spells it
    "context 0": "llama.context_length",
    "context 2^31": "llama.context_length",
    "epsilon 0": "llama.attention.layer_norm_rms_epsilon",
    "epsilon NaN": "llama.attention.layer_norm_rms_epsilon",
    "negative theta": "llama.rope.freq_base",
    "RoPE factor below 1": "llama.rope.scaling.factor",
    "no heads": "llama.attention.head_count",
    "integer tokens": "tokenizer.ggml.tokens",
}


@pytest.mark.parametrize("case", GGUF_KEYS)
def test_from_gguf_refuses_what_from_hf_refuses(case, sources, tmp_path, monkeypatch, capsys):
    gguf_file, hf_config = sources
    changes, hf_changes, said = gate_cases()[case]
    bad = edited_gguf(gguf_file, tmp_path / "bad.gguf", changes)
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    commands = {
        "from-gguf": (
            convert.main,
            ["from-gguf", "--gguf", str(bad), "--out", str(tmp_path / "r")],
        ),
        "generate.py --run": (generate.main, ["--run", str(bad), "--prompt", "a"]),
    }
    for name, (main, argv) in commands.items():
        assert run_command(main, argv) == 2, name
        err = one_error(capsys)
        assert f"{bad}: metadata {GGUF_KEYS[case]}" in err and said.split(", not")[-1] in err, err
        assert not (tmp_path / "r").exists() and not list((tmp_path / "cache").rglob("*.json"))
    if hf_changes is not None:  # the same values from a Hugging Face config.json: the same gate
        hf_dir = tmp_path / "hf"
        hf_dir.mkdir()
        config = {k: v for k, v in (hf_config | hf_changes).items() if v is not None}
        (hf_dir / "config.json").write_text(json.dumps(config))
        argv = ["from-hf", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "r")]
        assert run_command(convert.main, argv) == 2
        assert said.split(", not")[-1] in one_error(capsys)


def test_an_unchanged_copy_imports(sources, tmp_path):
    """The gate's control: edited_gguf with no change gives a GGUF that imports."""
    copy = edited_gguf(sources[0], tmp_path / "copy.gguf", {})
    argv = ["from-gguf", "--gguf", str(copy), "--out", str(tmp_path / "r")]
    assert run_command(convert.main, argv) == 0 and (tmp_path / "r" / "config.json").is_file()


@pytest.mark.parametrize("key", sorted(PATH_KEYS))
def test_an_empty_path_is_refused_from_a_flag_and_a_file(key):
    section, name = key.split(".")
    for raw, overrides, named in (
        ({}, [(key, "")], f"--{key}"),
        ({section: {name: " "}}, [], f"config key {key}"),
    ):
        with pytest.raises(UserError, match=f"{named} must be a path"):
            build_config(raw, overrides)


# ---------------------------------------------------------------- resources bounded before the work


def test_the_memory_check_counts_what_grows_with_the_flags(run_dir, monkeypatch, capsys):
    """With attention sinks the window bounds the KV cache, not the token ids and samples kept for
    every new token: 64 rows of 2·10⁷ tokens once passed a check that counted the window only."""
    model, _, _ = load_run(run_dir, "cpu", torch.float32)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(generate, "memory_bytes", lambda device: weights + 64 * 2**20)
    base = ["--run", str(run_dir), "--prompt", "a", "--dtype", "float32", "--temperature", "0"]
    sinks = ["--sink-tokens", "4", "--window", "16"]
    for flags, new, said in (
        (sinks, 20_000_000, "64 rows of up to 20,000,00"),  # 64 MiB: far too little
        ([], 16, None),  # what fits still runs
    ):
        argv = [*base, *flags, "--num-samples", "64", "--max-new-tokens", str(new)]
        assert run_command(generate.main, argv) == (0 if said is None else 2)
        if said is not None:
            err = one_error(capsys)
            assert said in err and "KV cache (16 tokens: --window)" in err, err
    ids_and_samples = 64 * 20_000_000 * (8 + memory_budget.SAMPLE_BYTES)
    with pytest.raises(UserError, match="--window"):  # the window's KV cache comes on top
        memory_budget.check_memory(model, 64, (2, 20_000_002), False, ids_and_samples, window=16)


def test_a_corpus_past_the_disk_is_refused_before_anything_is_written(tmp_path, bench_main, capsys):
    argv = ["--corpus-gb", "1e9", "--corpus-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")]
    assert run_command(bench_main("data"), argv) == 2
    err = one_error(capsys)
    assert "shakespeare-shuffled-1e+09gb" in err and "not enough disk space" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_interrupted_corpus_leaves_nothing_and_a_killed_ones_is_removed(tmp_path, monkeypatch):
    dead = ended_pid()
    leftover = tmp_path / f".shakespeare-shuffled-0.001gb.tmp-{dead}"  # a SIGKILL's
    (leftover / "000").mkdir(parents=True)

    class Interrupting(bench_data.tqdm):
        def update(self, n=1):
            raise KeyboardInterrupt

    monkeypatch.setattr(bench_data, "tqdm", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        bench_data.build_corpus(tmp_path, 0.001)
    assert list(tmp_path.iterdir()) == []


def test_switches_smoke_trains_two_tiny_runs_without_a_probe(tmp_path, monkeypatch, capsys):
    trained = []

    def train(config, overrides, out_dir):
        trained.append(overrides)
        return [{"tokens_per_s": 1.0, "loss": 5.0}, {"val_bpb": 4.0, "loss": 5.0}]

    monkeypatch.setattr(switches, "train", train)
    assert run_command(switches.main, ["--smoke", "--out", str(tmp_path / "s.json")]) == 0
    assert len(trained) == len(switches.SMOKE_SWITCHES)  # no probe runs
    for overrides in trained:
        assert set(switches.SMOKE_MODEL) <= set(overrides)
        assert f"--train.max_steps={switches.SMOKE_STEPS}" in overrides


def test_the_time_guard_errs_long_never_short(run_dir, monkeypatch):
    """On a machine where a forward costs an overhead plus its FLOPs at a rate of its method's
    kind (windowed methods 8x slower), the estimate is at least the true time and near it: it once
    timed a forward too short to measure anything (estimates of one evaluation swung from 31 min
    to 20 h) and every method alike (rerope's evaluation took 5x its estimate)."""
    model, _, _ = load_run(run_dir, "cpu", torch.float32)
    rates = {"plain": 8e10, "rerope": 1e10, "self_extend": 1e10, "rerope_topk": 1e10}

    def seconds(rows: int, length: int, method: str) -> float:
        return 0.01 + cost.forward_flops(model, rows, length) / rates[cost.method_kind(method)]

    def timed(model, length, device, forward, times=1):
        return seconds(1, length, model.args.rope_scaling)

    monkeypatch.setattr(cost, "timed", timed)
    forwards = [cost.Forwards(32, 256, 20), cost.Forwards(1, 8192, 40), cost.Forwards(1, 65536, 4)]
    for methods in (["none"], ["rerope"], ["none", "linear", "yarn", "rerope", "self_extend"]):
        truth = sum(
            f.count / len(methods) * seconds(f.rows, f.length, m) for f in forwards for m in methods
        )
        estimate = cost.run_seconds(model, methods, forwards, torch.device("cpu"), None)
        assert truth <= estimate < 2 * truth, (methods, truth, estimate)


# ---------------------------------------------------------------- signals inside long forwards

LONG_FORWARD = """
import sys, torch
import torch.nn.functional as F
from picollama.cli.command import run_command
from picollama.lab.interruptible import interruptible

def attend(q):  # one operation of many seconds: Python runs no signal handler inside it
    for _ in range(100):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

def main(argv):
    torch.set_num_threads(1)
    q = torch.randn(1, 2, 60000, 16)
    print("started", flush=True)
    with torch.inference_mode():
        interruptible(attend, q)
    return 0

sys.exit(run_command(main))
"""


@pytest.mark.parametrize("sent, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_inside_a_long_forward_is_answered_at_once(sent, status):
    process = subprocess.Popen(
        [sys.executable, "-c", LONG_FORWARD],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "started\n"
    time.sleep(0.5)  # inside the first attention
    process.send_signal(sent)
    started = time.perf_counter()
    _, err = process.communicate(timeout=30)
    assert time.perf_counter() - started < 3
    assert process.returncode == status and err == "error: interrupted\n", err
