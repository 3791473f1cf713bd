"""Split a corpus into train and val by whole documents, seeded: at once, or block by block for a
long corpus."""

import numpy as np

from data.sources import utf8_size
from picollama.cli import UserError

VAL_FRACTION = 0.05
SEED = 0


def split_documents(
    documents: list[str], val_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Hold out whole documents, seeded: val gets a document and at least val_fraction of bytes."""
    if len(documents) == 1:  # A single book. Hold out its tail, cut at a line break.
        text = documents[0]
        if len(text) < 2:
            raise UserError(
                "the corpus is a single document of one character; nothing to split into train and "
                "val"
            )
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut
        cut = min(max(cut, 1), len(text) - 1)
        tail = len(text) - cut
        print(f"note: the corpus is a single document; its last {tail:,} characters become val")
        return [text[:cut]], [text[cut:]]
    sizes = [utf8_size(d) for d in documents]
    target = val_fraction * sum(sizes)
    order = np.random.default_rng(seed).permutation(len(documents))
    val = []
    val_bytes = 0
    for i in order:  # In seeded order, take documents that keep val under twice the target.
        if val_bytes >= target or len(val) == len(documents) - 1:
            break
        if val_bytes + sizes[i] <= 2 * target:
            val.append(i)
            val_bytes += sizes[i]
    rest = sorted(set(range(len(documents))) - set(val), key=lambda i: sizes[i])
    # If nothing was small enough, top up with the smallest.
    while (val_bytes < target or not val) and len(rest) > 1:
        val.append(rest.pop(0))
        val_bytes += sizes[val[-1]]
    val_set = set(val)
    return (
        [d for i, d in enumerate(documents) if i not in val_set],
        [d for i, d in enumerate(documents) if i in val_set],
    )


class Splitter:
    """Splits each block of a streamed corpus into train and val documents, in order, seeded.

    A corpus of a single block is split as split_documents does. In a longer one, val takes whole
    documents of each block in seeded order while they fit under VAL_FRACTION of the bytes read so
    far. What a block leaves unused carries over to the next. So val holds about VAL_FRACTION of
    the bytes, however large the documents. The last block gives val its smallest document if val
    has none yet. `seen` and `val`, in bytes, are all it remembers."""

    def __init__(self, seen: int = 0, val: int = 0):
        self.seen, self.val = seen, val

    def __call__(
        self, index: int, texts: list[str], sizes: list[int], last: bool
    ) -> tuple[list[str], list[str]]:
        if index == 0 and last:
            train, val = split_documents(texts, VAL_FRACTION, SEED)
        else:
            budget = VAL_FRACTION * (self.seen + sum(sizes)) - self.val
            chosen = set()
            for i in np.random.default_rng([SEED, index]).permutation(len(texts)):
                if sizes[i] <= budget:
                    chosen.add(i)
                    budget -= sizes[i]
            if last and not self.val and not chosen:
                chosen.add(int(np.argmin(sizes)))
            train = [text for i, text in enumerate(texts) if i not in chosen]
            val = [text for i, text in enumerate(texts) if i in chosen]
        self.seen += sum(sizes)
        self.val += sum(map(utf8_size, val))
        return train, val


class ChatSplitter:
    """Chooses the held-out conversations of each block of a chat dataset, by tokens, seeded.

    The rule: in seeded order, a block's conversation goes to val when val then stays within
    VAL_FRACTION of the tokens read so far, and within VAL_FRACTION of the conversations read so
    far. So val holds about VAL_FRACTION of the tokens. A conversation longer than val's share of
    the tokens never goes there, and however long some conversations are, val never takes more
    than its share of the conversations. If val has none at the last block, it takes that block's
    shortest conversation. The four counts are all it remembers, so a resumed run splits alike."""

    def __init__(self, tokens: int = 0, val_tokens: int = 0, count: int = 0, val_count: int = 0):
        self.tokens, self.val_tokens = tokens, val_tokens
        self.count, self.val_count = count, val_count

    def __call__(self, index: int, lengths: list[int], last: bool) -> list[bool]:
        """Whether each conversation of block `index`, of these token lengths, is held out."""
        self.tokens += sum(lengths)
        self.count += len(lengths)
        budget = VAL_FRACTION * self.tokens - self.val_tokens
        room = VAL_FRACTION * self.count - self.val_count
        flags = [False] * len(lengths)
        for i in np.random.default_rng([SEED, index]).permutation(len(lengths)):
            if room < 1:
                break
            if lengths[i] <= budget:
                flags[i] = True
                budget -= lengths[i]
                room -= 1
        if last and not self.val_count and not any(flags) and self.count > 1:
            flags[int(np.argmin(lengths))] = True
        self.val_tokens += sum(n for n, flag in zip(lengths, flags) if flag)
        self.val_count += sum(flags)
        return flags
