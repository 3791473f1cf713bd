"""`python generate.py extrapolate` on a tiny model trained in the fixture: files, keys, finite numbers, invariants,
errors before any work, and all outputs or none."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

import extrapolate
import generate
from checkpoint import load_run
from cli import run_command

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run, one_thread):
    return make_tiny_run(60)


def test_extrapolation_writes_report(tiny_run, capsys):
    run_dir, _ = tiny_run
    assert generate.main(["extrapolate", "--checkpoint", str(run_dir), "--num-windows", "3"]) == 0
    out_dir = run_dir / "extrapolation"
    assert {p.name for p in out_dir.iterdir()} == {"extrapolation.json", "extrapolation.md", "extrapolation.png"}
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"wrote {out_dir}")
    report = json.loads((out_dir / "extrapolation.json").read_text())
    methods, lengths = ["none", "linear", "ntk", "dynamic", "yarn"], [32, 64, 128, 256]
    assert report["methods"] == methods and report["lengths"] == lengths
    assert report["train_context"] == 32  # the tiny run's context
    assert {"model", "command", "checkpoint", "protocol", "num_windows"} <= report.keys()
    for method in methods:
        for n in lengths:
            cell = report["perplexity"][method][str(n)]
            assert math.isfinite(cell["perplexity"]) and cell["loss"]["n"] == 3 and cell["loss"]["std"] >= 0
        # at the training length every method is plain RoPE: the same targets give the same numbers
        assert report["perplexity"][method]["32"]["perplexity"] == pytest.approx(
            report["perplexity"]["none"]["32"]["perplexity"], rel=1e-5
        )
        assert report["perplexity"][method]["32"]["ratio"] == pytest.approx(1.0)
        losses = report["per_position"][method]["loss_mean"]
        assert len(losses) == len(report["per_position"]["bin_edges"]) - 1 and all(map(math.isfinite, losses))
        for d in report["retrieval"]["distances"]:
            cell = report["retrieval"][method][str(d)]
            assert 0 <= cell["accuracy"]["mean"] <= 1 and cell["logprob"]["mean"] <= 0
    assert report["retrieval"]["distances"] == [64, 128, 224]
    # a few dozen steps already beat a uniform guess over the vocabulary by far
    assert report["perplexity"]["none"]["32"]["perplexity"] < 320 / 4
    table = (out_dir / "extrapolation.md").read_text()
    assert all(f"| {m} |" in table for m in methods) and "256 (8×)" in table
    assert (out_dir / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"


def test_sliding_protocol_scores_every_token(tiny_run, tmp_path):
    run_dir, data_dir = tiny_run
    argv = [
        "extrapolate",
        "--checkpoint",
        str(run_dir),
        "--protocol",
        "sliding",
        "--methods",
        "none,ntk",
        "--lengths",
        "32,64",
        "--num-windows",
        "2",
        "--data",
        str(data_dir),
        "--out",
        str(tmp_path),
    ]
    assert generate.main(argv) == 0
    report = json.loads((tmp_path / "extrapolation.json").read_text())
    assert report["lengths"] == [32, 64] and report["protocol"] == "sliding"
    perplexity = report["perplexity"]
    assert perplexity["ntk"]["32"]["perplexity"] == pytest.approx(perplexity["none"]["32"]["perplexity"])


def test_sliding_losses_match_one_forward_when_the_window_fits(tiny_run):
    run_dir, _ = tiny_run
    model, _, _ = load_run(run_dir, torch.device("cpu"), torch.float32)
    tokens = torch.from_numpy(np.arange(48) * 7 % 300)[None]
    with torch.inference_mode():
        full = extrapolate.token_losses(model, tokens)
        assert torch.allclose(extrapolate.sliding_losses(model, tokens, 48), full)
        sliding = extrapolate.sliding_losses(model, tokens, 16)
    assert sliding.shape == full.shape  # every token scored exactly once
    assert torch.allclose(sliding[:, :15], full[:, :15], atol=1e-5)  # the first window is the same forward


def test_bad_extrapolation_input_is_one_line(tiny_run, tmp_path, capsys):
    run_dir, data_dir = tiny_run
    shutil.copytree(data_dir, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "0" * 64}))
    for argv, message in [
        (["--data", str(tmp_path / "data")], "another tokenizer"),
        (["--methods", "none,rope9"], "unknown rope9"),
        (["--lengths", "32,abc"], "comma-separated"),
        (["--lengths", "32,abc"], "'abc' is not a valid int"),
        (["--lengths", "32,100000"], "no val document"),
        (["--data", str(run_dir)], "not a prepared dataset"),
    ]:
        assert run_command(generate.main, ["extrapolate", "--checkpoint", str(run_dir), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err


def test_unwritable_out_fails_before_the_evaluation(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_run
    monkeypatch.setattr(extrapolate, "evaluate_extrapolation", lambda *a, **k: pytest.fail("evaluated"))
    (tmp_path / "file").write_text("not a directory")
    argv = ["extrapolate", "--checkpoint", str(run_dir), "--out", str(tmp_path / "file")]
    assert run_command(generate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "a file" in err and err.count("\n") == 1


def test_a_failed_write_leaves_no_outputs(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir, data_dir = tiny_run

    def disk_full(report, path):
        path.write_bytes(b"half a png")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(extrapolate, "plot_report", disk_full)
    argv = [
        "extrapolate",
        "--checkpoint",
        str(run_dir),
        "--methods",
        "none",
        "--lengths",
        "64",
        "--num-windows",
        "1",
        "--data",
        str(data_dir),
        "--out",
        str(tmp_path / "out"),
    ]
    assert run_command(generate.main, argv) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []  # neither the report files nor their temporary copies
