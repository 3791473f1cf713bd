"""The picollama decoder: RMSNorm pre-norm blocks, RoPE attention (GQA, static KV cache, SDPA), SwiGLU FFN."""

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


@dataclass
class ModelArgs:
    dim: int = 288
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    vocab_size: int = 4096
    multiple_of: int = 32  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None  # overrides Llama's sizing rule (imported checkpoints)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256  # the training context
    tie_embeddings: bool = False
    # RoPE scaling, for running past the training context; see rope_frequencies()
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_seq_len: int | None = None  # None: max_seq_len
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.vocab_size, self.max_seq_len) < 1:
            raise ValueError("dim, n_layers, n_heads, n_kv_heads, vocab_size and max_seq_len must be positive")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"the head size dim/n_heads ({self.head_dim}) must be even for RoPE")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, not {self.rope_scaling!r}")
        if self.rope_factor < 1:
            raise ValueError(f"rope_factor must be >= 1, not {self.rope_factor}")

    @property
    def original_seq_len(self) -> int:
        """The context RoPE scaling stretches from: rope_original_max_seq_len, else max_seq_len."""
        return self.rope_original_max_seq_len or self.max_seq_len

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model argument(s): {', '.join(sorted(unknown))}")
        return cls(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, round to x's dtype, then scale: Hugging Face's order, so bf16 results match theirs
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight


def rope_frequencies(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, head_dim/2) and attention scale for a sequence of seq_len tokens.

    Matches Hugging Face's RoPE functions for the same parameters. `ntk` is static NTK-aware scaling,
    base·s^(d/(d-2)); `dynamic` takes s from the current length, so its frequencies change as it grows: every
    cached key and value (of every layer) is then stale, and decoding must recompute (see generate.py).
    """
    d, base, s, original_len = args.head_dim, args.rope_theta, args.rope_factor, args.original_seq_len
    exponents = torch.arange(0, d, 2, dtype=torch.float32) / d
    if args.rope_scaling == "ntk":
        base = base * s ** (d / (d - 2))
    elif args.rope_scaling == "dynamic":
        seq_len = max(seq_len, original_len)
        base = base * (s * seq_len / original_len - (s - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / base**exponents
    if args.rope_scaling == "linear":
        return inv_freq / s, 1.0
    if args.rope_scaling == "yarn":
        # Dimensions that turn fewer than beta_slow=1 times over the original context are interpolated,
        # more than beta_fast=32 times kept; a linear ramp between.
        def dim_of(rotations):
            return d * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        attention_scale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
        return inv_freq / s * ramp + inv_freq * (1 - ramp), attention_scale
    if args.rope_scaling == "llama3":
        wavelen = 2 * math.pi / inv_freq
        low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
        smooth = (original_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / s + smooth * inv_freq
        scaled = torch.where(wavelen > original_len / low, inv_freq / s, scaled)
        return torch.where(wavelen < original_len / high, inv_freq, scaled), 1.0
    return inv_freq, 1.0


def rope_rotations(args: ModelArgs, start: int, end: int, device) -> torch.Tensor:
    """Complex rotations (end-start, head_dim/2) for positions start..end-1 of an end-token sequence, in float32."""
    inv_freq, scale = rope_frequencies(args, end)
    angles = torch.outer(torch.arange(start, end, device=device, dtype=torch.float32), inv_freq.to(device))
    return torch.polar(torch.full_like(angles, scale), angles)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x (B, T, H, head_dim) by complex freqs_cis (T, head_dim/2)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(-2).type_as(x)


class KVCache(nn.Module):
    """Preallocated keys and values (batch, kv heads, max length, head dim), written at explicit positions."""

    def __init__(self, batch_size, n_kv_heads, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def check(self, start_pos: int, batch: int, seqlen: int):
        """ValueError unless `batch` sequences of `seqlen` tokens at positions start_pos.. fit the cache."""
        cache_batch, _, cache_len, _ = self.k.shape
        if start_pos < 0 or start_pos + seqlen > cache_len:
            where = f"positions {start_pos}..{start_pos + seqlen - 1}"
            raise ValueError(
                f"{where} do not fit the KV cache of {cache_len} tokens; raise max_seq_len in setup_cache()"
            )
        if batch > cache_batch:
            raise ValueError(f"batch of {batch} exceeds the KV cache's {cache_batch}; raise max_batch_size")

    def update(self, input_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, kv heads, T, head dim) at positions input_pos.. and return all keys and values so far."""
        batch, end = k.shape[0], input_pos + k.shape[2]
        self.k[:batch, :, input_pos:end] = k
        self.v[:batch, :, input_pos:end] = v
        return self.k[:batch, :, :end], self.v[:batch, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, freqs_cis, start_pos: int | None, mask):
        batch, seqlen, _ = x.shape
        q = self.wq(x).view(batch, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, freqs_cis).transpose(1, 2), apply_rotary(k, freqs_cis).transpose(1, 2)
        v = v.transpose(1, 2)
        if start_pos is not None:
            k, v = self.cache.update(start_pos, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and seqlen > 1, enable_gqa=self.n_heads != self.n_kv_heads
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs_cis, start_pos, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, start_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_table: tuple[torch.Tensor | None, ModelArgs | None] = (None, None)  # see rope()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """N(0, 0.02) everywhere; the projections that write into the residual stream scaled by 1/sqrt(2·n_layers)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def setup_cache(self, max_batch_size: int, max_seq_len: int):
        """Allocate a KV cache for up to max_batch_size sequences of max_seq_len tokens (prompt + generated)."""
        a, w = self.args, self.tok_embeddings.weight  # the activations' dtype, whatever the output layer stores
        for layer in self.layers:
            layer.attention.cache = KVCache(max_batch_size, a.n_kv_heads, max_seq_len, a.head_dim, w.dtype, w.device)

    def reset_cache(self):
        """Free the KV cache."""
        for layer in self.layers:
            layer.attention.cache = None

    def rope(self, start: int, end: int, device) -> torch.Tensor:
        """Complex rotations (end-start, head_dim/2) for positions start..end-1 of an end-token sequence, in float32.

        Static RoPE slices a table over max(max_seq_len, KV cache length) positions, rebuilt when the device or args
        change (.to(), weights loaded onto a meta model, a new model.args); dynamic NTK and longer ends are computed."""
        device = torch.device(device)
        if self.args.rope_scaling == "dynamic":  # its frequencies depend on end
            return rope_rotations(self.args, start, end, device)
        table, args = self.rope_table
        if table is None or table.device != device or args is not self.args or end > table.shape[0]:
            cache = self.layers[0].attention.cache
            length = max(self.args.max_seq_len, 0 if cache is None else cache.k.shape[2])
            if end > length:
                return rope_rotations(self.args, start, end, device)
            with torch.inference_mode(False):  # a table first built while sampling must also serve training
                table, args = self.rope_table = rope_rotations(self.args, 0, length, device), self.args
        return table[start:end]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, start_pos: int | None = None):
        """Logits (B, T, vocab), or the mean cross-entropy when targets are given (-100 is ignored).

        With start_pos, tokens sit at positions start_pos.. and read and write the KV cache (see setup_cache).
        """
        batch, seqlen = tokens.shape
        end = (start_pos or 0) + seqlen
        mask = None
        if start_pos is not None:
            cache = self.layers[0].attention.cache
            if cache is None:
                raise ValueError("start_pos needs a KV cache: call setup_cache(max_batch_size, max_seq_len) first")
            cache.check(start_pos, batch, seqlen)
            if seqlen > 1 and start_pos > 0:  # a chunk after earlier tokens: query i sees keys 0..start_pos+i
                positions = torch.arange(end, device=tokens.device)
                mask = positions[None, :] <= positions[start_pos:, None]
        freqs_cis = self.rope(end - seqlen, end, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs_cis, start_pos, mask)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul weight, plus attention's 12·layers·dim·seq_len."""
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + 12 * self.args.n_layers * self.args.dim * seq_len
