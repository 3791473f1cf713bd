"""Attention as branches over parts of the keys, merged by their log-sum-exps: the machinery that
the training-free length methods which see a key at one of several positions share (dca.py,
reattention.py). Each branch is a softmax over the keys its mask allows, its queries turned to
the positions the method gives them. This module knows no method: it does not say which keys a
branch sees, nor where they sit. windowed_rope.py keeps its own two branches."""

import math

import torch

from model import ModelArgs, rope_frequencies
from picollama.components.windowed_rope import flash_branch, grouped_scores


def inverse_frequencies(args: ModelArgs, device) -> torch.Tensor:
    """RoPE's inverse frequencies of args (their rotated pairs), float64 on `device`."""
    return rope_frequencies(args, args.max_seq_len)[0].double().to(device)


def turns(inv_freq: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The rotations (complex64, shift's shape + (pairs,)) that move a turned vector by `shift`
    positions (negative: back)."""
    angles = shift.double()[..., None] * inv_freq
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def key_span(key_positions: torch.Tensor, low, high) -> slice:
    """The keys at positions low <= p < high, for one row of increasing positions. Every key
    where positions are per sequence (B, S)."""
    if key_positions.dim() > 1:
        return slice(0, key_positions.shape[-1])
    bounds = torch.searchsorted(key_positions, torch.tensor([low, high]))
    return slice(int(bounds[0]), int(bounds[1]))


def pairs(query_positions, key_positions) -> torch.Tensor:
    """The (query, key) grid of `key_positions` beside `query_positions`: (rows, S), or
    (B, 1, 1, rows, S) for positions per sequence, as grouped scores broadcast."""
    grid = query_positions[..., :, None] - key_positions[..., None, :]
    return grid[:, None, None] if grid.dim() == 3 else grid


def branch(q, k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, heads, rows, head_dim) over the keys and values (B, kv heads, span, head_dim)
    that `allowed` lets each see: the output (float32, like q) and log-sum-exp (B, heads, rows),
    -inf where a query sees none. By the CPU flash kernel for one mask (rows, span), else by the
    score matrix."""
    if q.device.type == "cpu" and allowed.dim() == 2:
        return flash_branch(q, k, v, allowed)
    scores = grouped_scores(q, k).masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1)
    weights = (scores - lse.nan_to_num(neginf=0)[..., None]).exp()
    return (weights.type_as(v) @ v[:, :, None]).float().flatten(1, 2), lse.flatten(1, 2)


def causal(q, k, v, positions, key_positions) -> torch.Tensor:
    """Plain causal attention of the queries at `positions` (a layer that does not rotate)."""
    span = key_span(key_positions, 0, int(positions.max()) + 1)
    allowed = (pairs(positions, key_positions) >= 0)[..., span]
    return merged([branch(q, k[:, :, span], v[:, :, span], allowed)]).type_as(q)


def merged(parts: list) -> torch.Tensor:
    """The outputs of branches (output, log-sum-exp) merged into one softmax's: each weighted
    by its share of the keys' total exp-score."""
    outs, lses = zip(*parts)
    lse = torch.stack(lses).logsumexp(0)
    return sum(out * (part - lse).exp()[..., None] for out, part in zip(outs, lses))
