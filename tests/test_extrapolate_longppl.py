"""Key-token perplexity (picollama/lab/longppl.py, LongPPL-style): which tokens are key tokens, who
picks them, their perplexity per method, and the text report that carries it."""

import json
import math

import numpy as np
import pytest

import generate
from picollama.lab import longppl, report

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_key_token_gains_over_two_nats_from_long_context_and_ends_below_two():
    short = np.array([[5.0, 5.0, 3.0, 1.5, 6.0, 4.1]])
    long = np.array([[2.5, 1.0, 0.9, 0.1, 4.5, 1.99]])
    # 0: gains 2.5 but ends at 2.5 (log-prob < -2); 1: gains 4, ends at 1; 2: gains 2.1, ends 0.9;
    # 3: gains 1.4; 4: ends high; 5: gains 2.11, ends just under 2
    expected = [[False, True, True, False, False, True]]
    assert longppl.key_token_mask(short, long).tolist() == expected


def test_the_evaluator_is_the_model_that_finds_the_most_key_tokens():
    short = np.full((1, 4), 6.0)
    losses = {
        ("a", "none"): {"32": short, "128": np.array([[1.0, 5.0, 5.0, 5.0]])},  # 1 key token
        ("a", "yarn"): {"32": short, "128": np.array([[1.0, 1.0, 5.0, 5.0]])},  # 2
        ("b", "none"): {"32": short, "128": None},  # cannot reach the long length
    }
    assert longppl.pick_evaluator(losses, "32", "128") == ("a", "yarn")
    assert longppl.pick_evaluator({("b", "none"): losses[("b", "none")]}, "32", "128") is None


def test_every_method_is_scored_on_the_evaluator_s_key_tokens():
    losses = {
        ("a", "none"): {"32": np.array([[6.0, 6.0, 1.0]]), "128": np.array([[1.0, 5.0, 1.0]])},
        ("a", "yarn"): {"32": np.array([[6.0, 6.0, 1.0]]), "128": np.array([[0.5, 1.5, 1.0]])},
    }
    found, cells = longppl.key_tokens(losses, 32, 128)
    assert found["evaluator"] == ["a", "yarn"] and (found["count"], found["scored"]) == (2, 3)
    assert (found["short"], found["long"], found["gain"], found["confident"]) == (32, 128, 2, 2)
    none = cells[("a", "none")]
    assert none["128"]["perplexity"] == pytest.approx(math.exp((1.0 + 5.0) / 2))
    assert none["32"]["perplexity"] == pytest.approx(math.exp(6.0)) and none["32"]["ratio"] == 1
    assert none["128"]["ratio"] == pytest.approx(math.exp(3.0 - 6.0))
    assert cells[("a", "yarn")]["128"]["perplexity"] == pytest.approx(math.exp(1.0))


def test_no_key_token_gives_no_cells():
    flat = {("a", "none"): {"32": np.ones((2, 3)), "128": np.ones((2, 3))}}
    found, cells = longppl.key_tokens(flat, 32, 128)
    assert (found["count"], found["scored"], cells) == (0, 6, {})
    lines = report.key_token_section({"key_tokens": found})
    assert lines[0].endswith("no key token among the 6 scored tokens.")


def test_the_text_report_carries_key_tokens_and_effective_context_both_ways(
    make_tiny_run, tmp_path, capsys
):
    run_dir, _ = make_tiny_run(60)
    argv = ["extrapolate", "--run", str(run_dir), "--probes", "0", "--num-windows", "2"]
    argv += ["--passkeys", "1", "--methods", "none,yarn", "--out", str(tmp_path)]
    assert generate.main(argv) == 0
    capsys.readouterr()
    compared = json.loads((tmp_path / "extrapolation.json").read_text())
    found = compared["key_tokens"]
    assert (found["short"], found["long"]) == (32, max(compared["lengths"]))
    assert found["scored"] == 2 * compared["score_tokens"]
    assert 0 <= found["count"] <= found["scored"]
    [run] = compared["runs"]
    markdown = (tmp_path / "extrapolation.md").read_text()
    assert "Key-token perplexity (LongPPL-style" in markdown
    if found["count"]:  # a 60-step model may find none; when it does, every method has its cells
        assert found["evaluator"][0] == str(run_dir) and set(run["key_token"]) == {"none", "yarn"}
        cells = run["key_token"]["none"].values()
        assert all(cell["loss"]["n"] == found["count"] for cell in cells)
    assert "| method | training context | effective context | passkey ≥ 80% | basis |" in markdown
    assert set(run["passkey_effective"]) == {"none", "yarn"}
