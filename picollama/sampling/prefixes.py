"""Kept prefixes: the keys and values of token sequences already run, reused by later prompts.

A prompt that starts with a kept sequence prefills only the tokens after it. So a conversation
costs its new tokens only, and a system prompt shared by clients is run once. llama.cpp's server
does this with cache_prompt. A position's keys and values depend only on the tokens up to it, so
the kept ones are what a cold prefill writes there, within float rounding. That holds where
cached keys stay put: not with dynamic NTK, whose frequencies follow the length, nor in attention
sinks' cache, whose keys move (reusable says so).

The store is bounded in bytes and forgets the least recently used sequence first. It copies
tensors into and out of KV caches and runs no model. The decode loops prefill the rest: the
static one (decode.decode_rows, through reuse_rows and keep_rows) and continuous batching
(slots.Slots). Nothing here knows about HTTP or chat templates.
"""

from dataclasses import dataclass

import torch

from picollama.components.length import length_dependent

# Each layer's cache tensors, batch first and positions third: keys, values, an int8 cache's
# scales, FoX's forget-gate sums. A kept sequence's tensors have no batch: (heads, length, ...).
Layers = list[tuple[torch.Tensor, ...]]


def reusable(args, sinks=None) -> bool:
    """Whether kept keys and values are those a cold prefill would write.

    Not with dynamic NTK, which turns every cached key as the length grows. Not with attention
    sinks (`sinks` given), whose cache moves its keys to other positions.
    """
    return sinks is None and not length_dependent(args)


def common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens two id sequences share from their start."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def model_caches(model) -> Layers:
    """The tensors of the model's KV cache, as setup_cache made them, a tuple a layer."""
    return [tuple(layer.attention.cache.buffers()) for layer in model.layers]


def row_of(caches: Layers, row: int, length: int) -> Layers:
    """Views of one row's first `length` positions in caches (no batch)."""
    return [tuple(t[row, :, :length] for t in layer) for layer in caches]


def load(layers: Layers, length: int, caches: Layers, row: int = 0):
    """Copy the first `length` positions of a kept sequence's layers into row `row` of caches."""
    for kept, cache in zip(layers, caches):
        for source, target in zip(kept, cache):
            target[row, :, :length] = source[:, :length]


@dataclass(eq=False)  # an entry is itself
class Kept:
    """A kept sequence: its token ids (on the CPU), its copied layers, and their bytes."""

    ids: torch.Tensor
    layers: Layers
    bytes: int


class PrefixStore:
    """Kept sequences, at most `capacity` bytes of their keys and values together.

    The least recently used is forgotten first, and at most `entries` are kept (None: as many as
    fit). A sequence longer than the capacity keeps its first tokens. One that is the start of a
    kept one adds nothing, and a kept one that starts the new one is dropped, so a conversation
    holds one entry. `count`, `tokens` and `bytes` say what is kept, and `reused` counts the
    prompt tokens that were not prefilled again.
    """

    def __init__(self, capacity: int, entries: int | None = None):
        self.capacity, self.most = capacity, entries
        self.kept: list[Kept] = []  # the least recently used first
        self.count = self.tokens = self.bytes = self.reused = 0

    def longest(self, ids: torch.Tensor, others=()) -> tuple[int, Layers | None]:
        """The longest start of `ids` kept here or in `others`, and its layers: (0, None) if none.

        `others` are (ids, layers) pairs not kept here: the rows decoding now. A kept entry used
        becomes the most recent.
        """
        best, layers, used = 0, None, None
        for kept in self.kept:
            n = common_length(kept.ids, ids)
            if n > best:
                best, layers, used = n, kept.layers, kept
        for other_ids, other_layers in others:
            n = common_length(other_ids, ids)
            if n > best:
                best, layers, used = n, other_layers, None
        if used is not None:
            self.touch(used)
        return best, layers

    def counted(self, length: int):
        """A prompt reused `length` kept tokens (0: none)."""
        self.reused += length

    def keep(self, ids: torch.Tensor, layers: Layers):
        """Keep a copy of a sequence's layers (views of a cache row), under its token ids.

        The oldest entries are dropped first to make room, so the store never holds more than its
        capacity.
        """
        ids = ids.cpu()
        per_token = sum(t.element_size() * t[:, :1].numel() for layer in layers for t in layer)
        length = min(len(ids), self.capacity // max(per_token, 1))
        if length == 0:
            return
        ids = ids[:length]
        for kept in list(self.kept):
            n = common_length(kept.ids, ids)
            if n == length:  # already kept, within a sequence as long or longer
                return self.touch(kept)
            if n == len(kept.ids):  # the start of this one: this one replaces it
                self.drop(kept)
        size = per_token * length
        while self.kept and self.full(size):
            self.drop(self.kept[0])
        copied = [tuple(t[:, :length].clone() for t in layer) for layer in layers]
        self.kept.append(Kept(ids.clone(), copied, size))
        self.count += 1
        self.tokens += length
        self.bytes += size

    def full(self, size: int) -> bool:
        """Whether a new entry of `size` bytes needs the oldest dropped first."""
        over = self.bytes + size > self.capacity
        return over or (self.most is not None and len(self.kept) >= self.most)

    def touch(self, kept: Kept):
        self.kept.remove(kept)
        self.kept.append(kept)

    def drop(self, kept: Kept):
        self.kept.remove(kept)
        self.count -= 1
        self.tokens -= len(kept.ids)
        self.bytes -= kept.bytes

    def clear(self):
        for kept in list(self.kept):
            self.drop(kept)


def reuse_rows(store: PrefixStore | None, model, tokens: torch.Tensor, first_pos: int) -> int:
    """Copy into the model's KV cache (set up) the start of each row's tokens the store keeps.

    All rows share one length: the shortest found, and at most first_pos - 1, since the prefill
    runs one token at least. Returns that length, the positions the prefill skips (0: none).
    """
    if store is None or first_pos < 2:
        return 0
    found = [store.longest(row) for row in tokens[:, : first_pos - 1].cpu()]
    length = min(n for n, _ in found)
    if length:
        caches = model_caches(model)
        for row, (_, layers) in enumerate(found):
            load(layers, length, caches, row)
    for _ in found:
        store.counted(length)
    return length


def keep_rows(store: PrefixStore, model, tokens: torch.Tensor, lengths: list[int]):
    """Keep each row's first lengths[row] tokens, whose keys and values the model's cache holds."""
    caches = model_caches(model)
    for row, length in enumerate(lengths):
        if length > 0:
            store.keep(tokens[row, :length], row_of(caches, row, length))
