"""The real-model perplexity track (picollama/lab/context/): books, windows, chunked reads, cells,
intervals and the report, on a tiny random model."""

import io
import json
import math
import tarfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.components.length import stretched
from picollama.lab.context import perplexity, report, text
from picollama.lab.context.cells import Cells
from picollama.lab.scoring import token_losses

CONTEXT = 32


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        max_seq_len=CONTEXT,
        multiple_of=16,
        rope_window=8,
    )
    model = Transformer(args).eval()
    with torch.no_grad():  # Sharp attention and logits: the methods' positions change the losses.
        for layer in model.layers:
            layer.attention.wq.weight *= 15
            layer.attention.wk.weight *= 15
        model.output.weight *= 5
    return model


def one_shot(model, method: str, tokens: np.ndarray, scored: int) -> float:
    """The summed loss of the last `scored` tokens from one forward of them all, no KV cache."""
    base = model.args
    model.args = stretched(base, method, len(tokens))
    try:
        with torch.inference_mode():
            losses = token_losses(model, torch.from_numpy(tokens.astype(np.int64))[None])
    finally:
        model.args = base
    return losses[0, -scored:].sum().item()


def books(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"a": rng.integers(0, 64, 600).astype(np.int32), "b": rng.integers(0, 64, 500)}


def small_plan(scored: int = 8, methods=("none", "rerope")) -> perplexity.Plan:
    windows = {CONTEXT: 4, 2 * CONTEXT: 4, 4 * CONTEXT: 2}
    return perplexity.Plan(list(methods), sorted(windows), windows, scored, 16)


def run_study(model, out, plan, tokens) -> tuple[int, int]:
    """(cells computed, features calls) of one study."""
    windows = text.layout({k: len(v) for k, v in tokens.items()}, plan.longest(), plan.scored)
    calls = []
    features = model.features

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return features(*args, **kwargs)

    model.features = counted
    try:
        computed = perplexity.study(model, "tiny", plan, windows, tokens, out, ["test"])
    finally:
        del model.features
    return computed, len(calls)


@pytest.mark.parametrize(
    "method", ["none", "yarn", "dynamic", "rerope", "self_extend", "rerope_topk"]
)
def test_a_chunked_read_scores_as_one_forward_does(model, method):
    tokens = books()["a"][:128]
    window = text.Window(0, "a", 128, 128)
    cell = perplexity.Cell(method, 128, window)
    with torch.inference_mode():
        read = perplexity.read_cell(model, model.args, cell, tokens, small_plan(scored=40))
    assert read["chunk"] == (128 if method == "dynamic" else 16)
    expected = one_shot(model, method, tokens, 40)
    assert read["nll_sum"] == pytest.approx(expected, rel=1e-6)
    if method != "none":  # Applied: it differs from unscaled RoPE by 100x the tolerance.
        assert abs(expected - one_shot(model, "none", tokens, 40)) > 1e-4 * expected


def test_a_method_with_logn_attention_scales_its_queries_past_the_context(model):
    """ "rerope-logn": ReRoPE's attention on queries scaled by max(1, log n / log context)
    (variants.logn_scale), read in chunks as one forward. Within the context it is ReRoPE."""
    tokens, base, got = books()["a"][:128], model.args, {}
    for length in (CONTEXT, 128):
        window = text.Window(0, "a", 128, length)
        for method in ("rerope", "rerope-logn"):
            cell = perplexity.Cell(method, length, window)
            with torch.inference_mode():
                got[method, length] = perplexity.read_cell(
                    model, base, cell, tokens, small_plan(40)
                )
    model.args = perplexity.method_args(base, "rerope-logn", 128)
    try:
        assert model.args.logn_attention and model.args.rope_scaling == "rerope"
        with torch.inference_mode():
            ids = torch.from_numpy(tokens.astype(np.int64))[None]
            expected = token_losses(model, ids)[0, -40:].sum().item()
    finally:
        model.args = base
    assert got["rerope-logn", 128]["nll_sum"] == pytest.approx(expected, rel=1e-6)
    assert abs(expected - got["rerope", 128]["nll_sum"]) > 1e-4 * expected
    assert got["rerope-logn", CONTEXT]["nll_sum"] == got["rerope", CONTEXT]["nll_sum"]


def test_a_study_of_a_method_with_logn_saves_its_own_cells(model, tmp_path):
    computed, _ = run_study(model, tmp_path, small_plan(methods=["rerope-logn"]), books())
    saved = Cells(tmp_path / "cells").results("ppl.rerope-logn.")
    assert computed == len(saved) == 4 + 4 + 2
    assert all(cell["method"] == "rerope-logn" for cell in saved.values())


def test_cells_are_saved_once_and_skipped_on_a_rerun(model, tmp_path):
    tokens, plan = books(), small_plan()
    computed, calls = run_study(model, tmp_path, plan, tokens)
    saved = Cells(tmp_path / "cells").results("ppl.")
    # 4 windows at 1x (rerope at factor 1 is plain RoPE: it copies none's), 8 at 2x, 4 at 4x
    assert len(saved) == 20 and computed == 16
    assert calls == 4 * 2 + 8 * 4 + 4 * 8  # forwards of 31, 63, 127 tokens in chunks of 16
    assert saved["ppl.rerope.32.w2"]["same_forward_as"] == "ppl.none.32.w2"
    for key, cell in saved.items():
        book = tokens[cell["book"]]
        window = book[cell["end"] - cell["length"] : cell["end"]]
        expected = one_shot(model, cell["method"], window, plan.scored)
        assert cell["nll_sum"] == pytest.approx(expected, rel=1e-6), key
    assert run_study(model, tmp_path, plan, tokens) == (0, 0)
    assert Cells(tmp_path / "cells").results("ppl.") == saved


def test_a_later_study_copies_another_methods_saved_forward(model, tmp_path):
    tokens = books()
    run_study(model, tmp_path, small_plan(methods=["none"]), tokens)
    computed, _ = run_study(model, tmp_path, small_plan(methods=["rerope"]), tokens)
    saved = Cells(tmp_path / "cells").results("ppl.rerope.")
    assert computed == 4 + 2  # 2x and 4x: at 1x rerope is plain RoPE, read by the first study
    assert saved["ppl.rerope.32.w3"]["same_forward_as"] == "ppl.none.32.w3"


def test_a_saved_cell_of_other_tokens_is_refused(model, tmp_path):
    run_study(model, tmp_path, small_plan(methods=["none"]), books())
    with pytest.raises(UserError, match="or another --out"):
        run_study(model, tmp_path, small_plan(scored=4, methods=["none"]), books())


def test_windows_stay_in_their_book_and_score_distinct_tokens():
    longest = [4096, 4096, 2048, 2048, 1024, 1024, 1024, 1024]
    windows = text.layout({"big": 9000, "small": 5000}, longest, 256)
    assert [w.book for w in windows] == ["big", "small"] * 4
    for window, need in zip(windows, longest):
        assert need <= window.end <= {"big": 9000, "small": 5000}[window.book]
    for book in ("big", "small"):
        ends = sorted(w.end for w in windows if w.book == book)
        assert all(b - a >= 256 for a, b in zip(ends, ends[1:]))
    with pytest.raises(UserError, match="too few tokens"):
        text.layout({"big": 4000, "small": 3000}, longest, 256)


def test_the_plan_reads_every_window_at_1x_and_fewer_as_lengths_grow():
    flags = SimpleNamespace(
        lengths=None, multiples=None, windows=None, methods=["none"], scored=1024, chunk=4096
    )
    plan = perplexity.make_plan(flags, 8192)
    assert plan.windows == {8192: 8, 16384: 8, 32768: 4, 65536: 2}
    assert plan.longest() == [65536, 65536, 32768, 32768, 16384, 16384, 16384, 16384]
    with pytest.raises(UserError, match="--windows gives 2 counts for 3 lengths"):
        perplexity.make_plan(SimpleNamespace(**{**vars(flags), "windows": [4, 2]}), 8192)


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (3, 3.1824), (7, 2.3646), (30, 2.0423)])
def test_t_quantiles_match_the_published_table(df, quantile):
    assert report.t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-4)


def cell(method, length, window, nll, seconds=1.0) -> dict:
    return {
        "method": method,
        "length": length,
        "window": window,
        "context": 100,
        "nll_sum": nll,
        "tokens": 10,
        "seconds": seconds,
    }


def test_a_ratio_is_paired_by_window_with_a_t_interval():
    at_1x, at_2x = [31.0, 35.0, 28.0, 40.0], [33.0, 36.5, 31.0, 41.0]
    results = {f"a{w}": cell("none", 100, w, nll) for w, nll in enumerate(at_1x)}
    results |= {f"b{w}": cell("none", 200, w, nll) for w, nll in enumerate(at_2x)}
    row = report.ratio_rows(results)[1]
    logs = [(b - a) / 10 for a, b in zip(at_1x, at_2x)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182446 * sd / 2  # t at 0.975 with 3 degrees of freedom, from the table
    assert row["ratio"] == pytest.approx(math.exp(mean))
    assert row["interval"] == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert row["perplexity"] == pytest.approx(math.exp(sum(at_2x) / 40))
    assert row["context_perplexity"] == pytest.approx(math.exp(sum(at_1x) / 40))
    alone = report.ratio_rows({"c": cell("yarn", 200, 0, 30.0)})[0]
    assert alone["ratio"] is None and report.ratio_text(alone) == "(no 1× cell yet)"


def table_rows(markdown: str) -> dict:
    """The report's table as {(method, length cell): its cells}."""
    lines = [line.removesuffix(" |") for line in markdown.splitlines() if line.startswith("| ")]
    rows = [line.split(" | ") for line in lines]
    return {(row[0][2:], row[1]): row[2:] for row in rows}


def test_the_report_shows_a_partial_study(model, tmp_path):
    run_study(model, tmp_path, small_plan(), books())
    for key in ("ppl.none.64.w0", "ppl.none.64.w1", "ppl.rerope.128.w0"):
        (tmp_path / "cells" / f"{key}.json").unlink()
    written = report.write_report(tmp_path)
    rows = table_rows((tmp_path / "perplexity.md").read_text())
    windows, ratio = rows["none", "64 (2×)"][0], rows["none", "64 (2×)"][3]
    assert windows == "2" and "(windows: " in ratio and "[" not in ratio
    windows, ratio = rows["rerope", "64 (2×)"][0], rows["rerope", "64 (2×)"][3]
    assert windows == "4" and "[" in ratio
    assert rows["rerope", "128 (4×)"][0] == "1"
    assert rows["rerope", "32 (1×)"][4] == "—, 4 shared"
    assert (tmp_path / "perplexity.png").stat().st_size > 0 and len(written) == 2


def test_a_book_is_fetched_cleaned_and_tokenized_once(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path))
    book = text.Book("tiny", "tiny==1.0", "tiny-1.0/book.txt", "A Tiny Book", "never published")
    raw = (
        "\ufeffheader\r\n*** START OF THE BOOK ***\r\nOnce upon a time.\r\n*** END OF IT\r\nlicence"
    )
    fetched = []

    def download(requirement, dest):
        fetched.append(requirement)
        archive = dest / "tiny-1.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            data = raw.encode()
            info = tarfile.TarInfo("tiny-1.0/book.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return archive

    monkeypatch.setattr(text, "pip_download", download)
    encoded = []

    def encode(string: str) -> list[int]:
        encoded.append(string)
        return [ord(c) for c in string]

    tokenizer = SimpleNamespace(encode=encode)
    vocab = tmp_path / "tokenizer.json"
    vocab.write_text(json.dumps({"a": 1}))
    first = text.book_tokens(book, tokenizer, vocab)
    assert text.book_tokens(book, tokenizer, vocab).tolist() == first.tolist()
    assert encoded == ["\nOnce upon a time.\n"] and fetched == ["tiny==1.0"]
    assert first.tolist() == [ord(c) for c in "\nOnce upon a time.\n"]


def test_the_plan_prints_each_cell_and_the_total(model, tmp_path, capsys):
    plan = small_plan()
    windows = text.layout({"a": 600, "b": 500}, plan.longest(), plan.scored)
    total = perplexity.print_plan(model, plan, windows, tmp_path)
    out = capsys.readouterr().out
    assert "ppl.rerope.32.w0" in out and "shares ppl.none.32.w0's forward" in out
    assert out.count(" tokens  ") == 20 and "total: 16 forwards" in out and total > 0
    run_study(model, tmp_path, plan, books())
    assert perplexity.print_plan(model, plan, windows, tmp_path) == 0
    assert capsys.readouterr().out.count(" tokens  saved") == 20
