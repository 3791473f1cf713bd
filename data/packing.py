"""Documents packed whole into training rows by best fit. Positions restart in each document, and
a block-causal mask keeps attention inside it. Conversations bring their supervised tokens.
Batches are seeded."""

import bisect

import numpy as np
import torch

from data.loader import doc_offsets, open_mask, open_tokens
from picollama.cli import UserError

PAD = 0  # After a row's last document. Never a target, and a document of its own.


def best_fit(lengths, capacity: int) -> list[list[int]]:
    """The indices of items of these lengths (each <= capacity) in bins of `capacity`. Each item,
    in order, goes into the fullest bin that still holds it, or a new one."""
    bins, free = [], []  # Sorted (space left, bin) of bins with room.
    for item, length in enumerate(lengths):
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            bins.append([item])
            space, where = capacity - length, len(bins) - 1
        else:
            space, where = free.pop(at)
            bins[where].append(item)
            space -= length
        if space > 0:
            bisect.insort(free, (space, where))
    return bins


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The (B, T, T) bool mask of rows whose documents start where positions (B, T) restart at 0.
    Each query sees the keys of its own document up to itself, none of another's."""
    document = (positions == 0).cumsum(-1)
    seqlen = positions.shape[-1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=positions.device).tril()
    return (document[:, :, None] == document[:, None, :]) & causal


def as_batch(rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, positions), (B, T) int64, of rows (tokens, supervised, positions) of T + 1 tokens.
    y is x shifted by one, and -100 (no target) where the token is not supervised."""
    tokens, supervised, positions = (torch.from_numpy(np.stack(part)) for part in zip(*rows))
    y = tokens[:, 1:].masked_fill(~supervised[:, 1:], -100)
    return tokens[:, :-1].contiguous(), y, positions[:, :-1].contiguous()


class Documents:
    """A split's documents as the pieces rows hold, (start, length) each. In a conversations
    dataset the pieces are its conversations, and the tokens its mask supervises are the targets.
    One longer than a row is cut to the row, and dropped if no target is left. A text dataset cuts
    its documents into row-long pieces, every token a target. A piece's first token never is, since
    nothing of its document comes before it."""

    def __init__(self, data_dir, split: str, row: int, conversations: bool):
        self.tokens = open_tokens(data_dir, split)
        self.supervised = open_mask(data_dir, split) if conversations else None
        starts = doc_offsets(data_dir, split)
        lengths = np.diff(np.append(starts, len(self.tokens)))
        self.cut = int((lengths > row).sum())  # Documents longer than a row.
        self.dropped = 0
        if conversations:
            self.starts, self.lengths = starts, np.minimum(lengths, row)
            keep = self.targets() > 0
            self.dropped = int((~keep).sum())
            self.starts, self.lengths = self.starts[keep], self.lengths[keep]
        else:
            self.starts, self.lengths = pieces(starts, lengths, row)
        self.documents = len(starts)
        if not len(self.starts):
            problem = f"the {split} split of {data_dir} has no document of two tokens"
            if conversations:
                problem = (
                    f"the {split} split of {data_dir} holds {len(starts):,} conversation(s), "
                    f"{self.cut:,} of them longer than a row (train.seq_len + 1 = {row} tokens), "
                    f"and none has an assistant token in its first {row} tokens"
                )
                if self.cut < len(starts):  # Some are whole in a row: their masks hold nothing.
                    problem += " (its loss mask supervises none of them; prepare it again)"
            raise UserError(f"{problem}: nothing to train on")

    def __len__(self) -> int:
        return len(self.starts)

    def targets(self) -> np.ndarray:
        """How many targets each piece holds: its supervised tokens but its first."""
        mask = np.asarray(self.supervised, dtype=np.uint8)
        inside = np.add.reduceat(mask, self.starts, dtype=np.int64) - mask[self.starts]
        full = np.diff(np.append(self.starts, len(mask)))
        for i in np.flatnonzero(self.lengths < full):  # Cut ones count their row's part.
            start = self.starts[i]
            inside[i] = int(mask[start + 1 : start + self.lengths[i]].sum())
        return inside

    def row(self, pieces: list[int], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, supervised, positions) of a row of `length` holding these pieces in order.
        PAD fills the rest, positions from 0."""
        tokens = np.full(length, PAD, dtype=np.int64)
        supervised = np.zeros(length, dtype=bool)
        positions = np.empty(length, dtype=np.int64)
        at = 0
        for i in pieces:
            start, n = int(self.starts[i]), int(self.lengths[i])
            tokens[at : at + n] = self.tokens[start : start + n]
            if self.supervised is None:
                supervised[at + 1 : at + n] = True
            else:
                supervised[at + 1 : at + n] = self.supervised[start + 1 : start + n] != 0
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(length - at)
        return tokens, supervised, positions


def pieces(starts: np.ndarray, lengths: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of documents cut into pieces of `row` tokens, the last one shorter.
    One-token pieces hold no target and are left out."""
    counts = -(-lengths // row)
    document = np.repeat(np.arange(len(starts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = (np.arange(len(document)) - first) * row
    sizes = np.minimum(row, lengths[document] - offsets)
    keep = sizes > 1
    return (starts[document] + offsets)[keep], sizes[keep]


class PackedBatches:
    """Batches of batch_size rows of seq_len + 1 tokens, packed from whole pieces. Each epoch
    shuffles the pieces by seed, packs them by best fit, and shuffles the rows. A batch may run on
    into the next epoch. Under torchrun every rank draws the same global batch and keeps its rows.
    The state is the seed, the epoch and the next row. The epoch's rows are packed again from it."""

    def __init__(self, documents: Documents, batch_size: int, seq_len: int, seed: int = 0):
        self.documents, self.batch_size, self.length = documents, batch_size, seq_len + 1
        self.seed, self.epoch, self.next = seed, 0, 0
        self.rows = self.epoch_rows()

    def epoch_rows(self) -> list[list[int]]:
        """The pieces of each row of this epoch, in the order they are drawn."""
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.documents))
        packed = best_fit(self.documents.lengths[order].tolist(), self.length)
        return [order[packed[i]].tolist() for i in rng.permutation(len(packed))]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, positions), each (batch_size, seq_len) int64, on the CPU."""
        rows = []
        while len(rows) < self.batch_size:
            if self.next == len(self.rows):
                self.epoch, self.next = self.epoch + 1, 0
                self.rows = self.epoch_rows()
            rows.append(self.documents.row(self.rows[self.next], self.length))
            self.next += 1
        return as_batch(rows)

    def state_dict(self) -> dict:
        """Plain-Python state that load_state_dict resumes exactly."""
        return {"task": "packed", "seed": self.seed, "epoch": self.epoch, "row": self.next}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a state_dict: the same rows, in the same order, from the same one."""
        if state.get("task") != "packed":
            raise UserError(
                "the checkpoint's loader state is not of packed documents: resume it on the "
                "dataset and data.pack_documents it was trained with"
            )
        self.seed, self.epoch, self.next = state["seed"], state["epoch"], state["row"]
        self.rows = self.epoch_rows()


def validation_batches(documents: Documents, batch_size: int, seq_len: int, most: int) -> list:
    """The first `most` (x, y, positions) batches of the held-out pieces, the same every evaluation.
    The pieces, in order, are packed by best fit into rows of seq_len + 1. A batch has batch_size
    rows, the last maybe fewer."""
    rows = best_fit(documents.lengths.tolist(), seq_len + 1)[: batch_size * most]
    return [
        as_batch([documents.row(row, seq_len + 1) for row in rows[i : i + batch_size]])
        for i in range(0, len(rows), batch_size)
    ]
