"""The picollama decoder: LLaMA (RMSNorm pre-norm blocks, RoPE attention with GQA, a static KV
cache and SDPA, SwiGLU FFN), then the alternatives the seed lectures teach and the length methods
past YaRN, chosen by ModelArgs."""

import math
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

WINDOWED = ("rerope", "self_extend", "rerope_topk")  # attend in two branches (WindowedRoPE)
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3") + WINDOWED
# the ModelArgs keys that leave LLaMA's architecture when away from their defaults
SWITCHES = (
    "norm norm_placement parallel_block activation qk_norm logit_softcap position rope_fraction"
    " nope_every logn_attention ssmax"
).split()


@dataclass
class ModelArgs:
    dim: int = 288  # the residual stream's width
    n_layers: int = 6  # depth: blocks, each attention then FFN
    n_heads: int = 6  # each head attends on its own dim/n_heads-wide subspace
    n_kv_heads: int | None = None  # < n_heads: grouped-query attention (a smaller KV cache)
    vocab_size: int = 4096  # the tokenizer's (data/prepare.py)
    multiple_of: int = 32  # the FFN's hidden size is rounded up to a multiple of this: fast matmuls
    ffn_dim_multiplier: float | None = None  # scales the FFN's hidden size (Llama 2 70B, Llama 3)
    ffn_hidden_dim: int | None = None  # the FFN's hidden size as given (imported checkpoints)
    norm_eps: float = 1e-5  # keeps a norm finite on an all-zero input
    rope_theta: float = 10000.0  # RoPE's base: a larger one turns the slowest pairs more slowly
    max_seq_len: int = 256  # the training context
    tie_embeddings: bool = False  # the output layer reuses the embedding's weights: fewer weights
    # RoPE scaling, to run past the training context: none | linear | ntk | dynamic | yarn | llama3,
    # or attention in two branches (no LLaMA runs it): rerope | self_extend | rerope_topk
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # how many times longer the context becomes (self_extend: rounded)
    # rerope, self_extend, rerope_topk: nearer keys keep exact RoPE; 0: original_seq_len//4 (·3/4)
    rope_window: int = 0
    rope_far_keys: int = 1  # rerope_topk: the far keys each query attends, its best-scoring
    rope_original_max_seq_len: int | None = None  # the context stretched from; None: max_seq_len
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original/low are interpolated
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    # The alternatives (at the end of this file); the defaults are LLaMA's.
    norm: str = "rmsnorm"  # rmsnorm | layernorm (NORMS)
    norm_placement: str = "pre"  # pre | post | sandwich (PLACEMENTS)
    parallel_block: bool = False  # attention and FFN side by side, one fused input (GPT-J, PaLM)
    activation: str = "swiglu"  # swiglu | geglu | reglu | gelu | relu | relu2 (ACTIVATIONS)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys: bounded scores (OLMo 2)
    logit_softcap: float = 0.0  # cap·tanh(logits/cap): bounded logits (Gemma 2); 0: off
    position: str = "rope"  # rope | alibi | nope | sinusoidal | learned | prope | fox (POSITIONS)
    rope_fraction: float = 1.0  # < 1: only that fraction of each head's dimensions rotates (NeoX)
    nope_every: int = 0  # k > 0: every k-th layer sees no positions, to reach further (Llama 4)
    logn_attention: bool = False  # past the context, queries grow as log n: attention stays sharp
    ssmax: bool = False  # queries scaled by a learned s·log(keys seen): Scalable-Softmax (SSMax)

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The FFN's hidden size: 4·dim, times 2/3 for a gated FFN (3 matrices, not 2)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        gated = ACTIVATIONS[self.activation][0] is FeedForward
        hidden = int(2 * 4 * self.dim / 3) if gated else 4 * self.dim
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def original_seq_len(self) -> int:
        """The context RoPE scaling stretches from."""
        return self.rope_original_max_seq_len or self.max_seq_len

    @property
    def uses_rope(self) -> bool:
        """Whether positions are RoPE's rotations (p-RoPE's too): what rope_* keys apply to."""
        return self.position in ("rope", "prope")

    @property
    def near_window(self) -> int:
        """The window w of the scalings in WINDOWED: keys nearer than w keep exact RoPE (by
        default a quarter of the context; rerope_topk's, which attends few far keys, 3/4)."""
        quarters = 3 if self.rope_scaling == "rerope_topk" else 1
        return self.rope_window or quarters * self.original_seq_len // 4

    def non_llama(self) -> list[str]:
        """The SWITCHES away from LLaMA's, and rope_scaling where it attends in two branches: what
        HF's Llama and llama.cpp cannot run."""
        away = [key for key in SWITCHES if getattr(self, key) != getattr(ModelArgs, key)]
        return away + ["rope_scaling"] * (self.rope_scaling in WINDOWED)

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- the length policy: how far this model runs, and what running past its context takes

    @property
    def length_dependent(self) -> bool:
        """Whether RoPE's frequencies follow the current length (dynamic): cached keys go stale."""
        return self.uses_rope and self.rope_scaling == "dynamic"

    def stretched(self, method: str, length: int, factor: float | None = None) -> "ModelArgs":
        """These args with RoPE scaling `method` for `length` tokens, stretching original_seq_len
        by `factor`, else by just enough (1 for "none" and dynamic, which follows the length)."""
        if not self.uses_rope and method != "none":
            raise ValueError(
                f"rope_scaling applies to position = 'rope' only (or 'prope'), not to position = "
                f"{self.position!r}"
            )
        original = self.original_seq_len
        args = replace(self, rope_scaling=method, rope_original_max_seq_len=original)
        if factor is None and method in WINDOWED:
            factor = args.window_factor(length)
        elif factor is None:
            factor = max(1.0, length / original) if method not in ("none", "dynamic") else 1.0
        return replace(args, rope_factor=factor)

    def window_factor(self, length: int) -> float:
        """rerope's k (self_extend's G, an integer) just large enough that the farthest distance
        of `length` tokens, length - 1, maps to at most original_seq_len - 1, the farthest trained:
        w + (length-1-w)/k, or (length-1)//G - w//G + w; rerope_topk's length / original_seq_len
        (its far keys all sit at distance w: the factor says only how far it stretches)."""
        w, last = self.near_window, self.original_seq_len - 1
        if length - 1 <= last:
            return 1.0
        if w >= last:
            raise ValueError(f"rope_window ({w}) must be below original_seq_len - 1 ({last})")
        if self.rope_scaling == "rerope_topk":
            return length / self.original_seq_len
        if self.rope_scaling == "rerope":
            return (length - 1 - w) / (last - w)
        group = 1
        while (length - 1) // group - w // group > last - w:
            group += 1
        return float(group)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, round to x's dtype, then scale: Hugging Face's order (same bf16 output)
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight


def rope_frequencies(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, head_dim·rope_fraction/2) and attention scale for seq_len
    tokens: rope_spectrum's, of which p-RoPE keeps the highest (the rest are 0: unrotated)."""
    inv_freq, scale = rope_spectrum(args, seq_len)
    return inv_freq[: round(args.head_dim * args.rope_fraction) // 2], scale


def rope_spectrum(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies (float32) and attention scale for seq_len tokens, as Hugging
    Face's RoPE functions give them, over the d = head_dim·rope_fraction rotated dimensions (partial
    rotary squeezes the spectrum into them; p-RoPE keeps all of head_dim's). `ntk` is static
    NTK-aware scaling, base·s^(d/(d-2)); `dynamic` takes s from the current length, so every cached
    key goes stale as it grows (generate.py recomputes)."""
    base, s, original_len = args.rope_theta, args.rope_factor, args.original_seq_len
    d = args.head_dim if args.position == "prope" else round(args.head_dim * args.rope_fraction)
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
    """Complex rotations (end-start, rotated dims/2), float32, of positions start..end-1 of an
    end-token sequence."""
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


class NoPE(nn.Module):
    """No positions: the causal mask alone tells tokens apart. Its methods are the interface of
    every position encoding (POSITIONS; the model's `pos_embeddings`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()

    def embed(self, h, positions):
        """The token embeddings h with absolute positions added."""
        return h

    def rotates(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s attention rotates queries and keys by RoPE."""
        return False

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        """(rotations, mask) for every layer's attention, of the queries' positions ((T,) or
        (B, T)) and end (None when given), the keys' positions and the causal mask (None: plain)."""
        return None, mask


class RoPE(NoPE):
    """Rotary position embedding: queries and keys turned by angles proportional to their
    positions, so that attention scores depend on their distance alone."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.nope_every = args.nope_every
        self.table = (None, None)  # rope_rotations over 0..len-1, and the args they are of

    def rotates(self, layer_id: int) -> bool:
        # nope_every = k: layers k-1, 2k-1, ... see no positions (Llama 4 interleaves NoPE)
        return not (self.nope_every and (layer_id + 1) % self.nope_every == 0)

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        if end is None:
            end = int(positions.max()) + 1
        if args.rope_scaling in WINDOWED and args.rope_factor > 1:  # far keys attend apart
            mask = WindowedRoPE(args, positions, key_positions)
        return self.rotations(args, end, positions.device)[positions], mask

    def rotations(self, args: ModelArgs, end: int, device) -> torch.Tensor:
        """rope_rotations(args, 0, end), sliced from a table kept until the device or args change
        (.to(), a new model.args) or `end` passes it; dynamic NTK's (of `end`) computed."""
        device = torch.device(device)
        if args.length_dependent:
            return rope_rotations(args, 0, end, device)
        table, table_args = self.table
        if table is None or table.device != device or table_args is not args or end > len(table):
            # the context, or twice `end` past it: decoding far past the context rebuilds rarely
            length = args.max_seq_len if end <= args.max_seq_len else 2 * end
            with torch.inference_mode(False):  # a table built while sampling serves training
                table = rope_rotations(args, 0, length, device)
            self.table = (table, args)
        return table[:end]


class KVCache(nn.Module):
    """Preallocated keys and values of shape (batch, kv heads, max length, head dim)."""

    def __init__(self, shape: tuple, dtype, device):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, kv heads, T, head dim) at positions input_pos.. and return all keys and
        values so far."""
        batch, end = k.shape[0], input_pos + k.shape[2]
        self.k[:batch, :, input_pos:end] = k
        self.v[:batch, :, input_pos:end] = v
        return self.k[:batch, :, :end], self.v[:batch, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        qk_norm = partial(RMSNorm, args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity
        self.q_norm, self.k_norm = qk_norm(), qk_norm()
        self.rotary = rotary  # False: a layer without positions
        self.ssmax = SSMax(args) if args.ssmax else None
        self.cache: KVCache | None = None

    def new_cache(self, shape: tuple, dtype, device) -> KVCache:
        return (Int8KVCache if dtype == torch.int8 else KVCache)(shape, dtype, device)

    def forward(self, x, freqs_cis, start_pos: int | None, mask, q_scale=None):
        """mask: None (causal), a boolean or additive tensor, or an object that attends itself
        (WindowedRoPE, ForgetGates)."""
        batch, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seqlen, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seqlen, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        if self.rotary:
            q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if q_scale is not None:  # log-n attention
            q = q * q_scale.to(q.dtype)
        if start_pos is not None:
            k, v = self.cache.update(start_pos, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype; no-ops where equal
        if self.ssmax is not None:
            q = self.ssmax(q, k.shape[2])
        if hasattr(mask, "attend"):
            out = mask.attend(q, k, v, self.rotary)
        else:
            causal, gqa = mask is None and seqlen > 1, self.n_heads != self.n_kv_heads
            out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seqlen, -1))


class FeedForward(nn.Module):
    """The gated FFN w2(act(w1 x) · w3 x): SwiGLU (LLaMA), GeGLU, ReGLU."""

    def __init__(self, dim: int, hidden_dim: int, act=F.silu):
        super().__init__()
        self.act = act
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    final_norm = True  # whether the model norms the last block's output

    def __init__(self, args: ModelArgs, rotary: bool = True):
        super().__init__()
        attention = ForgettingAttention if args.position == "fox" else Attention
        self.attention = attention(args, rotary)
        ffn, act = ACTIVATIONS[args.activation]
        self.feed_forward = ffn(args.dim, args.hidden_dim, act)
        self.attention_norm = make_norm(args)
        self.ffn_norm = make_norm(args)

    def forward(self, x, freqs_cis, start_pos, mask, q_scale):
        h = x + self.attention(self.attention_norm(x), freqs_cis, start_pos, mask, q_scale)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # so named for the learned table's state-dict key; the other encodings hold no weights
        self.pos_embeddings = POSITIONS[args.position](args)
        block = PLACEMENTS[args.norm_placement][args.parallel_block]
        rotates = self.pos_embeddings.rotates
        self.layers = nn.ModuleList(block(args, rotates(i)) for i in range(args.n_layers))
        self.norm = make_norm(args) if block.final_norm else nn.Identity()
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """N(0, 0.02), divided by sqrt(2·n_layers) for the layers writing to the residual stream."""
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "norm.bias", "ssmax.scale")):
                continue  # norms start as the identity (γ = 1, β = 0), SSMax's s as made
            if name.endswith("wf.bias"):  # FoX's forget gates start at σ(0) = 1/2, as its code's
                nn.init.zeros_(p)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype=None):
        """A KV cache for max_batch_size sequences of max_seq_len tokens (prompt and generated), of
        `dtype` (None: the activations'; bf16 under an fp32 model halves it, int8 (Int8KVCache)
        quarters it)."""
        weight = self.tok_embeddings.weight  # the activations' dtype and device
        shape = (max_batch_size, self.args.n_kv_heads, max_seq_len, self.args.head_dim)
        dtype = dtype or weight.dtype
        for layer in self.layers:
            layer.attention.cache = layer.attention.new_cache(shape, dtype, weight.device)

    def reset_cache(self):
        for layer in self.layers:
            layer.attention.cache = None

    def forward(self, tokens, targets=None, start_pos: int | None = None, positions=None):
        """Logits (B, T, vocab), or the mean cross-entropy when targets are given (-100 is
        ignored). With start_pos, tokens sit at positions start_pos.. and use the KV cache;
        without it, `positions` ((T,) or (B, T), increasing) may place them elsewhere than 0..T-1
        (randomized-position training)."""
        logits = self.head(self.features(tokens, start_pos, positions))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    def features(self, tokens, start_pos: int | None = None, positions=None):
        """The normed output of the last layer (B, T, dim): what the output head reads. Apart so
        that long sequences can be scored a slice of positions at a time (bounded logits)."""
        positions, key_positions, mask, end = self.span(tokens, start_pos, positions)
        h = self.pos_embeddings.embed(self.tok_embeddings(tokens), positions)
        freqs_cis, mask = self.pos_embeddings(self.args, positions, key_positions, mask, end)
        q_scale = logn_scale(self.args, positions)
        for layer in self.layers:
            h = layer(h, freqs_cis, start_pos, mask, q_scale)
        return self.norm(h)

    def head(self, h):
        """Logits of features h."""
        logits = self.output(h)
        if self.args.logit_softcap:
            logits = self.args.logit_softcap * torch.tanh(logits / self.args.logit_softcap)
        return logits

    def span(self, tokens, start_pos: int | None, positions):
        """(positions, key positions, mask, end) of a forward: the tokens' positions, those of
        the keys they see (with the KV cache: every cached one), a mask for a chunk after cached
        tokens (else None: causal) and the positions' end (None when given)."""
        seqlen = tokens.shape[1]
        end = None if positions is not None else (start_pos or 0) + seqlen
        if positions is None:
            positions = torch.arange(end - seqlen, end, device=tokens.device)
        if start_pos is None:
            return positions, positions, None, end
        self.check_cached_forward(start_pos, tokens.shape[0], seqlen, given=end is None)
        keys = torch.arange(end, device=tokens.device)
        # a chunk after earlier tokens: query i sees keys 0..start_pos+i
        mask = keys[None, :] <= positions[:, None] if seqlen > 1 and start_pos > 0 else None
        return positions, keys, mask, end

    def check_cached_forward(self, start_pos: int, batch: int, seqlen: int, given: bool):
        """ValueError unless a forward at start_pos fits the KV cache, with no positions given."""
        cache = self.layers[0].attention.cache
        if cache is None:
            raise ValueError(
                "start_pos needs a KV cache: call setup_cache(max_batch_size, max_seq_len) first"
            )
        if given:
            raise ValueError(
                "positions are for a forward without the KV cache: pass start_pos or positions"
            )
        cache_batch, _, cache_len, _ = cache.k.shape
        if start_pos < 0 or start_pos + seqlen > cache_len:
            raise ValueError(
                f"positions {start_pos}..{start_pos + seqlen - 1} do not fit the KV cache of "
                f"{cache_len} tokens; raise max_seq_len in setup_cache()"
            )
        if batch > cache_batch:
            raise ValueError(
                f"batch of {batch} exceeds the KV cache's {cache_batch}; raise max_batch_size"
            )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def is_llama(self) -> bool:
        return not self.args.non_llama()


# ---------------------------------------------------------------- the lectures' alternatives

# LayerNorm: (x − mean) / std · γ + β, with its bias β
NORMS = {"rmsnorm": RMSNorm, "layernorm": nn.LayerNorm}


def make_norm(args: ModelArgs) -> nn.Module:
    return NORMS[args.norm](args.dim, args.norm_eps)


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


def relu2(x):
    return F.relu(x).square()


# activation name -> (FFN, its function)
ACTIVATIONS = {
    "swiglu": (FeedForward, F.silu),
    "geglu": (FeedForward, F.gelu),
    "reglu": (FeedForward, F.relu),
    "gelu": (MLP, F.gelu),
    "relu": (MLP, F.relu),
    "relu2": (MLP, relu2),
}


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


# norm_placement -> (its block, with parallel_block)
PLACEMENTS = {
    "pre": (TransformerBlock, ParallelBlock),
    "post": (PostNormBlock, ParallelPostNormBlock),
    "sandwich": (SandwichBlock, ParallelSandwichBlock),
}


def logn_scale(args: ModelArgs, positions: torch.Tensor) -> torch.Tensor | None:
    """Log-n attention's query scale at 1-based positions n, max(1, log n / log original_seq_len)
    (broadcast over (B, heads, T, head_dim)); None when it is off."""
    if not args.logn_attention:
        return None
    log_n = (positions[..., None, :, None] + 1.0).log()
    return (log_n / math.log(args.original_seq_len)).clamp(min=1)


class ALiBi(NoPE):
    """Attention with linear biases: in place of the mask, a bias ([B,] heads, T, S) of
    −slope·(query position − key position), −inf for later keys. Press et al.'s slopes:
    2^(-8i/n) for heads i = 1..n; for n not a power of two p, p's, then every other one of 2p's."""

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        p = 2 ** math.floor(math.log2(args.n_heads))
        slopes = [2 ** (-8 * i / p) for i in range(1, p + 1)]
        slopes += [2 ** (-4 * i / p) for i in range(1, 2 * p, 2)]
        slopes = torch.tensor(slopes[: args.n_heads], device=positions.device)[:, None, None]
        distance = (positions[..., None, :, None] - key_positions[..., None, None, :]).float()
        return None, (-slopes * distance).masked_fill(distance < 0, -math.inf)


class Sinusoidal(NoPE):
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


class LearnedPositions(NoPE):
    """GPT-2's absolute positions: a learned table over 0..max_seq_len-1, and nothing past it."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.weight = nn.Parameter(torch.randn(args.max_seq_len, args.dim))  # nn.Embedding's

    def embed(self, h, positions):
        last = int(positions.max())
        if last >= len(self.weight):
            raise ValueError(f"position {last} is past the learned positions ({len(self.weight)})")
        return h + F.embedding(positions, self.weight).type_as(h)


POSITIONS = dict(rope=RoPE, alibi=ALiBi, nope=NoPE, sinusoidal=Sinusoidal, learned=LearnedPositions)


# ---------------------------------------------------------------- inference: a quantized cache


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., n) as int8 and one float32 scale a row (absmax / 127): x ≈ values · scale."""
    scale = x.float().abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (x.float() / scale[..., None]).round().to(torch.int8), scale


class Int8KVCache(KVCache):
    """A KV cache of int8 keys and values with one scale per token and head (quantize_rows): a
    quarter of fp32's bytes, what a long decode step reads (picollama.inference reads it as is)."""

    def __init__(self, shape: tuple, dtype, device):
        super().__init__(shape, torch.int8, device)
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.zeros(shape[:3], device=device), persistent=False)

    def update(self, input_pos: int, k: torch.Tensor, v: torch.Tensor):
        batch, end = k.shape[0], input_pos + k.shape[2]
        kept = []
        for values, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values[:batch, :, input_pos:end], scales[:batch, :, input_pos:end] = quantize_rows(new)
            kept.append(values[:batch, :, :end] * scales[:batch, :, :end, None])
        return kept


# ---------------------------------------------------------------- past YaRN: length methods

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
        self.window, self.positions, self.key_positions = args.near_window, positions, key_positions
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

    def attend(self, q, k, v, rotary: bool):
        """Attention of queries (B, heads, T, head_dim) over keys and values (B, kv heads, S,
        head_dim), both rotated as usual (a layer with rotary False: plain causal attention)."""
        far_k = turn(k, self.k_turn) if rotary else None
        if q.device.type == "cpu" and self.positions.dim() == 1 and rotary:
            group = q.shape[1] // k.shape[1]  # the flash kernel takes no GQA: keys per head
            k, far_k, v = (x.repeat_interleave(group, 1) for x in (k, far_k, v))
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
        if far and self.far_keys:
            return self.far_branch(q, k, v, allowed)
        bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, -math.inf)
        out, lse = flash_attention_cpu(q, k, v, attn_mask=bias)
        return out.float(), lse.masked_fill(~allowed.any(-1), -math.inf)  # the kernel says 0

    def far_branch(self, q, k, v, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's far_keys best-scoring allowed keys, chosen on scores in q's dtype (one
        matmul, no float copy of them all), then weighted in float32 from the kept keys and values
        alone, gathered."""
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


# ---------------------------------------------------------------- past YaRN: trained encodings

# p-RoPE (Barbero et al. 2025): RoPE over all of head_dim's spectrum, but only its highest
# rope_fraction of frequencies turn; the lowest pairs pass unrotated, channels free of position
# (rope_fraction < 1 with position = "rope" instead squeezes the whole spectrum into fewer pairs).
# FoX has no positions but its forget gates (ForgettingAttention).
POSITIONS |= dict(prope=RoPE, fox=NoPE)


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

    def new_cache(self, shape: tuple, dtype, device) -> KVCache:
        if dtype == torch.int8:
            raise ValueError("FoX's KV cache is not quantized: use a float dtype")
        return ForgetCache(shape, dtype, device, self.n_heads)

    def forward(self, x, freqs_cis, start_pos: int | None, mask, q_scale=None):
        log_f = F.logsigmoid(self.wf(x).float()).transpose(1, 2)  # (B, heads, T)
        c = log_f.cumsum(-1) if start_pos is None else self.cache.update_gates(start_pos, log_f)
        return super().forward(x, freqs_cis, start_pos, ForgetGates(c), q_scale)


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


class ForgetGates:
    """FoX's attention: scores q·k/√head_dim + c_i - c_j over the causal keys, a block of queries
    at a time."""

    def __init__(self, c: torch.Tensor):
        self.c = c  # (B, heads, S): every key's c; the T queries are the last T keys

    def attend(self, q, k, v, rotary: bool):
        offset = k.shape[2] - q.shape[2]
        return blockwise(partial(self.block, k=k, v=v, offset=offset), q, k.shape[2])

    def block(self, q, first: int, k, v, offset: int):
        at = torch.arange(first, first + q.shape[2], device=q.device) + offset  # as keys
        c = self.c.unflatten(1, (k.shape[1], -1))  # grouped as the scores
        bias = c[..., at, None] - c[..., None, :]
        allowed = torch.arange(k.shape[2], device=q.device) <= at[:, None]
        return softmax_attention(grouped_scores(q, k) + bias, allowed, v)
