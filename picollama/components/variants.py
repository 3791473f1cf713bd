"""The alternatives the seed lectures teach: LayerNorm, ungated FFNs, post-norm, sandwich and
parallel blocks, ALiBi, sinusoidal, learned and no positions, log-n. registry.py puts them in
model.py's tables."""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import (
    OUTPUT_GATES,
    QUERY_SCALES,
    ROPE_ATTENTIONS,
    ModelArgs,
    Positions,
    TransformerBlock,
    make_norm,
    sdpa_attention,
)

# The ModelArgs keys that leave LLaMA's architecture when away from their defaults. The keys of
# QUERY_SCALES and OUTPUT_GATES are switches too. switches() reads them from their tables.
ARCHITECTURE_KEYS = (
    "norm norm_placement parallel_block activation qk_norm logit_softcap position rope_fraction"
    " nope_every logn_attention"
).split()


def switches() -> list[str]:
    """Every ModelArgs key that leaves LLaMA's architecture when away from its default. It reads
    the tables, so a new query scale or output gate needs no edit here."""
    return [*ARCHITECTURE_KEYS, *QUERY_SCALES, *OUTPUT_GATES]


def non_llama(args: ModelArgs) -> list[str]:
    """The switches away from LLaMA's, and rope_scaling where it attends in two branches
    (ROPE_ATTENTIONS): what HF's Llama and llama.cpp cannot run."""
    away = [key for key in switches() if getattr(args, key) != getattr(ModelArgs, key)]
    return away + ["rope_scaling"] * (args.rope_scaling in ROPE_ATTENTIONS)


def given_up(args: ModelArgs) -> str | None:
    """One line saying what a model off LLaMA's format gives up, or None for LLaMA.

    Training says it at the start, so the user learns it before the run, not at export."""
    away = non_llama(args)
    if not away:
        return None
    keys = ", ".join(f"model.{key}" for key in away)
    return (
        f"note: {keys} leaves LLaMA's format: this run exports to neither Hugging Face (to-hf) "
        "nor GGUF (to-gguf), and it samples through the model's forward, not the fused step"
    )


class MLP(nn.Module):
    """w2(act(w1 x)): the FFN of the original Transformer (ReLU), GPT-2 (GELU), Nemotron-4
    (squared ReLU)."""

    gated = False

    def __init__(self, dim: int, hidden_dim: int, act):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


def relu2(x):
    """Squared ReLU (Nemotron-4's activation)."""
    return F.relu(x).square()


class PostNormBlock(TransformerBlock):
    """The original Transformer's: LN(x + f(x)), a norm after each residual add."""

    final_norm = False  # the blocks' output is normed already

    def forward(self, x, *where):
        h = self.attention_norm(x + self.attention(x, *where))
        return self.ffn_norm(h + self.feed_forward(h))


class SandwichBlock(TransformerBlock):
    """Gemma 2's: a norm before and after each sublayer."""

    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__(args, rotary)
        self.post_attention_norm = make_norm(args)
        self.post_ffn_norm = make_norm(args)

    def forward(self, x, *where):
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), *where))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class ParallelBlock(TransformerBlock):
    """GPT-J's and PaLM's: attention and FFN read the same normed input, and add together."""

    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__(args, rotary)
        self.ffn_norm = None  # the FFN reads the attention's input

    def both(self, x, *where):
        return self.attention(x, *where) + self.feed_forward(x)

    def forward(self, x, *where):
        return x + self.both(self.attention_norm(x), *where)


class ParallelPostNormBlock(ParallelBlock):
    final_norm = False

    def forward(self, x, *where):
        return self.attention_norm(x + self.both(x, *where))


class ParallelSandwichBlock(ParallelBlock):
    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__(args, rotary)
        self.post_attention_norm = make_norm(args)

    def forward(self, x, *where):
        return x + self.post_attention_norm(self.both(self.attention_norm(x), *where))


def logn_scale(args: ModelArgs, positions: torch.Tensor) -> torch.Tensor:
    """Log-n attention's query scale at 1-based positions n, max(1, log n / log original_seq_len)
    (broadcast over (B, heads, T, head_dim))."""
    log_n = (positions[..., None, :, None] + 1.0).log()
    return (log_n / math.log(args.original_seq_len)).clamp(min=1)


def scaled_queries(q, k, v, attention: nn.Module, scale: torch.Tensor, attend):
    return attend(q * scale.to(q.dtype), k, v, attention)


def logn_attention(args: ModelArgs, positions, attend):
    """attend with its queries scaled by logn_scale, where log-n attention is on."""
    if not args.logn_attention:
        return attend
    return partial(scaled_queries, scale=logn_scale(args, positions), attend=attend)


class ALiBi(Positions):
    """Attention with linear biases: in place of the mask, a bias ([B,] heads, T, S) of
    −slope·(query position − key position), −inf for later keys. Press et al.'s slopes:
    2^(-8i/n) for heads i = 1..n; for n not a power of two p, p's, then every other one of 2p's."""

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        p = 2 ** math.floor(math.log2(args.n_heads))
        slopes = [2 ** (-8 * i / p) for i in range(1, p + 1)]
        slopes += [2 ** (-4 * i / p) for i in range(1, 2 * p, 2)]
        slopes = torch.tensor(slopes[: args.n_heads], device=positions.device)[:, None, None]
        distance = (positions[..., None, :, None] - key_positions[..., None, None, :]).float()
        bias = (-slopes * distance).masked_fill(distance < 0, -math.inf)
        return None, self.attention(args, positions, partial(sdpa_attention, mask=bias))


class Sinusoidal(Positions):
    """The original Transformer's PE(pos, 2i) = sin(pos / 10000^(2i/dim)), PE(pos, 2i+1) =
    cos(...), added to the token embeddings for any position."""

    def embed(self, h, positions):
        dim = h.shape[-1]
        exponents = torch.arange(0, dim, 2, device=positions.device) / dim
        angles = positions[..., None].float() / 10000**exponents
        pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., :dim]
        # √dim on the tokens: at their init's std 0.02 the sinusoid's amplitude 1 drowns them
        # (retrieval stuck at 16%). Measured (README, retrieval study): tokens ×√dim reach 97%
        # where the sinusoid ÷√dim stays at 26% (600 Muon steps).
        return h * math.sqrt(dim) + pe.type_as(h)


class LearnedPositions(Positions):
    """GPT-2's absolute positions: a learned table over 0..max_seq_len-1, and nothing past it."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.weight = nn.Parameter(torch.randn(args.max_seq_len, args.dim))  # nn.Embedding's

    def embed(self, h, positions):
        last = int(positions.max())
        if last >= len(self.weight):
            raise ValueError(f"position {last} is past the learned positions ({len(self.weight)})")
        return h + F.embedding(positions, self.weight).type_as(h)
