"""sampler.Sampler, the one sampler: its draws, its seeds, and generate.py and the server alike.

Seeded batches changed once, when the two samplers became one. Row r of a batch now draws from
its own generator, seeded seed + r. These tests pin what holds from then on.
"""

import math
from dataclasses import replace

import pytest
import torch

from model import ModelArgs, Transformer
from picollama.cli.flags import SEEDS
from picollama.kernels.caches import Sinks
from picollama.kernels.fused_step import DecodeStep
from picollama.sampling.decode import DecodeOptions, decode_rows, generate
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampler, Sampling
from picollama.sampling.slots import Slots

TINY = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64, multiple_of=16
)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2]]
LOGITS = [2.0, 1.6, 1.1, 0.7, 0.3, 0.0, -0.4, -0.9, -1.5, -2.5]  # no ties
# the 0.999 quantile of chi-square with df degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Transformer:
    """A random tiny model, its weights sharpened so that sampling has choices to make."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return model


def draws(logits: torch.Tensor, sampling: Sampling, rows: int, calls: int) -> torch.Tensor:
    """rows × calls tokens drawn from one row's logits.

    Row r is seeded sampling.seed + r. Each row draws `calls` times, as at successive positions.
    """
    sampler = Sampler([replace(sampling, seed=sampling.seed + r) for r in range(rows)], "cpu")
    batch = logits.expand(rows, -1)
    return torch.cat([sampler(batch, [True] * rows) for _ in range(calls)])


def filtered_softmax(logits: list[float], sampling: Sampling) -> tuple[dict, float]:
    """{token: probability} after temperature, top-k then top-p, in float64 on the host.

    Also how near the top-p cut comes to a token's edge. A test needs that far from 0.
    """
    scaled = [x / sampling.temperature for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])[: sampling.top_k]
    total = sum(math.exp(scaled[i]) for i in order)
    probs = {i: math.exp(scaled[i]) / total for i in order}
    margin = 1.0
    if sampling.top_p is not None:
        kept, before = [], 0.0
        for i in order:
            margin = min(margin, abs(before - sampling.top_p))
            if before < sampling.top_p:
                kept.append(i)
            before += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return probs, margin


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()

    def support(top_k, top_p) -> set[int]:
        return set(draws(logits, Sampling(1, 1.0, top_k, top_p, seed=0), 100, 40).tolist())

    assert support(None, None) == {0, 1, 2, 3}
    assert support(2, None) == {0, 1}
    assert support(None, 0.7) == {0, 1}
    assert support(None, 0.5) == {0}  # the top token alone holds 0.5
    assert support(3, 0.99) == {0, 1, 2}
    counts = torch.bincount(draws(logits, Sampling(1, 1.0, None, 0.9, 0), 100, 40), minlength=4)
    renormalised = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(counts / 4000, renormalised, atol=0.03)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(1, 0.7, top_k=6, top_p=0.9, seed=0),
        Sampling(1, 1.5, top_p=0.75, seed=100),
        Sampling(1, 1.0, top_k=3, seed=200),
        Sampling(1, 2.0, top_p=0.95, seed=300),
    ],
)
def test_draws_follow_the_filtered_softmax(sampling):
    """20,000 draws: their counts pass a chi-square test against the filtered softmax.

    The bound is the 0.999 quantile. The seeds are fixed, so the test is deterministic. A token
    the filters drop is never drawn.
    """
    expected, margin = filtered_softmax(LOGITS, sampling)
    assert margin > 0.005  # a cut this far from any token's edge cannot move in float32
    drawn = draws(torch.tensor(LOGITS), sampling, 200, 100)
    counts = torch.bincount(drawn, minlength=len(LOGITS)).tolist()
    assert {i for i, count in enumerate(counts) if count} <= set(expected)
    n = len(drawn)
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, counts, expected)


def test_rows_of_one_batch_draw_by_their_own_settings():
    """Four settings in one batch: each row's draws keep to its own filters."""
    settings = [Sampling(1, 0.7, 6, 0.9), Sampling(1, 1.0, 3), Sampling(1, 0.0), Sampling(1, 2.0)]
    sampler = Sampler([replace(s, seed=r) for r, s in enumerate(settings * 50)], "cpu")
    batch = torch.tensor(LOGITS).expand(200, -1)
    drawn = torch.stack([sampler(batch, [True] * 200) for _ in range(20)]).view(20, 50, 4)
    for column, sampling in enumerate(settings):
        seen = set(drawn[:, :, column].flatten().tolist())
        if sampling.temperature == 0:
            assert seen == {0}
        else:
            assert seen == set(filtered_softmax(LOGITS, sampling)[0])


@pytest.mark.parametrize("options", ["plain", "fused", "sinks"])
def test_a_seed_gives_the_same_text_run_to_run(model, options):
    options = decode_options(model, options)
    sampling = Sampling(16, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    first = generate(model, PROMPTS, sampling, options=options)
    assert first == generate(model, PROMPTS, sampling, options=options)
    assert first != generate(model, PROMPTS, replace(sampling, seed=4), options=options)
    assert all(len(row) == 16 for row in first)


@pytest.mark.parametrize("options", ["plain", "fused", "sinks"])
def test_each_row_of_a_batch_is_the_row_alone_seeded_seed_plus_row(model, options):
    """Rows of different lengths, each seeded seed + r, modulo SEEDS: the last wraps to 0."""
    options = decode_options(model, options)
    sampling = Sampling(16, temperature=1.1, top_k=30, top_p=0.95, seed=SEEDS - 3)
    batch = generate(model, PROMPTS, sampling, options=options)
    for r, prompt in enumerate(PROMPTS):
        seeded = replace(sampling, seed=(sampling.seed + r) % SEEDS)
        assert generate(model, [prompt], seeded, options=options)[0] == batch[r]


def test_generate_and_the_server_decode_alike(model):
    """The server's rows (n = 2, each seeded seed + its index) decode as generate's batch.

    Its static batches run decode_rows. Its continuous batching runs Slots. Both give the same
    tokens, seeded and greedy.
    """
    for sampling in (Sampling(12, 0.0), Sampling(12, 0.9, top_k=40, seed=7)):
        prompts = [prompt for prompt in PROMPTS[:2] for _ in range(2)]
        ours = generate(model, prompts, sampling)
        rows = served_rows(prompts, sampling)
        assert decode_rows(model, rows, lambda r, token: False) == ours
        slots, got = Slots(model, DecodeStep(model)), [[] for _ in rows]
        for row, tokens in zip(rows, got):
            slots.join(
                row, lambda token, tokens=tokens: tokens.append(token.id), lambda reason: None
            )
        while slots.slots:
            slots.advance()
        assert got == ours


def served_rows(prompts: list[list[int]], sampling: Sampling) -> list[Row]:
    """Rows as serve/rows.py makes them: row r seeded seed + r."""
    seeds = [None if sampling.seed is None else (sampling.seed + r) % SEEDS for r in range(4)]
    return [Row(p, replace(sampling, seed=seed)) for p, seed in zip(prompts, seeds)]


def decode_options(model: Transformer, kind: str) -> DecodeOptions:
    """The model's forward, the fused step, or attention sinks with a window the rows pass."""
    if kind == "fused":
        return DecodeOptions(DecodeStep(model))
    return DecodeOptions(sinks=Sinks(2, window=12)) if kind == "sinks" else DecodeOptions()
