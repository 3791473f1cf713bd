"""The picollama decoder: LLaMA (RMSNorm pre-norm blocks, RoPE attention with GQA, a static KV
cache and SDPA, SwiGLU FFN) by default, and the alternatives the seed lectures teach as ModelArgs
switches."""

import math
import typing
from dataclasses import asdict, dataclass, fields, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from picollama.cli import UserError, check_type

ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
# the scalings whose frequencies follow the current length (cached keys go stale)
LENGTH_DEPENDENT = ("dynamic",)
POSITIONS = ("rope", "alibi", "nope", "sinusoidal", "learned")
# the ModelArgs keys that leave LLaMA's architecture when away from their defaults (what HF's Llama
# and GGUF lack)
SWITCHES = (
    "norm",
    "norm_placement",
    "parallel_block",
    "activation",
    "qk_norm",
    "logit_softcap",
    "position",
    "rope_fraction",
    "nope_every",
    "logn_attention",
)
# Far past any published model (the largest: dim 16384, 126 layers, 256k vocabulary, 10M context): a size beyond its
# limit is a corrupt or mistyped config, refused naming the key before anything is allocated.
SIZE_LIMITS = dict(
    dim=1 << 16, n_layers=1 << 10, n_heads=1 << 10, n_kv_heads=1 << 10, vocab_size=1 << 22
)
SIZE_LIMITS |= dict(max_seq_len=1 << 24, ffn_hidden_dim=1 << 20)


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

    # The architecture switches; the defaults are LLaMA's (NORMS, PLACEMENTS, ACTIVATIONS below).
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    # pre | post (LN(x + f(x))) | sandwich (Gemma 2: a norm before and after f)
    norm_placement: str = "pre"
    parallel_block: bool = False  # GPT-J, PaLM: x + attention(n(x)) + ffn(n(x))
    # gated: swiglu | geglu | reglu (hidden 2/3·4·dim); plain: gelu | relu | relu2 (hidden 4·dim)
    activation: str = "swiglu"
    qk_norm: bool = False  # RMSNorm on each head's queries and keys, before RoPE (OLMo 2, Gemma 3)
    logit_softcap: float = 0.0  # cap·tanh(logits/cap) (Gemma 2); 0: off
    position: str = "rope"  # rope | alibi | nope | sinusoidal | learned
    # < 1: only the first fraction of each head's dimensions rotate (GPT-NeoX)
    rope_fraction: float = 1.0
    # k > 0: layers i with (i+1) % k == 0 use no positions, the rest RoPE (Llama 4, Command A)
    nope_every: int = 0
    # queries at 1-based position n scaled by max(1, log n / log original_seq_len)
    logn_attention: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for key, limit in SIZE_LIMITS.items():
            if (value := getattr(self, key)) is not None and not 1 <= value <= limit:
                raise ValueError(
                    f"{key} must be {f'at most {limit:,}' if value > 0 else 'positive'}, not {value!r}"
                )
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        choices = {"norm": NORMS, "norm_placement": PLACEMENTS, "activation": ACTIVATIONS}
        choices["position"] = POSITIONS
        choices |= dict.fromkeys(("parallel_block", "qk_norm", "logn_attention"), (False, True))
        choices["rope_scaling"] = ROPE_SCALINGS
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                raise ValueError(
                    f"{key} must be one of {', '.join(map(str, allowed))}, not {value!r}"
                )
        for key, ok, allowed in [
            ("rope_factor", self.rope_factor >= 1, ">= 1"),
            ("rope_fraction", 0 < self.rope_fraction <= 1, "in (0, 1]"),
            ("nope_every", self.nope_every >= 0, ">= 0"),
            ("logit_softcap", 0 <= self.logit_softcap < math.inf, "a finite number >= 0"),
        ]:
            if not ok:
                raise ValueError(f"{key} must be {allowed}, not {getattr(self, key)!r}")
        for key, off in (("rope_scaling", "none"), ("rope_fraction", 1.0), ("nope_every", 0)):
            if self.position != "rope" and getattr(self, key) != off:
                raise ValueError(
                    f"{key} applies to position = 'rope' only, not to position = {self.position!r}"
                )
        pairs = self.head_dim * self.rope_fraction / 2  # RoPE turns pairs of dimensions
        odd = self.head_dim % 2 or pairs < 1 or abs(pairs - round(pairs)) > 1e-6
        if self.position == "rope" and odd:
            raise ValueError(
                f"head_dim ({self.head_dim}) and head_dim·rope_fraction ({2 * pairs:g}) must be even"
            )

    @property
    def original_seq_len(self) -> int:
        """The context RoPE scaling stretches from: rope_original_max_seq_len, else max_seq_len."""
        return self.rope_original_max_seq_len or self.max_seq_len

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The FFN's hidden size: 4·dim, times 2/3 for a gated FFN (3 matrices instead of 2: the
        same parameters)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        gated = ACTIVATIONS[self.activation][0] is FeedForward
        hidden = int(2 * 4 * self.dim / 3) if gated else 4 * self.dim
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def non_llama(self) -> list[str]:
        """The switches (SWITCHES) away from LLaMA's defaults: what HF's Llama and llama.cpp
        cannot compute."""
        return [key for key in SWITCHES if getattr(self, key) != getattr(ModelArgs, key)]

    # ---- the length policy: how far this model runs, and what running past its context takes

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model can compute at all: learned positions end at their table;
        else None."""
        return self.max_seq_len if self.position == "learned" else None

    def needs_scaling(self, length: int) -> bool:
        """Whether `length` tokens take this RoPE model past its context with no RoPE scaling to
        stretch it (ALiBi, NoPE and sinusoidal positions have none to stretch)."""
        return self.position == "rope" and self.rope_scaling == "none" and length > self.max_seq_len

    def length_problem(self, length: int) -> str | None:
        """Why this model cannot run `length` tokens as it is (past a learned table, or a RoPE
        context with no scaling to stretch it); None when it can."""
        if self.position_limit is not None and length > self.position_limit:
            table = f"the model's learned position table of {self.position_limit} positions"
            return f"{length} tokens exceed {table}"
        if self.needs_scaling(length):
            return f"{length} tokens exceed the model's context of {self.max_seq_len} tokens"
        return None

    @property
    def length_dependent(self) -> bool:
        """Whether the RoPE frequencies change with the current length (LENGTH_DEPENDENT): then a
        cache goes stale."""
        return self.position == "rope" and self.rope_scaling in LENGTH_DEPENDENT

    def stretched(self, method: str, length: int, factor: float | None = None) -> "ModelArgs":
        """These args with RoPE scaling `method` for `length` tokens, stretching from
        original_seq_len by `factor`, else by just enough (length / original_seq_len, at least 1;
        1 for "none" and length-dependent methods)."""
        original = self.original_seq_len
        if factor is None:
            scales = method != "none" and method not in LENGTH_DEPENDENT
            factor = max(1.0, length / original) if scales else 1.0
        return replace(
            self, rope_scaling=method, rope_factor=factor, rope_original_max_seq_len=original
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """ModelArgs from a dict read from a file: each value checked for its field's type
        (UserError naming model.KEY), unknown keys refused."""
        if not isinstance(d, dict):
            raise UserError(f"model must be a table of settings, not {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown model argument(s): {', '.join(sorted(unknown))}")
        hints = typing.get_type_hints(cls)
        values = {key: check_type(f"model.{key}", value, hints[key]) for key, value in d.items()}
        try:
            return cls(**values)
        except ValueError as e:  # a size or combination no model has: name it like a type error
            raise UserError(f"model.{e}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, round to x's dtype, then scale: Hugging Face's order, so that bf16
        # results match theirs
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight


# LayerNorm: (x − mean) / std · γ + β, with its bias β
NORMS = {"rmsnorm": RMSNorm, "layernorm": nn.LayerNorm}


def rope_frequencies(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, head_dim·rope_fraction/2) and attention scale for a sequence
    of seq_len tokens, as Hugging Face's RoPE functions give them. `ntk` is static NTK-aware
    scaling, base·s^(d/(d-2)); `dynamic` takes s from the current length, so every cached key and
    value goes stale as it grows (generate.py recomputes)."""
    base = args.rope_theta
    s = args.rope_factor
    original_len = args.original_seq_len
    # partial rotary: the first d dimensions of each head rotate
    d = round(args.head_dim * args.rope_fraction)
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
        # Dimensions that turn fewer than beta_slow=1 times over the original context are
        # interpolated, more than beta_fast=32 times kept; a linear ramp between.
        def dim_of(rotations):
            return d * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), d - 1)
        ramp = (torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        ramp = ramp.clamp(0, 1)
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
    """Complex rotations (end-start, rotated dims/2) for positions start..end-1 of an end-token
    sequence, in float32."""
    inv_freq, scale = rope_frequencies(args, end)
    positions = torch.arange(start, end, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.to(device))
    return torch.polar(torch.full_like(angles, scale), angles)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x (B, T, H, head_dim) by complex freqs_cis
    ([B,] T, n/2); the dimensions past the first n pass unrotated (partial rotary)."""
    n = 2 * freqs_cis.shape[-1]
    pairs = torch.view_as_complex(x[..., :n].float().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * freqs_cis[..., None, :]).flatten(-2).type_as(x)
    return rotated if n == x.shape[-1] else torch.cat([rotated, x[..., n:]], dim=-1)


def alibi_bias(n_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's attention bias ([B,] heads, T, S): −slope·(query position − key position), −inf
    for later keys. Press et al.'s slopes: 2^(-8i/n) for heads i = 1..n; for n not a power of
    two p, p's, then every other one of 2p's."""
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * i / p) for i in range(1, p + 1)]
    slopes += [2 ** (-4 * i / p) for i in range(1, 2 * p, 2)]
    slopes = torch.tensor(slopes[:n_heads], device=q_pos.device)[:, None, None]
    distance = (q_pos[..., None, :, None] - k_pos[..., None, None, :]).float()
    return (-slopes * distance).masked_fill(distance < 0, -math.inf)


class Sinusoid(nn.Module):
    """The Transformer's PE(pos, 2i) = sin(pos / 10000^(2i/dim)), PE(pos, 2i+1) = cos(...), for
    any position."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, positions):
        exponents = torch.arange(0, self.dim, 2, device=positions.device) / self.dim
        angles = positions[..., None].float() / 10000**exponents
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., : self.dim]


class LearnedPositions(nn.Embedding):
    """GPT-2's absolute positions: a learned table over 0..max_seq_len-1, and nothing past it."""

    def forward(self, positions):
        last = int(positions.max())
        if last >= self.num_embeddings:
            raise ValueError(
                f"position {last} is past the learned positions ({self.num_embeddings})"
            )
        return super().forward(positions)


class KVCache(nn.Module):
    """Preallocated keys and values (batch, kv heads, max length, head dim), written at explicit
    positions."""

    def __init__(self, batch_size, n_kv_heads, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def check(self, start_pos: int, batch: int, seqlen: int):
        """ValueError unless `batch` sequences of `seqlen` tokens at positions start_pos.. fit the
        cache."""
        cache_batch, _, cache_len, _ = self.k.shape
        if start_pos < 0 or start_pos + seqlen > cache_len:
            where = f"positions {start_pos}..{start_pos + seqlen - 1}"
            raise ValueError(
                f"{where} do not fit the KV cache of {cache_len} tokens; raise max_seq_len in setup_cache()"
            )
        if batch > cache_batch:
            raise ValueError(
                f"batch of {batch} exceeds the KV cache's {cache_batch}; raise max_batch_size"
            )

    def update(self, input_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, kv heads, T, head dim) at positions input_pos.. and return all keys and
        values so far."""
        batch = k.shape[0]
        end = input_pos + k.shape[2]
        self.k[:batch, :, input_pos:end] = k
        self.v[:batch, :, input_pos:end] = v
        return self.k[:batch, :, :end], self.v[:batch, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        qk_norm = partial(RMSNorm, args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity
        self.q_norm, self.k_norm = qk_norm(), qk_norm()
        # NoPE: no positions in this layer
        self.rotate = apply_rotary if rotary else lambda x, freqs_cis: x
        self.cache: KVCache | None = None

    def forward(self, x, freqs_cis, start_pos: int | None, mask, q_scale=None):
        batch, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seqlen, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seqlen, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        q = self.rotate(q, freqs_cis).transpose(1, 2)
        k = self.rotate(k, freqs_cis).transpose(1, 2)
        v = v.transpose(1, 2)
        if q_scale is not None:  # log-n attention
            q = q * q_scale.to(q.dtype)
        if start_pos is not None:
            k, v = self.cache.update(start_pos, k, v)
        causal = mask is None and seqlen > 1
        gqa = self.n_heads != self.n_kv_heads
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seqlen, -1))


class MLP(nn.Module):
    """w2(act(w1 x)): the FFN of the original Transformer (ReLU), GPT-2 (GELU), Nemotron-4
    (squared ReLU)."""

    def __init__(self, dim: int, hidden_dim: int, act):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)))


class FeedForward(MLP):
    """The gated FFN w2(act(w1 x) · w3 x): SwiGLU (LLaMA), GeGLU, ReGLU."""

    def __init__(self, dim: int, hidden_dim: int, act=F.silu):
        super().__init__(dim, hidden_dim, act)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


# activation name -> (FFN, its function)
ACTIVATIONS = {
    "swiglu": (FeedForward, F.silu),
    "geglu": (FeedForward, F.gelu),
    "reglu": (FeedForward, F.relu),
    "gelu": (MLP, F.gelu),
    "relu": (MLP, F.relu),
    "relu2": (MLP, lambda x: F.relu(x).square()),
}

# how a sublayer f joins the residual stream x, for each norm_placement (post: sandwich's second
# norm)
PLACEMENTS = {
    "pre": lambda x, f, norm, post: x + f(norm(x)),  # GPT-2, LLaMA
    # the original Transformer: no final norm after its blocks
    "post": lambda x, f, norm, post: norm(x + f(x)),
    "sandwich": lambda x, f, norm, post: x + post(f(norm(x))),  # Gemma 2
}


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        nope_layer = args.nope_every > 0 and (layer_id + 1) % args.nope_every == 0
        self.attention = Attention(args, rotary=args.position == "rope" and not nope_layer)
        ffn, act = ACTIVATIONS[args.activation]
        self.feed_forward = ffn(args.dim, args.hidden_dim, act)
        norm = partial(NORMS[args.norm], args.dim, args.norm_eps)
        sandwich = args.norm_placement == "sandwich"
        self.attention_norm = norm()
        self.ffn_norm = None if args.parallel_block else norm()
        self.post_attention_norm = norm() if sandwich else None
        self.post_ffn_norm = norm() if sandwich and not args.parallel_block else None
        self.residual = PLACEMENTS[args.norm_placement]
        self.parallel = args.parallel_block

    def forward(self, x, freqs_cis, start_pos, mask, q_scale):
        attention = partial(
            self.attention, freqs_cis=freqs_cis, start_pos=start_pos, mask=mask, q_scale=q_scale
        )
        if self.parallel:
            # GPT-J, PaLM: attention and FFN read the same normed input, and add together
            both = lambda h: attention(h) + self.feed_forward(h)  # noqa: E731
            return self.residual(x, both, self.attention_norm, self.post_attention_norm)
        h = self.residual(x, attention, self.attention_norm, self.post_attention_norm)
        return self.residual(h, self.feed_forward, self.ffn_norm, self.post_ffn_norm)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = None  # absolute positions, added to the embeddings
        self.embed_scale = 1.0
        if args.position == "sinusoidal":
            self.pos_embeddings = Sinusoid(args.dim)
            # the Transformer's √dim on the token embeddings: at their init's std 0.02 the sinusoid's amplitude 1
            # drowns them (retrieval stuck at 16%). Measured (README, retrieval study): tokens ×√dim reach 97% where the
            # sinusoid ÷√dim, the same ratio in a residual stream √dim smaller, stays at 26% (600 Muon steps)
            self.embed_scale = math.sqrt(args.dim)
        elif args.position == "learned":
            self.pos_embeddings = LearnedPositions(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        if args.norm_placement == "post":  # each block ends normed already
            self.norm = nn.Identity()
        else:
            self.norm = NORMS[args.norm](args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope_table: tuple[torch.Tensor | None, ModelArgs | None] = (None, None)  # see rope()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """N(0, 0.02) everywhere; the projections that write into the residual stream scaled by
        1/sqrt(2·n_layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "norm.bias")):
                continue  # norms start as the identity: γ = 1, β = 0
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def setup_cache(self, max_batch_size: int, max_seq_len: int):
        """Allocate a KV cache for up to max_batch_size sequences of max_seq_len tokens (prompt +
        generated)."""
        kv_heads = self.args.n_kv_heads
        head_dim = self.args.head_dim
        # the activations' dtype and device, whatever the output layer stores
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            cache = KVCache(
                max_batch_size, kv_heads, max_seq_len, head_dim, weight.dtype, weight.device
            )
            layer.attention.cache = cache

    def reset_cache(self):
        """Free the KV cache."""
        for layer in self.layers:
            layer.attention.cache = None

    def rope(self, start: int, end: int, device) -> torch.Tensor:
        """rope_rotations(args, start, end), sliced from a table over max(max_seq_len, KV cache)
        positions, rebuilt when the device or args change (.to(), a new model.args); dynamic NTK
        and longer ends are computed."""
        device = torch.device(device)
        if self.args.length_dependent:  # its frequencies depend on end
            return rope_rotations(self.args, start, end, device)
        table, args = self.rope_table
        if table is None or table.device != device or args is not self.args or end > table.shape[0]:
            cache = self.layers[0].attention.cache
            length = max(self.args.max_seq_len, 0 if cache is None else cache.k.shape[2])
            if end > length:
                return rope_rotations(self.args, start, end, device)
            # a table first built while sampling must also serve training
            with torch.inference_mode(False):
                table = rope_rotations(self.args, 0, length, device)
            self.rope_table = (table, self.args)
        return table[start:end]

    def forward(
        self, tokens: torch.Tensor, targets=None, start_pos: int | None = None, positions=None
    ):
        """Logits (B, T, vocab), or the mean cross-entropy when targets are given (-100 is ignored).
        With start_pos, tokens sit at positions start_pos.. and use the KV cache (setup_cache);
        without it, `positions` ((T,) or (B, T), increasing) may place them elsewhere than 0..T-1
        (randomized-position training)."""
        batch, seqlen = tokens.shape
        device = tokens.device
        end = (start_pos or 0) + seqlen
        given = positions is not None
        if not given:
            positions = torch.arange(end - seqlen, end, device=device)
        key_positions = positions
        mask = None
        if start_pos is not None:
            self.check_cached_forward(start_pos, batch, seqlen, given)
            key_positions = torch.arange(end, device=device)
            if seqlen > 1 and start_pos > 0:
                # a chunk after earlier tokens: query i sees keys 0..start_pos+i
                mask = key_positions[None, :] <= positions[:, None]

        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h * self.embed_scale
            h = h + self.pos_embeddings(positions).type_as(h)
        freqs_cis = None
        q_scale = None
        if self.args.position == "rope":
            freqs_cis = self.rope(0, int(positions.max()) + 1 if given else end, device)[positions]
        elif self.args.position == "alibi":
            mask = alibi_bias(self.args.n_heads, positions, key_positions)
        if self.args.logn_attention:
            # at 1-based position n past the training context L, queries grow by log_L n
            log_n = (positions[..., None, :, None] + 1.0).log()
            q_scale = (log_n / math.log(self.args.original_seq_len)).clamp(min=1)
        for layer in self.layers:
            h = layer(h, freqs_cis, start_pos, mask, q_scale)

        logits = self.output(self.norm(h))
        if self.args.logit_softcap:
            logits = self.args.logit_softcap * torch.tanh(logits / self.args.logit_softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    def check_cached_forward(self, start_pos: int, batch: int, seqlen: int, positions_given: bool):
        """ValueError unless a forward at start_pos can use the KV cache: one is set up, it holds
        the batch and the positions, and no explicit positions are given."""
        cache = self.layers[0].attention.cache
        if cache is None:
            raise ValueError(
                "start_pos needs a KV cache: call setup_cache(max_batch_size, max_seq_len) first"
            )
        if positions_given:
            raise ValueError(
                "positions are for a forward without the KV cache: pass start_pos or positions"
            )
        cache.check(start_pos, batch, seqlen)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def is_llama(self) -> bool:
        return not self.args.non_llama()
