"""`python generate.py extrapolate` on tiny models trained in the fixture: files, keys, finite
numbers, invariants, the copy probe, the effective context, several runs side by side, errors
before any work, and all outputs or none; its options as the flags, and the scalings of each
position encoding."""

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

import generate
from data.loader import load_meta
from model import POSITIONS, ModelArgs, Transformer
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import ArgumentParser
from picollama.components.length import stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.lab import extrapolate, passkey, runs, scoring, text_track
from picollama.run_files import load_run

pytestmark = pytest.mark.usefixtures("one_thread")
SPAN = 8  # the probe span in these tests: a quarter of the tiny runs' context


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run, one_thread):
    return make_tiny_run(60)


def extrapolate_argv(run_dir, *more):
    return ["extrapolate", "--run", str(run_dir), "--probe-span", str(SPAN), "--probes", "4", *more]


def check_method(report: dict, method: str):
    """The numbers of one method of the tiny run, scored on 3 windows and 4 probes."""
    [run] = report["runs"]
    for n in report["lengths"]:
        cell = run["perplexity"][method][str(n)]
        assert math.isfinite(cell["perplexity"])
        assert cell["loss"]["n"] == 3 and cell["loss"]["sem"] >= 0
    # at the training length every method is plain RoPE: the same targets give the same numbers
    assert run["perplexity"][method]["32"]["perplexity"] == pytest.approx(
        run["perplexity"]["none"]["32"]["perplexity"], rel=1e-5
    )
    assert run["perplexity"][method]["32"]["ratio"] == pytest.approx(1.0)
    losses = run["per_position"][method]["loss_mean"]
    assert len(losses) == len(report["per_position_edges"]) - 1 and all(map(math.isfinite, losses))
    for d in report["probe"]["distances"]:
        cell = run["probe"][method][str(d)]
        assert 0 <= cell["accuracy"]["mean"] <= 1 and cell["accuracy"]["n"] == 4
        assert math.isfinite(cell["loss_drop"]["mean"])
    effective = run["effective_context"][method]
    assert effective["tokens"] in report["lengths"]
    assert effective["basis"].startswith("perplexity only")  # no copying yet


def test_extrapolation_writes_report(tiny_run, capsys):
    run_dir, _ = tiny_run
    assert generate.main(extrapolate_argv(run_dir, "--num-windows", "3")) == 0
    out_dir = run_dir / "extrapolation"
    files = {"extrapolation.json", "extrapolation.md", "extrapolation.png"}
    assert {p.name for p in out_dir.iterdir()} == files
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith(f"wrote {out_dir}")
    assert printed[-2].startswith(f"effective context of {run_dir}")
    report = json.loads((out_dir / "extrapolation.json").read_text())
    methods, lengths = list(ROPE_SCALINGS), [32, 64, 128, 256]
    [run] = report["runs"]
    assert run["methods"] == methods and report["lengths"] == lengths
    assert run["train_context"] == 32 and run["position"] == "rope"  # the tiny run's context
    assert {"model", "name", "perplexity", "probe", "per_position", "effective_context"} <= set(run)
    keys = {"command", "protocol", "num_windows", "probe", "per_position_tokens", "seconds"}
    assert keys <= set(report)
    # the probe reads at a quarter and half of the context, and at the farthest repeat that fits
    # each length
    assert report["probe"]["distances"] == [8, 16, 24, 56, 120, 248]
    edges = report["per_position_edges"]
    assert edges[0] == 0 and edges[-1] == 255 and sum(report["per_position_tokens"]) == 255 * 3
    for method in methods:
        check_method(report, method)
    # a few dozen steps already beat a uniform guess over the vocabulary by far
    assert run["perplexity"]["none"]["32"]["perplexity"] < 320 / 4
    table = (out_dir / "extrapolation.md").read_text()
    assert all(f"| {m} |" in table for m in methods) and "| method | 32 | 64 | 128 | 256 |" in table
    assert "d=248" in table and "Effective context" in table and "from 24 (the first)" in table
    assert (out_dir / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"


def test_each_position_runs_with_the_scalings_its_args_accept():
    for position in POSITIONS:
        args = ModelArgs(dim=32, n_heads=4, max_seq_len=32, position=position)
        expected = list(ROPE_SCALINGS) if position in ("rope", "prope") else ["none"]
        assert runs.scalings(args) == expected, position


def test_options_are_the_flags_and_their_command_reads_back_the_same():
    parser = ArgumentParser(prog="extrapolate")
    extrapolate.add_arguments(parser)
    assert runs.Options.from_args(parser.parse_args(["--run", "a"])) == (runs.Options())
    options = runs.Options([32, 64], ["none", "yarn"], retrieval_rows=32, seed=3)
    command = options.command([Path("a"), Path("b")], Path("c"))
    assert command[:3] == ["python", "generate.py", "extrapolate"]
    args = parser.parse_args(command[3:])
    assert runs.Options.from_args(args) == options
    assert args.run == [Path("a"), Path("b")] and args.out == Path("c")


class AsModel:
    """A model whose features are the logits `function` gives (its head is the identity)."""

    def __init__(self, function):
        self.features = function

    def head(self, h):
        return h


def test_probe_places_the_span_twice_and_scores_the_repeat():
    text = np.arange(100, 140)[None].repeat(2, axis=0)
    spans = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    sequences = text_track.probe_sequences(text, spans, 10)
    assert sequences.shape == (2, 14)
    assert (sequences[:, :4] == spans).all() and (sequences[:, 10:] == spans).all()
    assert (sequences[:, 4:10] == np.arange(104, 110)).all()  # real text between

    def copier(tokens):
        """Predicts, at each position, the token 9 places back: a perfect copy at distance 10."""
        logits = torch.full((*tokens.shape, 200), -10.0)
        logits[:, 9:].scatter_(2, tokens[:, :-9, None], 10.0)
        return logits

    accuracy, drop = text_track.probe_scores(AsModel(copier), sequences, 10, "cpu")
    # from a uniform guess to ~0
    assert accuracy.tolist() == [1.0, 1.0] and np.allclose(drop, math.log(200))

    def uniform(tokens):
        return torch.zeros(*tokens.shape, 200)

    accuracy, drop = text_track.probe_scores(AsModel(uniform), sequences, 10, "cpu")
    assert accuracy.tolist() == [0.0, 0.0] and np.allclose(drop, 0)


def test_probe_spans_are_seeded_and_never_special(tiny_run):
    _, data_dir = tiny_run
    meta = load_meta(data_dir)
    spans = text_track.probe_spans(meta, 50, 16, seed=0)
    assert spans.shape == (50, 16)
    assert np.array_equal(spans, text_track.probe_spans(meta, 50, 16, seed=0))
    special = [meta[k] for k in ("unk_id", "bos_id", "eos_id")]
    assert not np.isin(spans, special).any() and spans.max() < meta["vocab_size"]
    assert len(np.unique(spans)) > 200  # uniform over the vocabulary, not its frequent tokens


def cells(ratios: dict, accuracies: dict) -> tuple[dict, dict]:
    perplexity = {str(n): None if r is None else {"ratio": r} for n, r in ratios.items()}
    probe = {
        str(d): None if a is None else {"accuracy": {"mean": a}} for d, a in accuracies.items()
    }
    return perplexity, probe


def test_effective_context_needs_perplexity_and_probe():
    # perplexity within 5% up to 512; the probe (at n - 16) within 10 points of 0.9 up to 1024
    perplexity, probe = cells(
        {256: 1, 512: 1.04, 1024: 1.04, 2048: 1.2}, {240: 0.9, 496: 0.85, 1008: 0.7}
    )
    assert text_track.effective_context(perplexity, probe, 256, 16) == {
        "tokens": 512,
        "basis": "perplexity and probe",
        "probe_in_context": 0.9,
    }
    perplexity, probe = cells({256: 1, 512: 1.06, 1024: 1.0}, {240: 0.9, 496: 0.9, 1008: 0.9})
    # "stays": the first miss ends it
    assert text_track.effective_context(perplexity, probe, 256, 16)["tokens"] == 256
    # a probe that never copies is left out, and said so
    perplexity, probe = cells({256: 1, 512: 1.01, 1024: 1.02}, {240: 0.1, 496: 0.0, 1008: 0.0})
    result = text_track.effective_context(perplexity, probe, 256, 16)
    assert result["tokens"] == 1024
    assert result["basis"] == "perplexity only: the probe reads 10% in context"
    # n/a (a learned table's end) stops it
    perplexity, probe = cells({256: 1, 512: None}, {240: 0.9, 496: None})
    assert text_track.effective_context(perplexity, probe, 256, 16)["tokens"] == 256


def test_position_bins_are_log_spaced_and_cover_the_window():
    edges = text_track.position_bins(2048)
    assert edges[0] == 0 and edges[-1] == 2047 and (np.diff(edges) > 0).all()
    widths = np.diff(edges)
    assert widths[-1] > 300 and widths.min() == 8  # wide bins late, where the curve is flat


@pytest.fixture(scope="module")
def second_run(make_tiny_run, one_thread):
    return make_tiny_run(30)


def test_several_runs_share_windows_and_spans(tiny_run, second_run, tmp_path, capsys):
    (run_a, data_dir), (run_b, _) = tiny_run, second_run
    argv = extrapolate_argv(f"{run_a},{run_b}", "--methods", "none,yarn", "--lengths", "32,64")
    argv += ["--num-windows", "2", "--data", str(data_dir), "--out", str(tmp_path / "both")]
    assert generate.main(argv) == 0
    report = json.loads((tmp_path / "both" / "extrapolation.json").read_text())
    assert [run["name"] for run in report["runs"]] == [str(run_a), str(run_b)]
    table = (tmp_path / "both" / "extrapolation.md").read_text()
    assert f"| `{run_a}` | yarn |" in table and f"| `{run_b}` | none |" in table
    printed = capsys.readouterr().out
    assert f"effective context of {run_a}" in printed and f"effective context of {run_b}" in printed
    # the same run alone gives the same numbers: the same windows and probe spans
    alone = extrapolate_argv(
        run_b, "--methods", "none,yarn", "--lengths", "32,64", "--num-windows", "2"
    )
    assert generate.main([*alone, "--data", str(data_dir), "--out", str(tmp_path / "alone")]) == 0
    [single] = json.loads((tmp_path / "alone" / "extrapolation.json").read_text())["runs"]
    assert single["perplexity"] == report["runs"][1]["perplexity"]
    assert single["probe"] == report["runs"][1]["probe"]
    assert (tmp_path / "both" / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"


def test_no_probe_scores_the_same_perplexity(tiny_run, tmp_path):
    """--probes 0 leaves the copy probe out (half the forwards at the longest length) and scores
    the same windows the same way."""
    run_dir, data_dir = tiny_run
    reports = []
    for probes in ("0", "2"):
        argv = ["extrapolate", "--run", str(run_dir), "--probes", probes, "--num-windows", "2"]
        argv += ["--methods", "none,yarn", "--lengths", "32,64", "--out", str(tmp_path / probes)]
        assert generate.main(argv) == 0
        reports.append(json.loads((tmp_path / probes / "extrapolation.json").read_text()))
    [none], [two] = (report["runs"] for report in reports)
    assert none["perplexity"] == two["perplexity"] and none["probe"] == {"none": {}, "yarn": {}}
    assert (
        none["effective_context"]["yarn"]["basis"] == "perplexity only: no copy probe (--probes 0)"
    )
    assert "Copy probe" not in (tmp_path / "0" / "extrapolation.md").read_text()


def test_runs_with_other_tokenizers_are_refused(tiny_run, tmp_path, capsys):
    run_dir, data_dir = tiny_run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("extrapolation"))
    (tmp_path / "text.txt").write_text("a small corpus of words for another tokenizer\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"),
        model_prefix=str(tmp_path / "spm"),
        vocab_size=25,
        minloglevel=2,
    )
    shutil.copy(tmp_path / "spm.model", other / "tokenizer.model")
    config = json.loads((other / "config.json").read_text())  # a run saved with that tokenizer
    tokenizer = (other / "tokenizer.model").read_bytes()
    config["tokenizer_sha256"] = hashlib.sha256(tokenizer).hexdigest()
    (other / "config.json").write_text(json.dumps(config))
    argv = extrapolate_argv(f"{run_dir},{other}", "--out", str(tmp_path / "out"))
    assert run_command(generate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "different tokenizers" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_other_position_encodings_get_none_alone(make_tiny_run, tmp_path, capsys):
    run_dir, _ = make_tiny_run(5, position="alibi")
    argv = extrapolate_argv(
        run_dir, "--lengths", "32,64", "--num-windows", "2", "--out", str(tmp_path / "a")
    )
    assert generate.main(argv) == 0
    [run] = json.loads((tmp_path / "a" / "extrapolation.json").read_text())["runs"]
    assert run["methods"] == ["none"] and run["position"] == "alibi"
    capsys.readouterr()
    assert run_command(generate.main, [*argv, "--methods", "none,ntk"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --methods ntk: RoPE scaling applies to RoPE models only")
    assert err.count("\n") == 1


def test_learned_positions_past_their_table_are_not_available(make_tiny_run, tmp_path):
    run_dir, _ = make_tiny_run(5, position="learned")
    argv = extrapolate_argv(
        run_dir, "--lengths", "32,64", "--num-windows", "2", "--out", str(tmp_path)
    )
    assert generate.main(argv) == 0
    [run] = json.loads((tmp_path / "extrapolation.json").read_text())["runs"]
    # 64 > max_seq_len 32
    assert run["perplexity"]["none"]["64"] is None and run["probe"]["none"]["56"] is None
    assert run["perplexity"]["none"]["32"]["ratio"] == 1
    assert run["effective_context"]["none"]["tokens"] == 32
    assert run["per_position"] == {}  # no curve: the whole window does not fit
    assert "n/a" in (tmp_path / "extrapolation.md").read_text()


def test_sliding_protocol_scores_every_token(tiny_run, tmp_path):
    run_dir, data_dir = tiny_run
    argv = extrapolate_argv(
        run_dir, "--protocol", "sliding", "--methods", "none,ntk", "--lengths", "32,64"
    )
    argv += ["--num-windows", "2", "--data", str(data_dir), "--out", str(tmp_path)]
    assert generate.main(argv) == 0
    report = json.loads((tmp_path / "extrapolation.json").read_text())
    assert report["lengths"] == [32, 64] and report["protocol"] == "sliding"
    perplexity = report["runs"][0]["perplexity"]
    assert perplexity["ntk"]["32"]["perplexity"] == pytest.approx(
        perplexity["none"]["32"]["perplexity"]
    )


def test_sliding_losses_match_one_forward_when_the_window_fits(tiny_run):
    run_dir, _ = tiny_run
    model, _, _ = load_run(run_dir, torch.device("cpu"), torch.float32)
    tokens = torch.from_numpy(np.arange(48) * 7 % 300)[None]
    with torch.inference_mode():
        full = scoring.token_losses(model, tokens)
        assert torch.allclose(scoring.sliding_losses(model, tokens, 48), full)
        sliding = scoring.sliding_losses(model, tokens, 16)
    assert sliding.shape == full.shape  # every token scored exactly once
    # the first window is the same forward
    assert torch.allclose(sliding[:, :15], full[:, :15], atol=1e-5)


def test_bad_extrapolation_input_is_one_line(tiny_run, tmp_path, capsys):
    run_dir, data_dir = tiny_run
    shutil.copytree(data_dir, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "0" * 64}))
    for argv, message in [
        (["--data", str(tmp_path / "data")], "another tokenizer"),
        (["--methods", "none,rope9"], "unknown 'rope9' (choose from none, linear"),
        (["--lengths", "32,abc"], "--lengths: 'abc' is not a positive int (in '32,abc')"),
        (["--lengths", ","], "expected a comma-separated list"),
        (["--lengths", "32,100000"], "no val document"),
        (["--data", str(run_dir)], "not a prepared dataset"),
        (["--probes", "-1"], "--probes: invalid non-negative int value: '-1'"),
        (["--probe-span", "1"], "--probe-span must be >= 2"),
    ]:
        assert run_command(generate.main, ["extrapolate", "--run", str(run_dir), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err
    for checkpoints, message in [
        (f"{run_dir},{run_dir}/", "names a run twice"),
        (f"{run_dir},{data_dir}", "--out"),
    ]:
        assert run_command(generate.main, ["extrapolate", "--run", checkpoints]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err


def never_evaluated(monkeypatch):
    def evaluated(*args):
        pytest.fail("evaluated")

    monkeypatch.setattr(text_track, "evaluate_run", evaluated)


def test_unwritable_out_fails_before_the_evaluation(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir, _ = tiny_run
    never_evaluated(monkeypatch)
    (tmp_path / "file").write_text("not a directory")
    argv = ["extrapolate", "--run", str(run_dir), "--out", str(tmp_path / "file")]
    assert run_command(generate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "a file" in err and err.count("\n") == 1


def test_a_failed_write_leaves_no_outputs(tiny_run, tmp_path, capsys, monkeypatch):
    run_dir, data_dir = tiny_run

    def disk_full(report, path):
        path.write_bytes(b"half a png")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(extrapolate, "plot_report", disk_full)
    argv = extrapolate_argv(run_dir, "--methods", "none", "--lengths", "64", "--num-windows", "1")
    argv += ["--data", str(data_dir), "--out", str(tmp_path / "out")]
    assert run_command(generate.main, argv) == 2
    assert "No space left on device" in capsys.readouterr().err
    # neither the report files nor their temporary copies
    assert list((tmp_path / "out").iterdir()) == []


def test_an_evaluation_too_long_is_refused_before_any_work(tiny_run, tmp_path, capsys, monkeypatch):
    """A million windows would take hours: refused, with the estimate, before the windows are even
    read; --max-minutes lets a long one run."""
    run_dir, _ = tiny_run
    never_evaluated(monkeypatch)
    argv = ["extrapolate", "--run", str(run_dir), "--out", str(tmp_path / "out")]
    assert run_command(generate.main, [*argv, "--num-windows", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this evaluation would take about ") and err.count("\n") == 1
    assert " h (" in err and "over --max-minutes 60; use fewer --num-windows" in err
    assert not (tmp_path / "out").exists()

    def reached(*args):
        raise UserError("reached the evaluation")

    monkeypatch.setattr(text_track, "evaluate_run", reached)
    argv += ["--num-windows", "20000", "--max-minutes", "100000"]
    assert run_command(generate.main, argv) == 2
    assert "reached the evaluation" in capsys.readouterr().err


def test_a_forward_too_large_for_memory_is_refused(make_tiny_run, tmp_path, capsys, monkeypatch):
    """ALiBi's bias is length² per head: 65,536 tokens need far more than any machine here."""
    run_dir, _ = make_tiny_run(1, position="alibi")
    never_evaluated(monkeypatch)

    def long_documents(data_dir, split, length, count, seed=0):  # a corpus of long documents
        return np.zeros((count, length), dtype=np.int64)

    monkeypatch.setattr(text_track, "document_windows", long_documents)
    argv = extrapolate_argv(run_dir, "--lengths", "32,65536", "--out", str(tmp_path / "out"))
    assert run_command(generate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this evaluation needs about ") and err.count("\n") == 1
    assert "GB of memory" in err and f"a forward of 1 × 65,536 tokens of {run_dir}" in err
    assert "mostly ALiBi's 65,536 × 65,536 attention bias per head" in err
    assert err.strip().endswith("use shorter --lengths")


def test_a_missing_matplotlib_is_one_line_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without [plot] has
    status = run_command(generate.main, ["extrapolate", "--run", "no-such-run"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "plotting needs the matplotlib package" in err and "'.[plot]'" in err


def test_scores_come_from_the_logits_a_slice_of_positions_at_a_time(monkeypatch):
    """losses_and_hits makes the logits HEAD_CHUNK positions at a time (bounded memory at 32k
    tokens) and gives what the whole logits give: cross-entropy and top-1 hits."""
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)
    model = Transformer(args).eval()
    tokens = torch.randint(0, 64, (2, 50))
    logits = model(tokens[:, :-1])
    monkeypatch.setattr(scoring, "HEAD_CHUNK", 7)
    with torch.inference_mode():
        losses, hits = scoring.losses_and_hits(model, tokens)
    expected = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), tokens[:, 1:], reduction="none"
    )
    assert torch.allclose(losses, expected, atol=1e-6)
    assert torch.equal(hits, logits.argmax(-1) == tokens[:, 1:])


def test_methods_that_compute_the_same_forward_share_one_key():
    """The study runs a forward once for all methods that leave RoPE as it is at a length: the
    scalings at factor 1 whose frequencies come out bit for bit RoPE's (YaRN's and Llama 3's blends
    may round), never two different forwards."""
    args = ModelArgs(dim=64, n_heads=4, max_seq_len=128, rope_theta=1e4)
    key = text_track.forward_key
    plain = key(stretched(args, "none", 128), 128)
    for method in ("linear", "ntk", "dynamic"):
        assert key(stretched(args, method, 128), 128) == plain
    for method in ("linear", "ntk", "dynamic", "yarn", "llama3"):
        assert key(stretched(args, method, 256), 256) != key(stretched(args, "none", 256), 256)
    assert key(stretched(args, "linear", 256), 256) != key(stretched(args, "ntk", 256), 256)
    # static NTK at factor 2 has dynamic's frequencies at 256 tokens, but dynamic's forward covers
    # 255 (the scored tokens): never shared
    assert key(stretched(args, "dynamic", 256), 256) != key(stretched(args, "ntk", 256), 256)
    assert key(stretched(args, "none", 64), 64) != plain  # another length


def test_passkey_rows_hide_the_key_and_score_it_as_a_full_forward_does(tiny_run):
    """A passkey row is real text with the needle at its depth and the question at its end; the
    scores made through the KV cache equal a plain forward's log-likelihood of each candidate."""
    run_dir, data_dir = tiny_run
    model, _, tokenizer = load_run(run_dir, torch.device("cpu"), torch.float32)
    filler = np.arange(1000, dtype=np.int64) % 50 + 10
    rng = np.random.default_rng(0)
    assert passkey.passkey_row(tokenizer, filler, 64, 0.5, rng) is None  # no room for the needle
    row, candidates = passkey.passkey_row(tokenizer, filler, 160, 0.5, rng)
    assert len(row) + max(map(len, candidates)) <= 160 and len(candidates) == 10
    question = tokenizer.encode(passkey.QUESTION)
    assert row[-len(question) :].tolist() == question
    true_key = tokenizer.decode(candidates[0]).strip()
    assert f"The pass key is {true_key}." in tokenizer.decode(row.tolist())
    assert len({tuple(c) for c in candidates}) == 10  # ten different keys
    model.args = stretched(model.args, "yarn", 160)  # past the tiny run's 32 tokens, scaled
    scores = passkey.candidate_scores(model, torch.from_numpy(row)[None], candidates[:3])
    for score, tokens in zip(scores, candidates):
        full = torch.tensor([[*row.tolist(), *tokens]])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(full[:, :-1]).float(), -1)[0]
        expected = sum(logprobs[len(row) - 1 + i, t].item() for i, t in enumerate(tokens))
        assert score == pytest.approx(expected, abs=1e-4)


def test_passkeys_are_scored_for_every_method_and_length(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    argv = ["extrapolate", "--run", str(run_dir), "--probes", "0", "--passkeys", "2"]
    argv += ["--num-windows", "1", "--methods", "none,yarn", "--lengths", "128,256"]
    assert generate.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "extrapolation.json").read_text())
    [run] = report["runs"]
    for method in ("none", "yarn"):
        assert run["passkey"][method]["32"] is None  # too short for the needle and question
        for n in ("128", "256"):
            cell = run["passkey"][method][n]
            assert 0 <= cell["accuracy"] <= 1 and set(cell["by_depth"]) == {"0.1", "0.5", "0.9"}
            assert all(c["n"] == 2 for c in cell["by_depth"].values())
        effective = run["passkey_effective"][method]
        assert effective is None or effective in (128, 256)
    assert "Passkey: a random five-digit key" in (tmp_path / "extrapolation.md").read_text()
