"""Continuous batching: rows in the slots of one KV cache, each at its own position.

Rows join between steps, their prompt prefilled alone, and leave as they end. So do llama.cpp's
server slots. This is the one place that feeds each row at its own position. The choice and the
hand-over are the static loop's: the one Sampler (sampler.py) and rows.hand_over. The serve
engine drives it (Engine.run_continuous). It knows nothing about HTTP or text. With a
PrefixStore (prefixes.py) a joining row prefills only what follows its longest kept prefix, and
a row that leaves is kept there.
"""

from dataclasses import dataclass

import torch

from picollama.kernels.caches import setup_cache
from picollama.kernels.fused_step import CACHE_NAMES, DecodeStep, cache_tensors
from picollama.sampling.decode import prefill
from picollama.sampling.prefixes import PrefixStore, common_length, load, model_caches, row_of
from picollama.sampling.rows import Row, RowState, hand_over
from picollama.sampling.sampler import Sampler

SHORTEST_CACHE = 256  # positions the cache holds at least: it grows by doubling from there


@dataclass(eq=False)  # a row is itself: two alike are still two
class Slot(RowState):
    """A row being decoded: its RowState, and what continuous batching adds to it.

    on_done(reason) hears why it ended. Its generator lasts across steps. position counts the
    positions its cache holds. last is the token it feeds next.
    """

    on_done: object = None
    generator: torch.Generator | None = None
    position: int = 0
    last: int = 0

    def take(self, token: int, logprob: float | None = None, top=()) -> str | None:
        """RowState.take, and the token is the one fed next."""
        self.last = token
        return super().take(token, logprob, top)

    @property
    def end(self) -> int:
        """The positions its prompt and its longest answer take."""
        return len(self.row.prompt) + self.row.sampling.max_new_tokens

    @property
    def ids(self) -> torch.Tensor:
        """The token ids whose keys and values its cache row holds: its prompt, then its answer."""
        return torch.tensor((self.row.prompt + self.tokens)[: self.position])


class Slots:
    """The rows decoding now, in slots 0..n-1 of one KV cache.

    The cache has the model's layers and the step's kv_dtype. Its batch is the power of two at or
    above n. Its length is a power of two that holds the longest row. join() prefills a row and
    chooses its first token. advance() chooses the next token of every row. A row that ends
    leaves, and the rows after it move down. The cache is copied to a new size as rows come, go
    and grow. The step is compiled for each batch size. prefixes: where prompts find kept
    prefixes and rows that leave are kept (None: nowhere).
    """

    def __init__(self, model, step: DecodeStep, vocab_limit: int | None = None, prefixes=None):
        self.model, self.step, self.vocab_limit = model, step, vocab_limit
        self.prefixes: PrefixStore | None = prefixes
        self.slots: list[Slot] = []
        self.caches: list[tuple] = []  # each layer's cache_tensors
        self.held: dict[int, torch.Tensor] = {}  # a free cache row -> the ids its positions hold

    @property
    def rows(self) -> list[Row]:
        return [slot.row for slot in self.slots]

    @torch.inference_mode()
    def join(self, row: Row, on_token, on_done):
        """Prefill the row's prompt alone into a new slot, and choose its first token.

        The prompt's longest prefix kept, or held by a row decoding now, is not prefilled again.
        """
        seed = row.sampling.seed
        generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        slot = Slot(row, on_token, on_done=on_done, generator=generator, position=len(row.prompt))
        if row.sampling.max_new_tokens == 0:
            return on_done("length")
        self.fit(len(self.slots) + 1, slot.position + 1, slot.end)
        self.prefill_into(len(self.slots))
        try:
            start = self.reuse(row.prompt)
            prompt = torch.tensor([row.prompt], device=self.device)
            logits = prefill(self.model, prompt, slot.position, start)
        finally:
            self.model.reset_cache()
        self.slots.append(slot)
        self.choose(logits)

    def prefill_into(self, index: int):
        """The model's KV cache becomes row `index` of the slots' cache: a batch of one whose
        tensors are views of that row. A prefill writes there, and nothing is copied after it."""
        setup_cache(self.model, 1, 1, self.step.kv_dtype)
        for attention, tensors in zip(self.step.attentions, self.caches):
            for name, tensor in zip(CACHE_NAMES, tensors):
                setattr(attention.cache, name, tensor[index : index + 1])

    def reuse(self, prompt: list[int]) -> int:
        """Copy into the model's cache the longest start of the prompt, but its last token, that
        the store keeps or a row decoding now holds. How many positions that is.

        Nothing is copied where the cache row the prompt joins holds that start already: the row
        that left it, as a conversation's last turn leaves its next."""
        if self.prefixes is None:
            return 0
        ids = torch.tensor(prompt[:-1])
        decoding = [
            (slot.ids, row_of(self.caches, index, slot.position))
            for index, slot in enumerate(self.slots)
        ]
        length, layers = self.prefixes.longest(ids, decoding)
        held = self.held.pop(len(self.slots), None)
        here = 0 if held is None else common_length(held, ids)
        if here < length:
            load(layers, length, model_caches(self.model))
        length = max(length, here)
        self.prefixes.counted(length)
        return length

    @torch.inference_mode()
    def advance(self):
        """One token for every row, each fed at its own position."""
        count = len(self.slots)
        self.fit(count, 1)
        self.held.clear()  # The step writes position 0 of the rows with no slot.
        padding = len(self.caches[0][0]) - count  # rows of the cache's batch with no slot
        fed = [slot.last for slot in self.slots] + [0] * padding
        fed += [slot.position for slot in self.slots] + [0] * padding
        ids, positions = torch.tensor(fed, device=self.device).view(2, -1)
        logits = self.step.rows(ids, positions, self.caches)[:count]
        for slot in self.slots:
            slot.position += 1
        self.choose(logits)

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def choose(self, logits: torch.Tensor):
        """Choose a token for each of the last len(logits) rows, and hand it over.

        The rows that end leave. The Sampler is made anew each time, since the rows change. Each
        slot keeps its own generator, so its draws go on where they left off.
        """
        slots = self.slots[len(self.slots) - len(logits) :]
        if self.vocab_limit is not None:
            logits[:, self.vocab_limit :] = float("-inf")
        samplings = [slot.row.sampling for slot in slots]
        sampler = Sampler(samplings, logits.device, [slot.generator for slot in slots])
        every = [True] * len(slots)
        ended = hand_over(slots, logits, sampler(logits, every), every)
        if ended:
            self.leave({id(slots[i]): reason for i, reason in ended.items()})

    def leave(self, ended: dict[int, str]):
        """The rows ended (id(slot) -> why) leave, and the others move down into slots 0..n-1.

        Each moves into a slot below its own, so none is overwritten before it is read. The rows
        ended are kept in the store first. One that no row moves into is held where it is, for
        reuse to find until a step writes there.
        """
        kept = [slot for slot in self.slots if id(slot) not in ended]
        for index, slot in enumerate(self.slots):
            if self.prefixes is not None and id(slot) in ended:
                ids = slot.ids
                self.prefixes.keep(ids, row_of(self.caches, index, slot.position))
                if index >= len(kept):  # No row moves there: it holds the slot's keys still.
                    self.held[index] = ids
        for new, slot in enumerate(kept):
            old = self.slots.index(slot)
            if old != new:
                for cache in self.caches:
                    for tensor in cache:
                        tensor[new, :, : slot.position] = tensor[old, :, : slot.position]
        gone = [slot for slot in self.slots if id(slot) in ended]
        self.slots = kept
        for slot in gone:
            slot.on_done(ended[id(slot)])

    def fit(self, count: int, length: int, end: int = 0):
        """A cache for `count` rows, `length` positions and every row's next position.

        Its batch is padded_batch(count). The cache there is kept if it is that batch and long
        enough. Else a new one takes over, the rows copied into it. Its length is a power of two,
        but no longer than the longest row can grow (`end`, or a row's there), as the memory
        check counted, or than twice the cache it replaces. So a conversation whose turns each
        outgrow the last row's end is copied anew at a few turns only, not at each.
        """
        batch = padded_batch(count)
        length = max([length] + [slot.position + 1 for slot in self.slots])
        if self.caches and len(self.caches[0][0]) == batch and self.caches[0][0].shape[2] >= length:
            return
        grown = 2 * self.caches[0][0].shape[2] if self.caches else 0
        end = max([end, grown] + [slot.end for slot in self.slots])
        capacity = min(1 << (max(SHORTEST_CACHE, length) - 1).bit_length(), end)
        setup_cache(self.model, batch, capacity, self.step.kv_dtype)
        caches = [cache_tensors(attention.cache) for attention in self.step.attentions]
        self.model.reset_cache()
        for slot_index, slot in enumerate(self.slots):
            for old, new in zip(self.caches, caches):
                for source, target in zip(old, new):
                    target[slot_index, :, : slot.position] = source[slot_index, :, : slot.position]
        self.caches, self.held = caches, {}


def padded_batch(rows: int) -> int:
    """The batch of the cache and the step for `rows` rows: the power of two at or above."""
    return 1 << (rows - 1).bit_length()
