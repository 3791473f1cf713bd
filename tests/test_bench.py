"""Each benchmark runs end to end in its tiny --smoke mode and writes sane JSON, never over the
committed results; bad input is one error line."""

import importlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.lab.bench import common
from picollama.lab.bench.common import module_of
from picollama.lab.measure import load

REPO = Path(__file__).resolve().parent.parent
# one torch thread in this process (conftest's one_thread): the tiny models here gain nothing from
# a second one, and on a busy 2-core machine two stall each other (quantize's scoring: 20x the CPU)
pytestmark = pytest.mark.usefixtures("one_thread")


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module_of(script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run) -> tuple[Path, Path]:
    """(run_dir, data_dir): one tiny trained run and its dataset for the tests that only read them
    (one tokenizer training and dataset preparation instead of one a test)."""
    return make_tiny_run(2)


def run_in_process(main, *args: str) -> int:
    """run_command(main, args) as `python -m` runs it (the in-process run saves a python start and a
    torch import), keeping this process's torch threads (--threads sets them)."""
    threads = torch.get_num_threads()
    try:
        return run_command(main, list(args))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "script", ["train", "decode", "memory", "data", "quantize", "perplexity", "heldout", "cpu_step"]
)
def test_smoke_run_writes_results(script, tmp_path, bench_main, capsys):
    if script == "perplexity":  # ours against llama.cpp on the same GGUF
        pytest.importorskip("llama_cpp")
    elif script != "data":  # the model benchmarks compare with transformers' LlamaForCausalLM
        pytest.importorskip("transformers")
    out = tmp_path / f"{script}.json"
    # in this process (test_an_unwritable_output_is_refused_before_measuring runs `python -m`);
    # memory's two measurements still run in fresh processes, data's prepare.py in its own
    code = run_in_process(
        bench_main(script),
        "--smoke",
        *([] if script == "data" else ["--threads", "1"]),
        *(["--no-compile"] if script == "cpu_step" else []),  # test_train compiles its kernels
        "--out",
        str(out),
    )
    said = capsys.readouterr()
    assert code == 0, said.err
    assert f"results written to {out}" in said.out
    result = json.loads(out.read_text())
    assert result["benchmark"] == script
    assert {"cpu", "cpu_cores", "torch", "device"} <= result["machine"].keys()
    if script == "train":
        fp32, bf16 = result["results"]  # fp32, then both models under bf16 autocast
        assert not fp32["autocast"] and bf16["autocast"]
        for r in (fp32, bf16):
            assert r["ours"]["tokens_per_second"] > 0 and r["hf"]["tokens_per_second"] > 0
        # same weights, same loss
        assert abs(fp32["initial_loss"]["ours"] - fp32["initial_loss"]["hf"]) < 1e-3
        assert abs(bf16["initial_loss"]["ours"] - bf16["initial_loss"]["hf"]) < 3e-2
    elif script == "decode":
        agree = result["greedy_tokens_agreeing_with_ours_model_step"]
        assert agree["ours_no_cache"] == agree["ours_fused_eager"] == result["new_tokens"]
        assert all(m["tokens_per_second"] > 0 for m in result["methods"].values())
    elif script == "quantize":
        assert result["results"].keys() == {"fp32", "bf16", "int8", "int4"}
        assert all(0.99 < r["perplexity_over_fp32"] < 1.01 for r in result["results"].values())
    elif script == "perplexity":  # a random tiny model: the same numbers from both
        assert result["ours_over_llama_cpp"] == pytest.approx(1.0, abs=1e-4)
        assert result["loss_abs_difference"]["max"] < 1e-3
    elif script == "heldout":  # a random tiny model: near log(vocabulary) both ways
        assert [r["stride"] for r in result["results"].values()] == [32, 8]
        assert all(abs(r["loss"] - math.log(128)) < 0.5 for r in result["results"].values())
    elif script == "cpu_step":  # both arms timed in every chunk
        assert not result["compiled"] and result["speedup"] > 0
        assert all(len(r["chunk_ms"]) == 2 for r in result["results"].values())
    elif script == "memory":
        (r,) = result["results"]
        assert r["ours"]["step_peak_bytes"] > 0 and r["hf"]["step_peak_bytes"] > 0
    else:
        (run,) = result["runs"]
        assert run["tokens"] > 0 and run["megabytes_per_second"] > 0 and run["peak_rss_gb"] > 0.01


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("train", ["--config", "no-such-config"], "no config 'no-such-config'"),
        ("data", ["--source", "/no/such/corpus.txt"], "data/prepare.py failed"),
        ("quantize", [], "--run RUN_DIR is required"),
        ("quantize", ["--run", "/no/such/run"], "not a picollama run directory"),
        ("decode", ["--positions", "16,0"], "argument --positions: '0' is not a positive int"),
        (
            "train",
            ["--precisions", "float32,float16"],
            "unknown 'float16' (choose from float32, bfloat16)",
        ),
        ("memory", ["--dtype", "float8"], "dtype 'float8'"),
        ("cpu_step", ["--device", "cuda"], "device 'cuda'"),  # a CPU's step, or no CUDA here
    ],
)
def test_bad_input_is_one_error_line(script, args, message, tmp_path, capsys, bench_main):
    out = tmp_path / "out.json"
    assert run_command(bench_main(script), [*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "script",
    ["train", "decode", "memory", "data", "quantize", "switches", "heldout", "cpu_step", "load"],
)
def test_smoke_output_defaults_to_a_temporary_file(script, tmp_path, monkeypatch):
    # --smoke's figures (random tokens, a tiny model) must never replace docs/results/SCRIPT.json
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where tempfile.mkdtemp makes folders
    parse_args = importlib.import_module(module_of(script)).parse_args
    committed = common.RESULTS_DIR / f"{script}.json"
    default = parse_args([])
    assert default.out == committed and not default.temporary_out
    given = tmp_path / "given.json"
    assert parse_args(["--smoke", "--out", str(given)]).out == given
    smoke = parse_args(["--smoke"])
    assert smoke.temporary_out and smoke.out.name == f"{script}.json"
    assert smoke.out.parent.parent == tmp_path and not smoke.out.exists()


def test_smoke_results_say_where_they_went(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = importlib.import_module("picollama.lab.measure.data").parse_args(["--smoke"])
    assert args.out.is_relative_to(tmp_path)
    common.write_results(args, {"runs": []})
    said = capsys.readouterr().out
    assert f"results written to {args.out}\n" in said and "never docs/results/data.json" in said
    assert json.loads(args.out.read_text())["runs"] == []


def test_an_unwritable_output_is_refused_before_measuring(tmp_path):
    (tmp_path / "file").write_text("")
    done = run_bench("data", "--smoke", "--out", str(tmp_path / "file" / "out.json"))
    assert (
        done.returncode == 2
        and done.stderr.startswith("error: cannot write")
        and done.stderr.count("\n") == 1
    )
    assert done.stdout == ""  # nothing was measured


def test_switches_trains_each_switch_for_the_budget(
    tiny_run, tmp_path, bench_main, capsys, monkeypatch
):
    _, data_dir = tiny_run
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # its train.py runs: one thread, as this process
    config = tmp_path / "tiny.toml"
    config.write_text(
        "[model]\ndim = 32\nn_layers = 1\nn_heads = 2\nvocab_size = 320\nmax_seq_len = 32\n"
        f'[data]\ndir = "{data_dir}"\n[train]\nbatch_size = 4\nseq_len = 32\n'
        "[eval]\nbatches = 1\nbatch_size = 4\n"
    )
    out = tmp_path / "switches.json"
    # in this process (its train.py runs are subprocesses still), for a budget of 0.25 s rather
    # than --smoke's 3 s: the same probe run, then the budget's steps
    code = run_in_process(
        bench_main("switches"),
        *("--budget", "0.25", "--config", str(config), "--only", "qk-norm", "--out", str(out)),
    )
    assert code == 0, capsys.readouterr().err
    written = json.loads(out.read_text())
    assert written["budget_seconds"] == 0.25
    result = written["switches"]
    assert list(result) == ["qk-norm"]
    (run,) = result["qk-norm"]["runs"]
    assert run["stability"] == "stable" and run["steps"] >= 1 and 0 < run["val_bpb"] < 20
    llama = Transformer(
        ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=320, max_seq_len=32)
    ).num_params()
    # the config's LLaMA and one q and one k norm of head size 16
    assert run["params"] == llama + 2 * 16


def test_load_trains_beside_a_hog_and_reports_the_threads_it_took(
    tiny_run, tmp_path, bench_main, capsys
):
    """measure.load starts a busy process beside train.py's budgeted run. Left to choose (adapt),
    train.py follows the free cores: on a machine of several cores it leaves the hog's."""
    _, data_dir = tiny_run
    config = tmp_path / "tiny.toml"
    config.write_text(
        "[model]\ndim = 32\nn_layers = 1\nn_heads = 2\nvocab_size = 320\nmax_seq_len = 32\n"
        f'[data]\ndir = "{data_dir}"\n[train]\nmax_minutes = 1\n'
    )
    out = tmp_path / "load.json"
    code = run_in_process(bench_main("load"), "--smoke", "--config", str(config), "--out", str(out))
    assert code == 0, capsys.readouterr().err
    (run,) = json.loads(out.read_text())["runs"]
    assert run["way"] == "adapt" and run["hogs"] == 1 and run["steps"] >= 1
    assert run["cpu_s"] > 0 and 0 < run["val_bpb"] < 20
    if load.CORES > 1:
        assert [n for n in run["notes"] if n.startswith("CPU threads")], (
            "train.py kept every core beside a busy process"
        )


def test_quantize_scores_a_run_on_its_own_tokenizer_s_data(tiny_run, tmp_path, bench_main, capsys):
    """An imported model records no dataset: quantize asks for --data rather than reading
    data/shakespeare, and refuses a dataset made by another tokenizer."""
    run_dir, data_dir = tiny_run
    imported = tmp_path / "imported"
    shutil.copytree(run_dir, imported)
    config = json.loads((imported / "config.json").read_text())
    (imported / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "data"})
    )
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "0" * 64}))
    out = str(tmp_path / "out.json")
    for args, message in [
        ([], "records no dataset (an imported model): pass --data DIR"),
        (["--data", str(other)], "was tokenized with another tokenizer"),
    ]:
        assert (
            run_command(bench_main("quantize"), ["--run", str(imported), *args, "--out", out]) == 2
        )
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert (
        run_command(
            bench_main("quantize"), ["--run", str(imported), "--data", str(data_dir), "--out", out]
        )
        == 0
    )
    assert json.loads(Path(out).read_text())["results"].keys() == {"fp32", "bf16", "int8", "int4"}
