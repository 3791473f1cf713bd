"""The picollama decoder: LLaMA — RMSNorm pre-norm blocks, RoPE attention with GQA over a KV cache
the caller sets up, a SwiGLU FFN — and the tables through which its alternatives plug in."""

import math
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# The components ModelArgs names, each chosen by one lookup. model.py puts in LLaMA's own, below
# its blocks. picollama/components/registry.py puts in all the others, in plain statements.
# Until something imports registry.py, the tables hold LLaMA's parts only.
NORMS: dict = {}  # norm -> the class, made as cls(dim, eps)
ACTIVATIONS: dict = {}  # activation -> (the FFN class, its function)
BLOCKS: dict = {}  # (norm_placement, parallel_block) -> the block class
POSITIONS: dict = {}  # position -> the position encoding's class (Positions' interface)
ATTENTIONS: dict = {}  # position -> its attention class, where it is not Attention (FoX)
QUERY_SCALES: dict = {}  # a ModelArgs switch -> the module that scales queries when it is on
OUTPUT_GATES: dict = {}  # a ModelArgs switch -> the module that gates the heads' output when on
ROPE_INIT: dict = {}  # rope_scaling -> fn(args, d, seq_len) -> (inverse frequencies, scale)
ROPE_ATTENTIONS: dict = {}  # rope_scaling -> the attention it needs past the context, fn(...)
ATTENTION_WRAPS: list = []  # fn(args, positions, attend) -> attend, every forward (log-n)
INITS: dict = {"norm.weight": nn.init.ones_}  # a parameter name's ending -> its init, if not N(0,σ)


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
    # RoPE scaling, to run past the training context: a key of ROPE_INIT ("none", "yarn", ...),
    # those in ROPE_ATTENTIONS attending in branches ("rerope", "dca", ...)
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # how many times longer the context becomes (self_extend: rounded)
    # keys nearer keep exact RoPE; 0: rerope, self_extend 1/4 (rerope_topk 3/4, dca 1/16,
    # reattention 1/2) of original_seq_len
    rope_window: int = 0
    rope_far_keys: int = 1  # rerope_topk, reattention: the far keys a query attends, its best
    rope_original_max_seq_len: int | None = None  # the context stretched from; None: max_seq_len
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original/low are interpolated
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    # The lectures' alternatives (picollama.components.variants). The defaults are LLaMA's.
    norm: str = "rmsnorm"  # rmsnorm | layernorm (NORMS)
    norm_placement: str = "pre"  # pre | post | sandwich (BLOCKS)
    parallel_block: bool = False  # attention and FFN side by side, one fused input (GPT-J, PaLM)
    activation: str = "swiglu"  # swiglu | geglu | reglu | gelu | relu | relu2 (ACTIVATIONS)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys: bounded scores (OLMo 2)
    logit_softcap: float = 0.0  # cap·tanh(logits/cap): bounded logits (Gemma 2); 0: off
    position: str = "rope"  # rope | alibi | nope | sinusoidal | learned | prope | fox (POSITIONS)
    rope_fraction: float = 1.0  # < 1: only that fraction of each head's dimensions rotates (NeoX)
    nope_every: int = 0  # k > 0: every k-th layer sees no positions, to reach further (Llama 4)
    logn_attention: bool = False  # past the context, queries grow as log n: attention stays sharp
    ssmax: bool = False  # queries scaled by a learned s·log(keys seen): Scalable-Softmax (SSMax)
    attention_gate: bool = False  # the heads' output times σ(wg·x): gated attention (Qwen3-Next)

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
        hidden = (
            int(2 * 4 * self.dim / 3) if ACTIVATIONS[self.activation][0].gated else 4 * self.dim
        )
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def original_seq_len(self) -> int:
        """The context RoPE scaling stretches from."""
        return self.rope_original_max_seq_len or self.max_seq_len

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, round to x's dtype, then scale: Hugging Face's order (same bf16 output)
        return F.rms_norm(x.float(), self.weight.shape, eps=self.eps).type_as(x) * self.weight


def make_norm(args: ModelArgs) -> nn.Module:
    return NORMS[args.norm](args.dim, args.norm_eps)


def plain_rope(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies base^(-2i/d) over d rotated dimensions, and attention scale 1."""
    return 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d), 1.0


def rope_frequencies(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, head_dim·rope_fraction/2) and attention scale for seq_len
    tokens, as args.rope_scaling's function gives them (Hugging Face's ROPE_INIT_FUNCTIONS), over
    the encoding's spectrum_dims, of which the first head_dim·rope_fraction/2 pairs turn."""
    d = POSITIONS[args.position].spectrum_dims(args)
    inv_freq, scale = ROPE_INIT[args.rope_scaling](args, d, seq_len)
    return inv_freq[: round(args.head_dim * args.rope_fraction) // 2], scale


def rope_rotations(args: ModelArgs, start: int, end: int, device) -> torch.Tensor:
    """Complex rotations (end-start, rotated dims/2), float32, of positions start..end-1 of an
    end-token sequence: complex, so that no mixed-precision policy rounds them with the inputs."""
    inv_freq, scale = rope_frequencies(args, end)
    positions = torch.arange(start, end, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.to(device))
    return torch.polar(torch.full_like(angles, scale), angles)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Turn interleaved pairs (a, b) of x (..., heads, head_dim) by rotations (..., n/2), complex or
    as view_as_real gives them (..., n/2, 2), to (a·cos - b·sin, a·sin + b·cos), leading dims
    broadcast; past the first n dims x is kept. Real arithmetic: a compiled step runs it."""
    turns = torch.view_as_real(rotations) if rotations.is_complex() else rotations
    cos, sin = turns[..., None, :, 0], turns[..., None, :, 1]
    n = 2 * cos.shape[-1]
    a, b = x[..., :n].float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).type_as(x)
    return rotated if n == x.shape[-1] else torch.cat([rotated, x[..., n:]], dim=-1)


# The kernel sdpa_attention calls: PyTorch's, unless a caller swaps in one of its signature for a
# while (train.py on a CPU: picollama.training.cpu_attention's)
SDPA_KERNEL = F.scaled_dot_product_attention


def sdpa_attention(q, k, v, attention: nn.Module, mask=None) -> torch.Tensor:
    """Queries (B, heads, T, hd) attending keys, values (B, kv heads, S, hd): causal, or masked."""
    causal, gqa = mask is None and q.shape[2] > 1, q.shape[1] != k.shape[1]
    return SDPA_KERNEL(q, k, v, mask, is_causal=causal, enable_gqa=gqa)


class Positions(nn.Module):
    """The interface of every position encoding (POSITIONS; the model's `pos_embeddings`), and
    NoPE's: no positions, the causal mask alone tells tokens apart."""

    def __init__(self, args: ModelArgs):
        super().__init__()

    def embed(self, h, positions):
        return h  # the token embeddings h with absolute positions added

    def rotates(self, layer_id: int) -> bool:
        return False  # whether layer `layer_id`'s attention turns queries and keys by RoPE

    @staticmethod
    def spectrum_dims(args: ModelArgs) -> int:
        """The dimensions RoPE's spectrum spans: the rotated ones (partial rotary squeezes it)."""
        return round(args.head_dim * args.rope_fraction)

    def forward(self, args: ModelArgs, positions, key_positions, mask, end: int | None):
        """(rotations, attend(q, k, v, attention module): the attention) for every layer, of the
        queries' positions ((T,) or (B, T)) and end (None: given), the keys', the causal mask."""
        return None, self.attention(args, positions, partial(sdpa_attention, mask=mask))

    def attention(self, args: ModelArgs, positions, attend):
        for wrap in ATTENTION_WRAPS:
            attend = wrap(args, positions, attend)
        return attend


class RoPE(Positions):
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
        end = int(positions.max()) + 1 if end is None else end
        attend = partial(sdpa_attention, mask=mask)
        if args.rope_scaling in ROPE_ATTENTIONS and args.rope_factor > 1:  # far keys apart
            attend = ROPE_ATTENTIONS[args.rope_scaling](args, positions, key_positions)
        rotations = self.rotations(args, end, positions.device)[positions]
        return rotations, self.attention(args, positions, attend)

    def rotations(self, args: ModelArgs, end: int, device) -> torch.Tensor:
        """rope_rotations(args, 0, end), sliced from a table kept until the device or args change
        (.to(), a new model.args) or `end` passes it; computed where they follow the length."""
        device = torch.device(device)
        if getattr(ROPE_INIT[args.rope_scaling], "length_dependent", False):  # dynamic NTK
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
        """Write k, v (B, kv heads, T, head dim) at input_pos.. and return every key and value."""
        batch, end = k.shape[0], input_pos + k.shape[2]
        self.k[:batch, :, input_pos:end], self.v[:batch, :, input_pos:end] = k, v
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
        self.q_scales = [name for name in QUERY_SCALES if getattr(args, name)]
        self.gates = [name for name in OUTPUT_GATES if getattr(args, name)]
        for name in self.q_scales + self.gates:
            self.add_module(name, (QUERY_SCALES | OUTPUT_GATES)[name](args))
        self.cache: KVCache | None = None

    def new_cache(self, cache: type, shape: tuple, dtype, device) -> KVCache:
        return cache(shape, dtype, device)  # an attention that caches more (FoX) makes its own

    def forward(self, x, rotations, start_pos: int | None, attend):
        """x (B, T, dim) at positions start_pos.. after the cached keys (None: no cache), its
        queries and keys turned by `rotations`; attend: the forward's attention function."""
        batch, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seqlen, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seqlen, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(batch, seqlen, self.n_kv_heads, self.head_dim)
        if self.rotary:
            q, k = apply_rotary(q, rotations), apply_rotary(k, rotations)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if start_pos is not None:
            k, v = self.cache.update(start_pos, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype; no-ops where equal
        for name in self.q_scales:
            q = self.get_submodule(name)(q, k.shape[2])
        out = attend(q, k, v, self).transpose(1, 2).reshape(batch, seqlen, -1)
        for name in self.gates:
            out = self.get_submodule(name)(out, x)
        return self.wo(out)


class FeedForward(nn.Module):
    """The gated FFN w2(act(w1 x) · w3 x): SwiGLU (LLaMA), GeGLU, ReGLU."""

    gated = True  # three matrices: ModelArgs.hidden_dim is 2/3 of the ungated FFN's

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
        self.attention = ATTENTIONS.get(args.position, Attention)(args, rotary)
        ffn, act = ACTIVATIONS[args.activation]
        self.feed_forward = ffn(args.dim, args.hidden_dim, act)
        self.attention_norm = make_norm(args)
        self.ffn_norm = make_norm(args)

    def forward(self, x, rotations, start_pos, attend):
        h = x + self.attention(self.attention_norm(x), rotations, start_pos, attend)
        return h + self.feed_forward(self.ffn_norm(h))


# LLaMA's components
NORMS["rmsnorm"], ACTIVATIONS["swiglu"] = RMSNorm, (FeedForward, F.silu)
POSITIONS["rope"], BLOCKS["pre", False], ROPE_INIT["none"] = RoPE, TransformerBlock, plain_rope


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # so named for the learned table's state-dict key; the other encodings hold no weights
        self.pos_embeddings = POSITIONS[args.position](args)
        block = BLOCKS[args.norm_placement, args.parallel_block]
        rotates = self.pos_embeddings.rotates
        self.layers = nn.ModuleList(block(args, rotates(i)) for i in range(args.n_layers))
        self.norm = make_norm(args) if block.final_norm else nn.Identity()
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """N(0, 0.02), divided by sqrt(2·n_layers) for the layers writing to the residual stream;
        parameters named in INITS as INITS says."""
        if self.tok_embeddings.weight.is_meta:  # built to be assigned weights: nothing to draw
            return
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            ending = next((end for end in INITS if name.endswith(end)), None)
            if ending is not None:
                INITS[ending](p)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype=None, cache=KVCache):
        """A KV cache of class `cache` (the caller's: picollama.kernels.caches has int8's) for
        max_batch_size sequences of max_seq_len tokens, of `dtype` (None: the activations')."""
        weight = self.tok_embeddings.weight  # the activations' dtype and device
        shape = (max_batch_size, self.args.n_kv_heads, max_seq_len, self.args.head_dim)
        where = dtype or weight.dtype, weight.device
        for attention in (layer.attention for layer in self.layers):
            attention.cache = attention.new_cache(cache, shape, *where)

    def reset_cache(self):
        for layer in self.layers:
            layer.attention.cache = None

    def forward(self, tokens, targets=None, start_pos=None, positions=None, mask=None):
        """Logits (B, T, vocab), or the mean cross-entropy of targets (-100 ignored). With
        start_pos, tokens sit at start_pos.. and use the KV cache; without, `positions` ((T,) or
        (B, T)) may place them elsewhere than 0..T-1 (randomized, or restarting per packed
        document) and `mask` ((B, [1,] T, T) bool, True: may attend) replaces the causal mask."""
        logits = self.head(self.features(tokens, start_pos, positions, mask))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    def features(self, tokens, start_pos: int | None = None, positions=None, mask=None):
        """The normed last layer (B, T, dim) the head reads: apart for scoring in slices."""
        positions, key_positions, mask, end = self.span(tokens, start_pos, positions, mask)
        h = self.pos_embeddings.embed(self.tok_embeddings(tokens), positions)
        rotations, attend = self.pos_embeddings(self.args, positions, key_positions, mask, end)
        for layer in self.layers:
            h = layer(h, rotations, start_pos, attend)
        return self.norm(h)

    def head(self, h):
        logits = self.output(h)
        if self.args.logit_softcap:  # Gemma 2's cap·tanh(logits/cap)
            logits = self.args.logit_softcap * torch.tanh(logits / self.args.logit_softcap)
        return logits

    def span(self, tokens, start_pos: int | None, positions, mask=None):
        """The tokens' positions, the keys' (cached ones too), the mask given (B, 1, T, T) or one
        for a chunk after cached tokens (None: causal) and the positions' end (None when given)."""
        seqlen = tokens.shape[1]
        end = None if positions is not None else (start_pos or 0) + seqlen
        if positions is None:
            positions = torch.arange(end - seqlen, end, device=tokens.device)
        if start_pos is None:
            mask = None if mask is None else mask.reshape(len(tokens), 1, seqlen, seqlen)
            return positions, positions, mask, end
        given = end is None or mask is not None
        self.check_cached_forward(start_pos, tokens.shape[0], seqlen, given=given)
        keys = torch.arange(end, device=tokens.device)
        # a chunk after earlier tokens: query i sees keys 0..start_pos+i
        mask = keys[None, :] <= positions[:, None] if seqlen > 1 and start_pos > 0 else None
        return positions, keys, mask, end

    def check_cached_forward(self, start_pos: int, batch: int, seqlen: int, given: bool):
        """ValueError unless a forward at start_pos fits the KV cache, with no positions or mask."""
        cache = self.layers[0].attention.cache
        if cache is None:
            problem = "start_pos needs a KV cache: call setup_cache(max_batch_size, max_seq_len)"
            raise ValueError(problem + " first")
        if given:
            raise ValueError("positions and masks are for a forward without the KV cache")
        cache_batch, _, cache_len, _ = cache.k.shape
        end = start_pos + seqlen
        if start_pos < 0 or end > cache_len:
            fit = f"positions {start_pos}..{end - 1} do not fit the KV cache of {cache_len} tokens"
            raise ValueError(fit + "; raise max_seq_len in setup_cache()")
        if batch > cache_batch:
            big = f"batch of {batch} exceeds the KV cache's {cache_batch}"
            raise ValueError(big + "; raise max_batch_size")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
