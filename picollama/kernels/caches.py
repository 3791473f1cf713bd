"""The KV caches besides model.KVCache: int8 keys and values, and attention sinks' bounded
cache.

How to add a KV-cache type (a --kv-cache choice):
- One stored as a torch dtype, say float16: its line in KV_CACHES below. That is all. The flags
  of generate.py and the server (add_kv_cache_flag), chat and setup_cache read the table.
- One stored with more than keys and values (int8 keeps scales): its class here, like
  Int8KVCache, its line in KV_CACHES, and its dtype's line in CACHE_CLASSES. Then
  picollama/kernels/fused_step.py must write and read it: cache_tensors, cached_attention.
  --sink-tokens refuses it by itself (check_sink_cache).
decode_ops.cpp reads only float32, bfloat16 and int8 caches. The fused step attends to any other
with SDPA, so the C++ kernel is optional. So are tests/test_generate.py's kv-cache cases and
docs/performance.md.
"""

from dataclasses import dataclass

import torch

from model import KVCache, Transformer, apply_rotary, rope_frequencies
from picollama.cli import UserError
from picollama.cli.flags import ArgumentParser
from picollama.components.length import length_dependent, uses_rope


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., n) as int8 and one float32 scale a row (absmax / 127): x ≈ values · scale."""
    scale = x.float().abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (x.float() / scale[..., None]).round().to(torch.int8), scale


class Int8KVCache(KVCache):
    """A KV cache of int8 keys and values with one scale per token and head (quantize_rows): a
    quarter of fp32's bytes, what a long decode step reads (the fused step reads it as is)."""

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


@dataclass(frozen=True)
class Sinks:
    """Bounded-memory sampling with attention sinks (StreamingLLM, Xiao et al. 2023): a KV cache of
    `window` tokens (None: the model's context) keeping each row's first `sink_tokens` and the most
    recent others. It bounds memory and keeps the text fluent past the context; it does not extend
    the usable context: what leaves the cache is forgotten. Checked on creation (its messages name
    the flags)."""

    sink_tokens: int = 4
    window: int | None = None  # the cache's size in tokens, sinks included

    def __post_init__(self):
        if self.sink_tokens < 0:
            raise UserError(f"--sink-tokens must be >= 0, not {self.sink_tokens}")
        if self.window is not None and self.window <= self.sink_tokens:
            raise UserError(
                f"--window must be larger than --sink-tokens ({self.sink_tokens}), leaving room "
                f"for recent tokens; not {self.window}"
            )

    def window_of(self, args) -> int:
        """The cache's size for a model of `args`: the window given, else its context."""
        window = self.window or args.max_seq_len
        if window <= self.sink_tokens:
            raise UserError(
                f"--sink-tokens {self.sink_tokens} fills the model's context of {window} tokens: "
                "lower it, or give a larger --window"
            )
        return window


def check_sinks(args):
    """UserError for a model whose cached keys and values cannot move to new positions."""
    if args.position in ("sinusoidal", "learned"):
        raise UserError(
            f"--sink-tokens: {args.position} positions are added to the token embeddings, so "
            "cached tokens cannot move to new positions (RoPE, ALiBi and NoPE models can)"
        )
    if args.position == "fox":
        raise UserError(
            "--sink-tokens: FoX caches each key's running sum of forget gates, which the sink "
            "cache does not move (RoPE, ALiBi and NoPE models can)"
        )
    if length_dependent(args):
        raise UserError(
            "--sink-tokens: dynamic NTK turns every cached key as the sequence grows; choose "
            "another --rope-scaling (the cache never holds more than --window tokens)"
        )


class SinkCache:
    """The model's KV cache under Sinks, changed in place (a DecodeStep, compiled or not, reads the
    same tensors). Slots 0..fill-1 hold tokens, the sequence's first sink_tokens in front; full, it
    drops the `evict` oldest others and moves the rest down. Positions are the slots (StreamingLLM's
    choice), so a RoPE key moved down `evict` slots is turned back by `evict` positions; ALiBi's
    bias and NoPE read no stored position."""

    def __init__(self, model: Transformer, sinks: Sinks):
        check_sinks(model.args)
        self.model, self.sinks = model, sinks.sink_tokens
        self.window = sinks.window_of(model.args)
        # a quarter of the recent part at a time: a move costs O(window) per layer, so it happens
        # 4 times per window of new tokens, not at every token
        self.evict = max(1, (self.window - self.sinks) // 4)
        self.fill = 0
        self.turn = None  # the rotation by -evict positions, for RoPE
        if uses_rope(model.args):
            inv_freq, _ = rope_frequencies(model.args, self.window)
            angles = -self.evict * inv_freq.to(model.tok_embeddings.weight.device)
            # unit length: the cached keys carry YaRN's attention scale already
            self.turn = torch.polar(torch.ones_like(angles), angles)

    def make_room(self):
        """Where the cache is full, drop the `evict` tokens after the sinks and move the rest down
        (keys turned back by as many positions: rotations compose)."""
        if self.fill < self.window:
            return
        start, end = self.sinks + self.evict, self.fill
        for layer in self.model.layers:
            attention = layer.attention
            cache = attention.cache
            kept = cache.k[:, :, start:end]
            rotated = self.turn is not None and attention.rotary  # not a nope_every layer
            # copies: the slots read and written overlap
            kept = apply_rotary(kept, self.turn) if rotated else kept.clone()
            cache.k[:, :, self.sinks : end - self.evict] = kept
            cache.v[:, :, self.sinks : end - self.evict] = cache.v[:, :, start:end].clone()
        self.fill -= self.evict

    def prefill(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """prefill() into this cache: tokens[:, :pos] in chunks up to the cache's end, evicting
        between them, which leaves what feeding them one at a time would."""
        fed = 0
        while fed < pos:
            self.make_room()
            chunk = min(pos - fed, self.window - self.fill)
            logits = self.model(tokens[:, fed : fed + chunk], start_pos=self.fill)[:, -1]
            self.fill += chunk
            fed += chunk
        return logits

    def steps(self, tokens: torch.Tensor, first_pos: int, decode=None):
        """decode.decode_steps through this cache, which the caller set up `window` long.

        Each token goes to the next free slot, at that slot's position. `decode` is the one-token
        forward: a DecodeStep, or the model.
        """
        decode = self.model if decode is None else decode
        yield first_pos, self.prefill(tokens, first_pos)
        for pos in range(first_pos + 1, tokens.shape[1]):
            self.make_room()
            # decode.decode_one_token, but the token goes to the next free slot, not pos - 1
            logits = decode(tokens[:, pos - 1 : pos], start_pos=self.fill)[:, -1]
            self.fill += 1
            yield pos, logits


# --kv-cache's choices: a name -> the dtype its keys and values are stored in. None means the
# activations' dtype. A smaller one means less to read a step at long lengths.
KV_CACHES = {"same": None, "bfloat16": torch.bfloat16, "int8": torch.int8}
# The dtypes stored with more than keys and values, and the class that stores each. Any other
# dtype is stored by model.KVCache.
CACHE_CLASSES = {torch.int8: Int8KVCache}


def add_kv_cache_flag(parser: ArgumentParser):
    """--kv-cache, its choices and help read from KV_CACHES, so a new entry needs no edit here."""
    names = [name for name in KV_CACHES if KV_CACHES[name] is not None]
    parser.add_argument(
        "--kv-cache",
        choices=tuple(KV_CACHES),
        default="same",
        help=f"the KV cache's dtype, for LLaMA models: same (as the activations, default), "
        f"{', '.join(names)}. A smaller one reads less a step at long lengths.",
    )


def check_sink_cache(kv_cache: str):
    """UserError for a --kv-cache whose cached keys --sink-tokens cannot move. SinkCache turns
    keys and values only, not the extra tensors of a CACHE_CLASSES class."""
    if KV_CACHES[kv_cache] in CACHE_CLASSES:
        raise UserError(
            f"--sink-tokens moves cached keys, which an {kv_cache} --kv-cache cannot turn"
        )


def setup_cache(model, max_batch_size: int, max_seq_len: int, dtype=None):
    """model.setup_cache with the class CACHE_CLASSES gives `dtype`, else model.KVCache of that
    dtype (None: the activations')."""
    cache = CACHE_CLASSES.get(dtype, KVCache)
    return model.setup_cache(max_batch_size, max_seq_len, dtype=dtype, cache=cache)
