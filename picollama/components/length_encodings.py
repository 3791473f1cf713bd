"""The trained length encodings past YaRN: p-RoPE, Scalable-Softmax (SSMax) and the Forgetting
Transformer's attention (FoX). registry.py puts them in model.py's tables."""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import Attention, KVCache, ModelArgs, Positions, RoPE
from picollama.components.windowed_rope import blockwise, grouped_scores, softmax_attention


class PRoPE(RoPE):
    """p-RoPE (Barbero et al. 2025): RoPE over all of head_dim's spectrum, but only its highest
    rope_fraction of frequencies turn; the lowest pairs pass unrotated, channels free of position
    (rope_fraction < 1 with position = "rope" instead squeezes the whole spectrum into fewer
    pairs)."""

    @staticmethod
    def spectrum_dims(args: ModelArgs) -> int:
        return args.head_dim


class SSMax(nn.Module):
    """Scalable-Softmax (Nakanishi 2025): the query that sees n keys scaled by s·log n, s learned
    per head, so that attention does not flatten as n grows. s starts at 1/log(max_seq_len): the
    softmax is plain at the context's last token. It scales q·k; a position bias (ALiBi's,
    FoX's) is added unscaled."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        s = 1 / math.log(max(args.max_seq_len, 2))
        self.scale = nn.Parameter(torch.full((args.n_heads,), s))

    def forward(self, q, keys: int):
        """q (B, heads, T, head_dim) of the last T of `keys` keys, scaled."""
        n = torch.arange(keys - q.shape[2] + 1, keys + 1, device=q.device)
        return q * (self.scale[:, None, None] * n.log()[:, None]).to(q.dtype)


class ForgettingAttention(Attention):
    """The Forgetting Transformer's attention (FoX, Lin et al. 2025; position = "fox", no RoPE):
    per head a forget gate f_t = σ(wf·x_t + b), and query i's score on key j gains log f_{j+1} +
    ... + log f_i = c_i - c_j, c the running sum of log f: keys fade as gates below 1 pile up,
    the same way at any length."""

    def __init__(self, args: ModelArgs, rotary: bool = False):
        super().__init__(args, rotary)
        self.wf = nn.Linear(args.dim, args.n_heads, bias=True)
        self.c = None  # the forget gates' running sum of log f of the forward's keys

    def new_cache(self, cache: type, shape: tuple, dtype, device) -> KVCache:
        if cache is not KVCache or dtype == torch.int8:
            raise ValueError("FoX's KV cache is not quantized: use a float dtype")
        return ForgetCache(shape, dtype, device, self.n_heads)

    def forward(self, x, rotations, start_pos: int | None, attend):
        """LLaMA's attention, `attend` reading the forget gates' c of this forward's keys."""
        log_f = F.logsigmoid(self.wf(x).float()).transpose(1, 2)  # (B, heads, T)
        self.c = (
            log_f.cumsum(-1) if start_pos is None else self.cache.update_gates(start_pos, log_f)
        )
        return super().forward(x, rotations, start_pos, attend)


class ForgetCache(KVCache):
    """A KV cache that also keeps FoX's c of every key (batch, heads, max length), in float32."""

    def __init__(self, shape: tuple, dtype, device, n_heads: int):
        super().__init__(shape, dtype, device)
        c = torch.zeros(shape[0], n_heads, shape[2], device=device)
        self.register_buffer("c", c, persistent=False)

    def update_gates(self, input_pos: int, log_f: torch.Tensor) -> torch.Tensor:
        """Write c of log forget gates log_f (B, heads, T) at input_pos.., going on from the cached
        c, and return c of every key so far."""
        batch, end = log_f.shape[0], input_pos + log_f.shape[2]
        before = self.c[:batch, :, input_pos - 1, None] if input_pos else 0.0
        self.c[:batch, :, input_pos:end] = before + log_f.cumsum(-1)
        return self.c[:batch, :, :end]


class ForgetPositions(Positions):
    """FoX's positions: none but the forget gates, by which its attention attends."""

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        return None, self.attention(args, positions, forget_gate_attention)


def forget_gate_attention(q, k, v, attention: ForgettingAttention) -> torch.Tensor:
    """FoX's attention: scores q·k/√head_dim + c_i - c_j over the causal keys, c (B, heads, S) of
    every key (the T queries are the last T keys), a block of queries at a time."""
    block = partial(forget_gate_block, k=k, v=v, c=attention.c, offset=k.shape[2] - q.shape[2])
    return blockwise(block, q, k.shape[2])


def forget_gate_block(q, first: int, k, v, c, offset: int):
    at = torch.arange(first, first + q.shape[2], device=q.device) + offset  # as keys
    c = c.unflatten(1, (k.shape[1], -1))  # grouped as the scores
    bias = c[..., at, None] - c[..., None, :]
    allowed = torch.arange(k.shape[2], device=q.device) <= at[:, None]
    return softmax_attention(grouped_scores(q, k) + bias, allowed, v)


def as_made(p: torch.Tensor):
    """An init that keeps the parameter as its module made it."""
