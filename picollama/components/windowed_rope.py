"""The training-free length methods that attend in two branches (rope_scaling rerope,
self_extend, rerope_topk): exact RoPE near, a mapped distance far. registry.py puts
windowed_attention in model.py's ROPE_ATTENTIONS for each."""

import math
from functools import partial

import torch

from model import ModelArgs, apply_rotary, rope_frequencies
from picollama.components.length import near_window

ATTENTION_BLOCK = 1 << 22  # the most scores held at once per sequence and head (16 MiB in fp32)


def blockwise(attend, q: torch.Tensor, keys: int) -> torch.Tensor:
    """attend(queries, first) over blocks of q's queries (B, heads, T, head_dim), concatenated: at
    most ATTENTION_BLOCK scores per sequence and head at a time, never T×S at long lengths."""
    step = max(1, ATTENTION_BLOCK // keys)
    return torch.cat([attend(q[:, :, i : i + step], i) for i in range(0, q.shape[2], step)], 2)


def grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q·k/√head_dim in float32 (B, kv heads, group, T, S) of queries (B, heads, T, head_dim) in
    the groups that share keys (B, kv heads, S, head_dim), as SDPA's GQA pairs them."""
    q = q.unflatten(1, (k.shape[1], -1))
    return (q @ k[:, :, None].mT).float() / math.sqrt(q.shape[-1])


# SDPA's CPU flash kernel, called directly for the log-sum-exp it returns beside the output
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def folded(q: torch.Tensor, kv_heads: int, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, heads, T, head_dim) as (B, kv heads, group·T, head_dim), the query heads that
    share a kv head one after another, and the mask (T, S) repeated to match. So attention runs
    over the keys as the cache holds them, never repeated per head (the flash kernel takes no
    GQA). Repeating them took 0.64 s of a 0.92 s ReRoPE decoding step of SmolLM2 at 16k."""
    group = q.shape[1] // kv_heads
    return q.unflatten(1, (kv_heads, group)).flatten(2, 3), allowed.repeat(group, 1)


def unfolded(x: torch.Tensor, heads: int) -> torch.Tensor:
    """folded's inverse on its result (B, kv heads, group·T[, head_dim]): (B, heads, T[, ...])."""
    return x.unflatten(2, (heads // x.shape[1], -1)).flatten(1, 2)


def flash_branch(q, k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, heads, T, head_dim) over the keys and values (B, kv heads, S, head_dim) that
    `allowed` (T, S) lets each see, by the CPU flash kernel: the output (float32) and log-sum-exp
    (B, heads, T), 0 and -inf where a query sees no key (the kernel says 0 for both)."""
    folded_q, folded_allowed = folded(q, k.shape[1], allowed)
    bias = torch.zeros(folded_allowed.shape, dtype=q.dtype).masked_fill(~folded_allowed, -math.inf)
    out, lse = flash_attention_cpu(folded_q, k, v, attn_mask=bias)[:2]
    out, lse = unfolded(out, q.shape[1]), unfolded(lse, q.shape[1])
    seen = allowed.any(-1)
    return out.float().masked_fill(~seen[:, None], 0), lse.masked_fill(~seen, -math.inf)


def softmax_attention(scores, allowed, v: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed keys of grouped scores, times the values (B, kv heads, S,
    head_dim): (B, heads, T, head_dim)."""
    weights = scores.masked_fill(~allowed, -math.inf).softmax(-1).type_as(v)
    return (weights @ v[:, :, None]).flatten(1, 2)


def turn(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated by rotations ([B,] T, pairs), as apply_rotary does."""
    return apply_rotary(x.transpose(1, 2), rotations).transpose(1, 2)


def keep_best(scores: torch.Tensor, allowed, count: int) -> torch.Tensor:
    """scores with all but each query's `count` best allowed ones at -inf: `count` exactly, not
    every one tied with the last (far keys of one token, all turned to one position, tie up to
    rounding, which would then decide how many are kept)."""
    scores = scores.masked_fill(~allowed, -math.inf)
    best = scores.topk(min(count, scores.shape[-1]), -1).indices
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
    return scores.masked_fill(~kept, -math.inf)


class WindowedRoPE:
    """rope_scaling rerope, self_extend and rerope_topk, training-free: keys nearer than the window
    w keep exact RoPE; a farther key j of query i scores at a distance mapped into the trained
    range, by turning the query to far(i) and the key to far(j) (rotations compose, so the KV
    cache keeps the usual keys and decoding is exact).
    Leaky ReRoPE (Su 2023), k = rope_factor: w + (d - w)/k, the query at i/k + w - w/k, the key at
    j/k; k = inf is plain ReRoPE, every far key at distance w.
    Self-Extend (Jin et al. 2024), G = round(rope_factor): ⌊i/G⌋ - ⌊j/G⌋ + w - ⌊w/G⌋, the query
    at ⌊i/G⌋ + w - ⌊w/G⌋, the key at ⌊j/G⌋.
    rerope_topk: plain ReRoPE (every far key at distance w, 3/4 of the context by default), each
    query attending only its rope_far_keys best-scoring far keys: a far key that matches well is
    found (a passkey, a copy) while the rest, which a model trained at the context never had to
    ignore, take no attention from the near window (InfLLM, Xiao et al. 2024, selects far blocks
    so and puts them at one distance too)."""

    def __init__(self, args: ModelArgs, positions, key_positions):
        self.window, self.positions, self.key_positions = (
            near_window(args),
            positions,
            key_positions,
        )
        self.far_keys = args.rope_far_keys if args.rope_scaling == "rerope_topk" else 0
        inv_freq = rope_frequencies(args, args.max_seq_len)[0].double().to(positions.device)
        self.q_turn = self.far_turns(args, positions, inv_freq, query=True)
        self.k_turn = self.far_turns(args, key_positions, inv_freq, query=False)

    def far_turns(self, args: ModelArgs, positions, inv_freq, query: bool) -> torch.Tensor:
        """The rotations taking `positions` ([B,] T) to the far branch's, complex64."""
        w, p = self.window, positions.double()
        if args.rope_scaling == "rerope":
            far = p / args.rope_factor + (w - w / args.rope_factor) * query
        elif args.rope_scaling == "rerope_topk":
            far = torch.full_like(p, w * query)
        else:
            group = round(args.rope_factor)
            far = p // group + (w - w // group) * query
        angles = (far - p)[..., None] * inv_freq
        return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def attend(self, q, k, v, attention):
        """Attention of queries (B, heads, T, head_dim) over keys and values (B, kv heads, S,
        head_dim), both rotated as usual (where `attention` does not rotate: plain causal)."""
        rotary = attention.rotary
        far_k = turn(k, self.k_turn) if rotary else None
        if q.device.type == "cpu" and self.positions.dim() == 1 and rotary:
            return blockwise(partial(self.flash_block, k=k, far_k=far_k, v=v), q, k.shape[2])
        return blockwise(partial(self.block, k=k, far_k=far_k, v=v), q, k.shape[2])

    def flash_block(self, q, first: int, k, far_k, v):
        """block's attention by CPU flash attention, the kernel SDPA calls, once a branch over
        the keys it sees, merged by the branches' log-sum-exps (SDPA does not return them):
        about the cost of one causal attention, not of two full score matrices."""
        rows = slice(first, first + q.shape[2])
        positions, keys = self.positions[rows], self.key_positions  # increasing
        stop = int(torch.searchsorted(keys, positions[-1], right=True))
        near = int(torch.searchsorted(keys, positions[0] - self.window, right=True))
        far = int(torch.searchsorted(keys, positions[-1] - self.window, right=True))
        distance = positions[:, None] - keys[:stop]
        branches = [(q, k, slice(near, stop), (distance >= 0) & (distance < self.window))]
        if far > 0:
            far_q = turn(q, self.q_turn[rows])
            branches.append((far_q, far_k, slice(0, far), distance >= self.window))
        outs, lses = zip(
            *[
                self.branch(query, key[:, :, span], v[:, :, span], allowed[:, span], key is far_k)
                for query, key, span, allowed in branches
            ]
        )
        lse = torch.stack(lses).logsumexp(0)
        return sum(out * (part - lse).exp()[..., None] for out, part in zip(outs, lses)).type_as(q)

    def branch(self, q, k, v, allowed, far: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One branch's output (float32) and log-sum-exp: the flash kernel's, or for
        rerope_topk's far keys, of the few each query keeps (far_branch)."""
        if not (far and self.far_keys):
            return flash_branch(q, k, v, allowed)
        folded_q, folded_allowed = folded(q, k.shape[1], allowed)
        out, lse = self.far_branch(folded_q, k, v, folded_allowed)
        return unfolded(out, q.shape[1]), unfolded(lse, q.shape[1])

    def far_branch(self, q, k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's far_keys best-scoring allowed keys, chosen on scores in q's dtype (one
        matmul, no float copy of them all), then weighted in float32 from the kept keys and values
        alone, gathered. q has k's heads (folded)."""
        scale = 1 / math.sqrt(q.shape[-1])
        scores = (q * scale) @ k.mT
        top, index = scores.masked_fill_(~allowed, -math.inf).topk(min(self.far_keys, k.shape[2]))
        rows = index.flatten(2)[..., None].expand(-1, -1, -1, q.shape[-1])
        kept_k, kept_v = (x.gather(2, rows).float().unflatten(2, index.shape[2:]) for x in (k, v))
        best = (q.float()[..., None, :] * kept_k).sum(-1) * scale
        best = best.masked_fill(top.isneginf(), -math.inf)  # no key allowed: none kept
        lse = best.logsumexp(-1)
        weights = (best - lse.nan_to_num(neginf=0)[..., None]).exp()
        return (weights[..., None] * kept_v).sum(-2), lse

    def block(self, q, first: int, k, far_k, v):
        rows = slice(first, first + q.shape[2])
        distance = self.positions[..., rows, None] - self.key_positions[..., None, :]
        if distance.dim() == 3:  # positions per sequence
            distance = distance[:, None, None]
        scores = grouped_scores(q, k)
        if far_k is not None:
            far = grouped_scores(turn(q, self.q_turn[..., rows, :]), far_k)
            if self.far_keys:
                far = keep_best(far, distance >= self.window, self.far_keys)
            scores = torch.where(distance < self.window, scores, far)
        return softmax_attention(scores, distance >= 0, v)


def windowed_attention(args: ModelArgs, positions, key_positions):
    """The attention function of a forward past the context (model.ROPE_ATTENTIONS)."""
    return WindowedRoPE(args, positions, key_positions).attend
