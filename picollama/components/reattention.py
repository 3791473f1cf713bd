"""ReAttention (rope_scaling reattention; Liu et al., "ReAttention: Training-Free Infinite Context
with Finite Attention Scope", ICLR 2025), training-free: a position-agnostic top-k over the far
keys first, then ordinary RoPE attention over the keys kept, their positions re-assigned
consecutively inside the trained context. registry.py puts reattention_attention in model.py's
ROPE_ATTENTIONS. The branches' merge is attention_branches.py's. This module does not scale
RoPE's frequencies (ROPE_INIT gives reattention plain RoPE).

Each query i keeps, as the paper's KV cache is cut (OpenMOSS/ReAttention, cache_utils_v0921.py):
- the global keys, the first g = 32 positions (its global_size, at most c/16 for a context c
  under 512),
- the local keys, its w nearest (0 <= i - j < w, w = c/2: its local_size, or rope_window),
- of the middle keys between them, the k = rope_far_keys whose scores q·k WITHOUT RoPE are its
  best (its "qk" recall, on keys and queries before they turn).
The kept keys, in their order, then take consecutive positions ending at the query's, and the
query attends them with RoPE as trained: a local key at its own distance i - j, the m-th last
middle key kept at w + m - 1, a global key at i - j less the middle keys dropped. No distance
passes g + k + w - 1, however long the sequence. A sequence within g + k + w is plain RoPE.
The reference code recalls a span of 32 keys around each hit and shares one set of them among a
chunk's queries and heads, for speed. Here each query and head keeps its own k keys.

Beside rerope_topk (windowed_rope.py), the nearest method here: both keep exact RoPE over a
window and a query's best few far keys. rerope_topk picks them by their RoPE score at the one
distance w where it puts them all, a window of 3c/4, no global keys. ReAttention picks them by
the score without positions and spreads them at w, w + 1, ... in their order, a window of c/2,
and keeps the first 32 keys besides (the attention sinks)."""

import math
from functools import partial

import torch
from torch import linalg

from model import ModelArgs
from picollama.components.attention_branches import (
    branch,
    causal,
    inverse_frequencies,
    key_span,
    merged,
    pairs,
    turns,
)
from picollama.components.windowed_rope import blockwise, turn

GLOBAL_KEYS = 32  # the paper's global_size: the first keys every query keeps
TIE = 1024  # middle keys whose scores (logits) agree to 1/TIE tie: the later one is kept


def scope(args: ModelArgs) -> tuple[int, int, int]:
    """(g, w, k): the global keys, the local window and the middle keys each query keeps."""
    return (
        min(GLOBAL_KEYS, args.original_seq_len // 16),
        args.rope_window or args.original_seq_len // 2,
        args.rope_far_keys,
    )


def ranked(scores: torch.Tensor, allowed) -> torch.Tensor:
    """The order of the allowed scores (float32 logits, overwritten) as int64: by their value to
    1/TIE, ties to the later key. Keys of one token score alike up to rounding, which would
    decide between them, and otherwise in a cached decode than in one forward."""
    value = scores.clamp_(-(1 << 20), 1 << 20).mul_(TIE).floor_().long()
    value.masked_fill_(~allowed, -(1 << 31))  # below any allowed score's value
    return value.mul_(1 << 32).add_(torch.arange(scores.shape[-1], device=scores.device))


def grid(positions, key_positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, key) grid (as pairs gives it) of distances, and of the keys' own positions."""
    return pairs(positions, key_positions), pairs(torch.zeros_like(positions), -key_positions)


class ReAttention:
    """ReAttention over the queries at `positions` ((T,) or (B, T)) and the keys at
    `key_positions`, which arrive turned to their own positions, as the KV cache holds them.
    Turned back to position 0 they give the position-agnostic scores. Rotations compose, so the
    global keys' branch turns only the queries."""

    def __init__(self, args: ModelArgs, positions, key_positions):
        self.globals, self.window, self.far_keys = scope(args)
        self.positions, self.key_positions = positions, key_positions
        self.inv_freq = inverse_frequencies(args, positions.device)
        self.q_back = turns(self.inv_freq, -positions)
        self.k_back = turns(self.inv_freq, -key_positions)

    def attend(self, q, k, v, attention):
        """Attention of queries (B, heads, T, head_dim) over keys and values (B, kv heads, S,
        head_dim), all turned as usual. A layer that does not rotate attends plain causal."""
        raw_k = turn(k.float(), self.k_back) if attention.rotary else None
        return blockwise(partial(self.block, k=k, raw_k=raw_k, v=v), q, k.shape[2])

    def block(self, q, first: int, k, raw_k, v):
        """The attention of the queries first.. (q), merged from the three branches, each over
        the span of keys it may see."""
        rows = slice(first, first + q.shape[2])
        positions, keys = self.positions[..., rows], self.key_positions
        g, w = self.globals, self.window
        if raw_k is None:
            return causal(q, k, v, positions, keys)
        low, high = int(positions.min()), int(positions.max())
        local, far, first_keys = (
            key_span(keys, low - w + 1, high + 1),
            key_span(keys, g, high - w + 1),
            key_span(keys, 0, g),
        )
        distance, _ = grid(positions, keys[..., local])
        parts = [branch(q, k[:, :, local], v[:, :, local], (distance >= 0) & (distance < w))]
        distance, at_key = grid(positions, keys[..., far])
        middle = (distance >= w) & (at_key >= g)
        if far.stop > far.start:
            raw_q = turn(q.float(), self.q_back[..., rows, :])
            parts.append(self.middle(raw_q, raw_k[:, :, far], v[:, :, far], middle))
        if first_keys.stop > first_keys.start:
            # a global key sits as far again as the middle keys the query dropped
            dropped = (middle.sum(-1) - self.far_keys).clamp(min=0).reshape(positions.shape)
            turned = turn(q, turns(self.inv_freq, -dropped))
            distance, at_key = grid(positions, keys[..., first_keys])
            allowed = (distance >= w) & (at_key < g)
            parts.append(branch(turned, k[:, :, first_keys], v[:, :, first_keys], allowed))
        return merged(parts).type_as(q)

    def middle(self, raw_q, raw_k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        """The middle keys' branch: each query's k best allowed keys by the scores of the
        queries and keys turned back to position 0 (float32: raw_q (B, heads, rows, head_dim),
        raw_k), as ranked() orders them, then weighed at w, w + 1, ... from the last kept back,
        from the kept keys and values alone, gathered."""
        count, dim = min(self.far_keys, raw_k.shape[2]), raw_q.shape[-1]
        raw_q = raw_q.unflatten(1, (raw_k.shape[1], -1)) / math.sqrt(dim)  # (B, kv, group, ...)
        index = ranked(raw_q @ raw_k[:, :, None].mT, allowed).topk(count).indices
        index = index.masked_fill(
            ~allowed.expand(index.shape[:-1] + allowed.shape[-1:]).gather(-1, index), -1
        )
        index = index.sort(-1).values  # in the keys' order, the slots kept for none first
        kept_k, kept_v = (rows_at(x, index.clamp(min=0)) for x in (raw_k, v))
        distances = self.window + torch.arange(count - 1, -1, -1, device=index.device)
        best = rope_scores(raw_q, kept_k, turns(self.inv_freq, distances))
        best = best.masked_fill(index < 0, -math.inf)
        lse = best.logsumexp(-1)
        weights = (best - lse.nan_to_num(neginf=0)[..., None]).exp().type_as(v)
        out = (weights[..., None, :] @ kept_v).squeeze(-2).float()
        return out.flatten(1, 2), lse.flatten(1, 2)


def rope_scores(q, kept, spins) -> torch.Tensor:
    """q·k with q (..., rows, head_dim) turned by spins[s] (complex (count, pairs)) for the s-th
    of its kept keys (..., rows, count, head_dim). Past the pairs that turn: a plain product."""
    n = 2 * spins.shape[-1]
    turned = torch.view_as_real(complex_pairs(q[..., :n])[..., None, :] * spins).flatten(-2)
    return linalg.vecdot(turned, kept[..., :n]) + linalg.vecdot(q[..., None, n:], kept[..., n:])


def rows_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of x (B, kv heads, S, d) at index (B, kv heads, ...): (B, kv heads, ..., d)."""
    batch = torch.arange(x.shape[0], device=x.device)[:, None, None]
    heads = torch.arange(x.shape[1], device=x.device)[None, :, None]
    return x[batch, heads, index.flatten(2)].unflatten(2, index.shape[2:])


def complex_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())


def reattention_attention(args: ModelArgs, positions, key_positions):
    """The attention function of a forward past the context (model.ROPE_ATTENTIONS)."""
    return ReAttention(args, positions, key_positions).attend


reattention_attention.stretch_only = True  # rope_factor turns it on, maps no distance (length.py)
