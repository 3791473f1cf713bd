"""A synthetic retrieval task: multi-query associative recall (Zoology's MQAR). Rows come from a
seed, so it needs no dataset and no tokenizer."""

import numpy as np
import torch
import torch.nn.functional as F

from data.loader import _to_device
from picollama.cli import UserError

FILLER = 0  # Token 0 pads a row. Keys are 1..keys, values keys+1..keys+values.
EVAL_SEED = 20231208  # The validation rows are the same for every run and seed.


class RetrievalTask:
    """Rows of 2-token slots: a block of `pairs` key–value slots with distinct keys, filler, and
    query slots. A query repeats a key and its value. Only a query's value is a target. Only the
    key's earlier occurrence predicts it, so chance is 1/values."""

    def __init__(self, keys: int, values: int, pairs: int):
        if pairs > keys:
            raise UserError(
                f"data.retrieval_pairs ({pairs}) exceeds data.retrieval_keys ({keys}): keys are "
                "distinct"
            )
        self.keys, self.values, self.pairs = keys, values, pairs

    @property
    def vocab_size(self) -> int:
        return 1 + self.keys + self.values

    def min_length(self) -> int:
        """The shortest row: the key block and one query of each key."""
        return 4 * self.pairs

    def check_length(self, length: int):
        """UserError unless a row of `length` tokens is at least min_length()."""
        if length < self.min_length():
            raise UserError(
                f"a retrieval row of {length} tokens cannot hold {self.pairs} pairs and their "
                "queries"
            )

    def _block(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(count, pairs) keys, distinct in a row, and their values."""
        keys = np.argsort(rng.random((count, self.keys)), axis=1)[:, : self.pairs] + 1
        values = rng.integers(0, self.values, size=(count, self.pairs)) + 1 + self.keys
        return keys, values

    def train_rows(self, rng: np.random.Generator, count: int, length: int, filler: float = 0.0):
        """(count, length) rows and the mask of their targets. The key block starts at a random slot
        in the first half of the row. Every slot after it queries one of its keys, drawn at random,
        so a row has many queries. With probability `filler` a slot is filler instead. That leaves
        gaps between keys and queries, as evaluation rows have."""
        self.check_length(length)
        slots = length // 2
        keys, values = self._block(rng, count)
        starts = rng.integers(0, (slots - self.pairs) // 2 + 1, size=count)
        picks = rng.integers(0, self.pairs, size=(count, slots))
        slot = np.arange(slots)
        offset = slot[None, :] - starts[:, None]  # A slot's place relative to the key block.
        index = np.where((offset >= 0) & (offset < self.pairs), offset, picks)
        slot_keys = np.take_along_axis(keys, index.clip(0, self.pairs - 1), axis=1)
        slot_values = np.take_along_axis(values, index.clip(0, self.pairs - 1), axis=1)
        gaps = offset < 0
        queries = offset >= self.pairs
        if filler:  # Drawn only then, so rows without filler match earlier versions.
            gaps |= queries & (rng.random((count, slots)) < filler)
            queries &= ~gaps
        slot_keys[gaps] = FILLER
        slot_values[gaps] = FILLER
        return self._rows(slot_keys, slot_values, queries, length)

    def eval_rows(
        self, rng: np.random.Generator, count: int, length: int, distance: int | None = None
    ):
        """(count, length) rows and their target mask. The key block comes first, then each key is
        queried once, in order, `distance` tokens after it (even, at least 2·pairs). With None, the
        key block goes anywhere and the queries last, so distances run up to the row's length.
        Filler goes elsewhere."""
        slots, block = length // 2, self.pairs
        if distance is None:
            self.check_length(length)
            starts = rng.integers(0, slots - 2 * block + 1, size=count)
            query_starts = np.full(count, slots - block)
        else:
            if distance % 2 or distance < 2 * block or distance + 2 * block > 2 * slots:
                raise UserError(
                    f"a query distance must be even, at least {2 * block} and fit a row of "
                    f"{length}, not {distance}"
                )
            starts = rng.integers(0, slots - block - distance // 2 + 1, size=count)
            query_starts = starts + distance // 2
        keys, values = self._block(rng, count)
        slot_keys = np.full((count, slots), FILLER)
        slot_values = np.full((count, slots), FILLER)
        queries = np.zeros((count, slots), dtype=bool)
        rows = np.arange(count)[:, None]
        for first, is_query in ((starts, False), (query_starts, True)):
            columns = first[:, None] + np.arange(block)
            slot_keys[rows, columns], slot_values[rows, columns] = keys, values
            queries[rows, columns] = is_query
        return self._rows(slot_keys, slot_values, queries, length)

    @staticmethod
    def _rows(slot_keys, slot_values, queries, length) -> tuple[np.ndarray, np.ndarray]:
        count, slots = slot_keys.shape
        rows = np.full((count, length), FILLER, dtype=np.int64)
        rows[:, 0 : 2 * slots : 2], rows[:, 1 : 2 * slots : 2] = slot_keys, slot_values
        targets = np.zeros((count, length), dtype=bool)
        targets[:, 1 : 2 * slots : 2] = queries
        return rows, targets

    def fixed_batches(
        self, count: int, batch_size: int, length: int, distance=None, seed=EVAL_SEED
    ) -> list:
        """`count` fixed (x, y) evaluation batches, x of `length` tokens, the same for a seed."""
        rows, targets = self.eval_rows(
            np.random.default_rng(seed), count * batch_size, length + 1, distance
        )
        return [
            _to_device(rows[i : i + batch_size], "cpu", ~targets[i : i + batch_size])
            for i in range(0, len(rows), batch_size)
        ]


class RetrievalBatches:
    """Training batches of the retrieval task. Like RandomBatches, they are seeded, resumable, and
    the same global batch on every rank (train.py keeps each rank's rows). y is -100 but at the
    queries' values."""

    def __init__(
        self,
        task: RetrievalTask,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        device="cpu",
        filler=0.0,
    ):
        task.check_length(seq_len + 1)
        self.task, self.batch_size, self.seq_len = task, batch_size, seq_len
        self.device, self.filler = device, filler
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0])))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, targets = self.task.train_rows(
            self.rng, self.batch_size, self.seq_len + 1, self.filler
        )
        return _to_device(rows, self.device, ~targets)

    def state_dict(self) -> dict:
        return {"task": "retrieval", "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if state.get("task") != "retrieval":
            raise UserError(
                "the checkpoint's loader state is not the retrieval task's; resume with its "
                "data.task"
            )
        self.rng.bit_generator.state = state["rng"]


@torch.no_grad()
def retrieval_metrics(model, batches, device) -> dict:
    """Loss and accuracy (argmax) over the batches' targets. `model(x)` gives logits."""
    loss_sum, right, count = 0.0, 0, 0
    for x, y in batches:
        logits, y = model(x.to(device)).float(), y.to(device)
        mask = y != -100
        loss_sum += F.cross_entropy(logits[mask], y[mask], reduction="sum").item()
        right += (logits[mask].argmax(-1) == y[mask]).sum().item()
        count += int(mask.sum())
    return {"val_loss": loss_sum / count, "val_acc": right / count}
