"""Two training-free length methods (issue 71): Dual Chunk Attention (dca) and ReAttention
(reattention), each against its paper's position indices computed here pair by pair, plain RoPE
within its scope, and against itself (cached decode, chunked prefill, blocks of queries)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from test_variants import TINY, make_model  # a tiny model, sharp weights

from model import POSITIONS, ModelArgs, Transformer, apply_rotary, rope_rotations
from picollama.components import dca, reattention, windowed_rope
from picollama.components.dca import DualChunk
from picollama.components.length import stretched
from picollama.components.reattention import ReAttention
from picollama.config.model_args import checked_model_args
from picollama.convert import hf as hf_format

pytestmark = pytest.mark.usefixtures("one_thread")

ROTARY = SimpleNamespace(rotary=True)  # an attention module that rotates
CONTEXT = 16
METHODS = {
    "dca": dict(rope_scaling="dca", rope_factor=4.0, max_seq_len=CONTEXT),
    "reattention": dict(
        rope_scaling="reattention", rope_factor=4.0, max_seq_len=CONTEXT, rope_far_keys=3
    ),
}


def same_weights(model: Transformer, **overrides) -> Transformer:
    other = Transformer(dataclasses.replace(model.args, **overrides)).eval()
    other.load_state_dict(model.state_dict())
    return other


def turned(x: torch.Tensor, position: int, table: torch.Tensor) -> torch.Tensor:
    """x (heads, head_dim) turned by RoPE to `position`."""
    return apply_rotary(x[None], table[position][None])[0]


# ---------------------------------------------------------------- the papers' position indices


def dca_indices(i: int, j: int, s: int, w: int) -> tuple[int, int]:
    """(query's, key's) position index of query i over key j <= i, by ChunkLlama's rule (its
    chunkllama_attn_replace.py): chunks of s = chunk_size - local_window from position 0, the key
    at j mod s, the query at i mod s in its own chunk, min(s + i mod s, s + w) over the chunk
    before it, s + w over earlier ones."""
    if i // s == j // s:
        return i % s, j % s
    if i // s == j // s + 1:
        return min(s + i % s, s + w), j % s
    return s + w, j % s


def reattention_indices(positions, i, q, k, g, w, far_keys) -> dict:
    """{key index: (query's, key's) position index} over the keys query i keeps (ReAttention):
    global (position < g), local (distance < w), and of the middle keys its far_keys best by
    q·k/√d without RoPE (to 1/TIE of a logit, ties to the later key, as the module says). The
    kept in order take positions 0, 1, ..., the query the last."""
    p = positions
    local = [j for j in range(i + 1) if p[i] - p[j] < w]
    first = [j for j in range(i + 1) if p[j] < g and p[i] - p[j] >= w]
    middle = [j for j in range(i + 1) if p[j] >= g and p[i] - p[j] >= w]
    score = {j: float(q.double() @ k[j].double()) / math.sqrt(len(q)) for j in middle}

    def rank(j):
        return math.floor(score[j] * reattention.TIE), j

    best = sorted(middle, key=rank, reverse=True)
    kept = sorted(first + best[:far_keys] + local)
    return {j: (len(kept) - 1, r) for r, j in enumerate(kept)}


def literal_attention(q, k, v, positions, indices) -> torch.Tensor:
    """Softmax attention (heads, T, head_dim) over the pairs `indices(h, i)` gives, each
    (query, key) pair's score RoPE's at the position indices it names."""
    heads, length, dim = q.shape
    group = heads // k.shape[0]
    table = rope_rotations(ModelArgs(dim=heads * dim, n_heads=heads), 0, 4 * length, "cpu")
    scores = torch.full((heads, length, length), -math.inf)
    for h in range(heads):
        for i in range(length):
            for j, (at_q, at_k) in indices(h, i).items():
                a = turned(q[h : h + 1, i], at_q, table)
                b = turned(k[h // group, j][None], at_k, table)
                scores[h, i, j] = (a * b).sum() / math.sqrt(dim)
    return scores.softmax(-1) @ v.repeat_interleave(group, 0)


def attention_inputs(positions: torch.Tensor, seed=0):
    """Random q (4 heads), k, v (2 kv heads) of 8 dims over len(positions) tokens, and q, k
    turned to their positions, as the model hands them to attention."""
    torch.manual_seed(seed)
    length = len(positions)
    q, k, v = torch.randn(4, length, 8), torch.randn(2, length, 8), torch.randn(2, length, 8)
    table = rope_rotations(ModelArgs(dim=32, n_heads=4), 0, int(positions.max()) + 1, "cpu")
    rotations = table[positions]
    turn = [apply_rotary(x.transpose(0, 1), rotations).transpose(0, 1) for x in (q, k)]
    return (q, k, v), turn


def the_method(cls, args, positions, q, k, v, rows: int) -> torch.Tensor:
    """The method's attention over one row of positions (CPU flash branches) or a row per
    sequence (the score matrix)."""
    given = positions if rows == 1 else positions[None]
    return cls(args, given, given).attend(q[None], k[None], v[None], ROTARY)[0]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("offset", [0, 7])
@pytest.mark.parametrize("rows", [1, 2])
def test_dca_is_rope_at_chunkllamas_indices(window, offset, rows):
    # context 16: local window 16/16 = 1 (or 3), chunks of 12 - w. 64 tokens span 6 or more
    args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=CONTEXT, rope_window=window)
    args = dataclasses.replace(args, rope_scaling="dca", rope_factor=4.0)
    s, w = 3 * CONTEXT // 4 - (window or 1), window or 1
    assert dca.chunk_sizes(args) == (s, w)
    positions = torch.arange(offset, offset + 64)
    (q, k, v), (turned_q, turned_k) = attention_inputs(positions)
    p = positions.tolist()

    def indices(h, i):
        return {j: dca_indices(p[i], p[j], s, w) for j in range(i + 1)}

    expected = literal_attention(q, k, v, p, indices)
    got = the_method(DualChunk, args, positions, turned_q, turned_k, v, rows)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("context, window", [(16, 0), (32, 0), (32, 5)])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("rows", [1, 2])
def test_reattention_is_rope_at_the_reassigned_positions(context, window, offset, rows):
    # context 16: 1 global key, a window of 8. 32: 2 global keys, 16 (or 5). 3 middle keys each
    args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=context, rope_window=window)
    args = dataclasses.replace(args, rope_scaling="reattention", rope_factor=4.0, rope_far_keys=3)
    g, w = context // 16, window or context // 2
    assert reattention.scope(args) == (g, w, 3)
    positions = torch.arange(offset, offset + 64)
    (q, k, v), (turned_q, turned_k) = attention_inputs(positions)
    p = positions.tolist()

    def indices(h, i):
        return reattention_indices(p, i, q[h, i], k[h // 2], g, w, 3)

    expected = literal_attention(q, k, v, p, indices)
    got = the_method(ReAttention, args, positions, turned_q, turned_k, v, rows)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_reattention_breaks_a_tie_toward_the_later_key():
    # context 16: global key 0, a window of 4, 1 middle key. Keys 0..9 are one vector, so
    # query 13's middle keys 1..9 tie: it keeps the latest, 9, whose value alone is e0
    args = ModelArgs(dim=8, n_heads=1, max_seq_len=16, rope_scaling="reattention", rope_factor=2)
    args = dataclasses.replace(args, rope_window=4, rope_far_keys=1)
    torch.manual_seed(0)
    q, k, v = torch.randn(14, 1, 8), torch.randn(14, 1, 8), torch.zeros(1, 1, 14, 8)
    k[:10] = k[0]
    v[0, 0, 9, 0], v[0, 0, 1:9, 1] = 1.0, 1.0
    positions = torch.arange(14)
    table = rope_rotations(args, 0, 14, "cpu")
    turn_q, turn_k = (apply_rotary(x, table).transpose(0, 1)[None] for x in (q, k))
    out = ReAttention(args, positions, positions).attend(turn_q, turn_k, v, ROTARY)[0, 0, -1]
    assert out[0] > 0.01 and out[1] == 0


# ---------------------------------------------------------------- plain RoPE within the scope


@pytest.mark.parametrize("method, plain_length", [("dca", 25), ("reattention", 21)])
def test_within_the_scope_each_is_plain_rope(method, plain_length):
    # context 32. dca: chunks of s = 24 - 2, w = 2: the next chunk's first w + 1 queries see the
    # one before at its distance, so 3/4 of 32, + 1, tokens. reattention: 2 + 3 + 16 = 21
    plain = make_model(max_seq_len=32)
    tokens = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        at_one = same_weights(plain, **{**METHODS[method], "max_seq_len": 32, "rope_factor": 1.0})
        torch.testing.assert_close(at_one(tokens), plain(tokens), atol=1e-5, rtol=0)
        on = same_weights(plain, **{**METHODS[method], "max_seq_len": 32})
        within = tokens[:, :plain_length]
        torch.testing.assert_close(on(within), plain(within), atol=1e-5, rtol=0)
        past = tokens[:, : plain_length + 1]
        assert not torch.allclose(on(past)[:, -1], plain(past)[:, -1], atol=1e-3)


def test_dca_with_logn_is_dca_of_queries_scaled_by_log_n():
    # one combination, no code of its own: log-n attention (Qwen's) wraps DCA's attention as it
    # wraps any, each query at 1-based position n times max(1, log n / log context)
    args = ModelArgs(**{**TINY, **METHODS["dca"], "logn_attention": True})
    positions = torch.arange(64)
    _, (q, k) = attention_inputs(positions)
    v = torch.randn(1, 2, 64, 8)
    attend = POSITIONS["rope"](args)(args, positions, positions, None, None)[1]
    scale = torch.tensor([max(1.0, math.log(n) / math.log(CONTEXT)) for n in range(1, 65)])
    expected = DualChunk(args, positions, positions).attend(
        q[None] * scale[:, None], k[None], v, ROTARY
    )
    torch.testing.assert_close(attend(q[None], k[None], v, ROTARY), expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- each against itself


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("extra", [{}, {"nope_every": 2}, {"logn_attention": True}])
def test_cached_decode_equals_full_forward(method, extra):
    model = make_model(**METHODS[method], **extra)
    tokens = torch.randint(0, 50, (2, 64))
    model.setup_cache(2, 64)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :5], start_pos=0)]
        steps += [model(tokens[:, p : p + 1], start_pos=p) for p in range(5, 64)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", list(METHODS))
def test_chunked_prefill_equals_one_shot(method):
    model = make_model(**METHODS[method])
    tokens = torch.randint(0, 50, (2, 64))
    model.setup_cache(2, 64)
    with torch.no_grad():
        full = model(tokens)
        chunks = [(0, 7), (7, 30), (30, 64)]  # chunks cut across DCA's chunks of 11
        steps = [model(tokens[:, a:b], start_pos=a) for a, b in chunks]
        # and positions given per sequence take the score-matrix path to the same logits
        rows = model(tokens, positions=torch.arange(64).expand(2, -1))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    torch.testing.assert_close(rows, full, atol=1e-4, rtol=0)


def spying(function, blocks: list):
    """function(q, k, ...), recording the size of each call's score matrix in blocks."""

    def spy(*args):
        q, k = args[-4:-2]
        blocks.append(q.shape[2] * k.shape[2])
        return function(*args)

    return spy


@pytest.mark.parametrize("method", list(METHODS))
def test_blocks_of_queries_equal_one_block_in_bounded_memory(method, monkeypatch):
    model = make_model(**METHODS[method])
    tokens = torch.randint(0, 50, (1, 150))
    with torch.no_grad():
        whole = model(tokens)
        blocks = []
        for module in (dca, reattention):
            monkeypatch.setattr(module, "branch", spying(module.branch, blocks))
        middle = ReAttention.middle
        monkeypatch.setattr(ReAttention, "middle", spying(middle, blocks))
        monkeypatch.setattr(windowed_rope, "ATTENTION_BLOCK", 1000)  # 6 queries over 150 keys
        torch.testing.assert_close(model(tokens), whole, atol=1e-5, rtol=0)
    assert max(blocks) <= 1000 and len(blocks) >= 2 * 25


# ---------------------------------------------------------------- the length policy, export


@pytest.mark.parametrize("method", list(METHODS))
def test_stretched_turns_it_on_past_the_context(method):
    args = ModelArgs(**{**TINY, "max_seq_len": CONTEXT})
    assert stretched(args, method, CONTEXT).rope_factor == 1.0
    assert stretched(args, method, 64).rope_factor == 4.0
    with pytest.raises(ValueError, match=f"no model.rope_scaling = '{method}'"):
        hf_format.hf_config(checked_model_args(**TINY, rope_scaling=method, rope_factor=2.0))
