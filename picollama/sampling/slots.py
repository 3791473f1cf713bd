"""Continuous batching: rows in the slots of one KV cache, each at its own position, joining (their
prompt prefilled alone) and leaving between decode steps, as llama.cpp's server slots do."""

from dataclasses import dataclass, field

import torch

from picollama.sampling.caches import setup_cache
from picollama.sampling.decode import prefill
from picollama.sampling.fused_step import DecodeStep, cache_tensors
from picollama.sampling.rows import Row, RowSampler, Token, token_logprobs

SHORTEST_CACHE = 256  # positions the cache holds at least: it grows by doubling from there


@dataclass
class Slot:
    """A row being decoded: its Row, its callbacks (on_token(Token) -> whether it is over;
    on_done(reason)), its generator, its new tokens, the positions its cache holds, the token it
    feeds next."""

    row: Row
    on_token: object
    on_done: object
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    last: int = 0

    @property
    def end(self) -> int:
        """The positions its prompt and its longest answer take."""
        return len(self.row.prompt) + self.row.sampling.max_new_tokens


class Slots:
    """The rows decoding now, in slots 0..n-1 of one KV cache (model's layers, kv_dtype, batch the
    power of two at or above n, length a power of two holding the longest row): join() prefills a
    row and chooses its first token, step_all() chooses the next token of every row, a row that ends
    leaves and the last row moves into its slot. The cache is resized (copied) as rows come, go
    and grow; the step is compiled for each batch size."""

    def __init__(self, model, step: DecodeStep, vocab_limit: int | None = None):
        self.model, self.step, self.vocab_limit = model, step, vocab_limit
        self.slots: list[Slot] = []
        self.caches: list[tuple] = []  # each layer's cache_tensors

    @property
    def rows(self) -> list[Row]:
        return [slot.row for slot in self.slots]

    @torch.inference_mode()
    def join(self, row: Row, on_token, on_done):
        """Prefill the row's prompt alone into a new slot and hand over its first token."""
        seed = row.sampling.seed
        generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        slot = Slot(row, on_token, on_done, generator, position=len(row.prompt))
        if row.sampling.max_new_tokens == 0:
            return on_done("length")
        self.fit(len(self.slots) + 1, slot.position + 1, slot.end)
        setup_cache(self.model, 1, slot.position, self.step.kv_dtype)
        try:
            prompt = torch.tensor([row.prompt], device=self.device)
            logits = prefill(self.model, prompt, slot.position)
            index = len(self.slots)
            for cache, attention in zip(self.caches, self.step.attentions):
                for tensor, prefilled in zip(cache, cache_tensors(attention.cache)):
                    tensor[index, :, : slot.position] = prefilled[0, :, : slot.position]
        finally:
            self.model.reset_cache()
        self.slots.append(slot)
        self.hand_over(logits)

    @torch.inference_mode()
    def step_all(self):
        """One token for every row: each fed at its own position."""
        count = len(self.slots)
        self.fit(count, 1)
        padding = len(self.caches[0][0]) - count  # rows of the cache's batch with no slot
        fed = [slot.last for slot in self.slots] + [0] * padding
        fed += [slot.position for slot in self.slots] + [0] * padding
        ids, positions = torch.tensor(fed, device=self.device).view(2, -1)
        logits = self.step.rows(ids, positions, self.caches)[:count]
        for slot in self.slots:
            slot.position += 1
        self.hand_over(logits)

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def hand_over(self, logits: torch.Tensor):
        """Choose a token for each of the last len(logits) rows from its logits, hand it over; the
        rows that end leave."""
        slots = self.slots[len(self.slots) - len(logits) :]
        if self.vocab_limit is not None:
            logits[:, self.vocab_limit :] = float("-inf")
        samplings = [slot.row.sampling for slot in slots]
        sampler = RowSampler(samplings, logits.device, [slot.generator for slot in slots])
        chosen = sampler(logits, [True] * len(slots))
        top = max(slot.row.logprobs or 0 for slot in slots)
        wanted = any(slot.row.logprobs is not None for slot in slots)
        picked, tops = token_logprobs(logits, chosen, top) if wanted else (None, None)
        ended = {}
        for i, (slot, token) in enumerate(zip(slots, chosen.tolist())):
            reason = self.give(slot, i, token, picked, tops)
            if reason is not None:
                ended[id(slot)] = reason
        if ended:
            self.leave(ended)

    def give(self, slot: Slot, i: int, token: int, picked, tops) -> str | None:
        """Hand token to the slot's row (row i of the logits): why the row ends ("stop": a stop
        id, not handed over; "halted": on_token said so; "length"), or None."""
        row = slot.row
        if token in row.stop_ids:
            return "stop"
        slot.tokens.append(token)
        slot.last = token
        given = Token(token)
        if row.logprobs is not None:
            given = Token(token, picked[i], tuple(tops[i][: row.logprobs]))
        if slot.on_token(given):
            return "halted"
        return "length" if len(slot.tokens) >= row.sampling.max_new_tokens else None

    def leave(self, ended: dict[int, str]):
        """The rows ended (id(slot) -> why) leave; the others move down into slots 0..n-1 (each
        into a slot below its own, so none is overwritten before it is read)."""
        kept = [slot for slot in self.slots if id(slot) not in ended]
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
        """A cache for `count` rows (its batch the power of two at or above, padded_batch), `length`
        positions and every row's next: the one there where it is that batch and long enough, else
        a new one (the rows there copied over), its length a power of two but no longer than the
        longest row can grow (`end`, a joining row's, or a row's there): what the memory check
        counted."""
        batch = padded_batch(count)
        length = max([length] + [slot.position + 1 for slot in self.slots])
        if self.caches and len(self.caches[0][0]) == batch and self.caches[0][0].shape[2] >= length:
            return
        end = max([end] + [slot.end for slot in self.slots])
        capacity = min(1 << (max(SHORTEST_CACHE, length) - 1).bit_length(), end)
        setup_cache(self.model, batch, capacity, self.step.kv_dtype)
        caches = [cache_tensors(attention.cache) for attention in self.step.attentions]
        self.model.reset_cache()
        for slot_index, slot in enumerate(self.slots):
            for old, new in zip(self.caches, caches):
                for source, target in zip(old, new):
                    target[slot_index, :, : slot.position] = source[slot_index, :, : slot.position]
        self.caches = caches


def padded_batch(rows: int) -> int:
    """The batch of the cache (and the step) for `rows` rows: the power of two at or above."""
    return 1 << (rows - 1).bit_length()
