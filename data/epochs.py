"""Training windows in epochs. Each pass over the split takes every window once, in random order,
from a random phase. So no text is drawn twice before the rest is drawn once. These are the
"shuffled epochs" of data-limited training. RandomBatches draws with replacement instead."""

import numpy as np

from data.loader import RandomBatches


class EpochBatches(RandomBatches):
    """RandomBatches taking shuffled windows in turn from a random phase, new each epoch with a new
    order. Windows of seq_len+1 tokens start seq_len apart: one's last target is the next one's
    first input."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.order = np.zeros(0, dtype=np.int64)  # This epoch's window starts.
        self.taken = 0  # How many of them batches have used.

    def starts(self) -> np.ndarray:
        starts = []
        while len(starts) < self.batch_size:
            if self.taken == len(self.order):
                self.new_epoch()
            take = min(self.batch_size - len(starts), len(self.order) - self.taken)
            starts.extend(self.order[self.taken : self.taken + take])
            self.taken += take
        return np.array(starts, dtype=np.int64)

    def new_epoch(self):
        phase = int(self.rng.integers(0, self.seq_len))
        last = len(self.tokens) - self.seq_len - 1  # The last start of a whole window.
        self.order = self.rng.permutation(np.arange(phase, last + 1, self.seq_len))
        self.taken = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "order": self.order.tolist(), "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        """A state of RandomBatches (a checkpoint from before data.sampling) goes on from its
        generator with a new epoch."""
        super().load_state_dict(state)
        self.order = np.array(state.get("order", []), dtype=np.int64)
        self.taken = state.get("taken", 0)
