"""slots.Slots (continuous batching): rows join and leave between steps, each decoded as alone;
decode_ops' attention over a length a row."""

import pytest
import torch

from model import ModelArgs, Transformer
from picollama.kernels.decode_ops import decode_ops
from picollama.kernels.fused_step import DecodeStep
from picollama.sampling.decode import decode_rows
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampling
from picollama.sampling.slots import SHORTEST_CACHE, Slots


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=512)
    return Transformer(ModelArgs(**{**args.to_dict(), "multiple_of": 16})).eval()


def alone(model, row: Row) -> tuple[list[int], str]:
    """The row's tokens and end reason, decoded by itself with the model's forward."""
    reasons = {}
    tokens = decode_rows(model, [row], lambda r, t: False, reasons.__setitem__)[0]
    return tokens, reasons[0]


class Recorder:
    """A row's callbacks: its tokens, why it ended; halts after `halt` tokens where given."""

    def __init__(self, halt: int | None = None):
        self.tokens, self.reason, self.halt = [], None, halt

    def on_token(self, token) -> bool:
        self.tokens.append(token.id)
        return len(self.tokens) == self.halt

    def on_done(self, reason: str):
        self.reason = reason


ROWS = [  # prompts of different lengths, one past the shortest cache, samplers and seeds
    Row([1, 2, 3, 4, 5, 6, 7], Sampling(12, 0.9, seed=1)),
    Row([1], Sampling(30, 0.0)),
    Row([1, 8, 8], Sampling(5, 1.2, top_k=5, seed=2)),
    Row([1 + i % 50 for i in range(SHORTEST_CACHE - 3)], Sampling(20, 1.0, top_p=0.7, seed=1)),
    Row([1, 9, 10, 11], Sampling(9, 0.0)),
]


def test_rows_joining_and_leaving_between_steps_decode_as_they_do_alone(model):
    slots = Slots(model, DecodeStep(model))
    records = [Recorder() for _ in ROWS]
    # rows join at different steps (the cache grows from 1 to 4 rows and past 256 positions),
    # leave at different steps (it shrinks), and the last joins a batch of one
    joins = {0: [0, 1], 2: [2], 4: [3], 25: [4]}
    for step in range(60):
        for i in joins.get(step, []):
            slots.join(ROWS[i], records[i].on_token, records[i].on_done)
        if slots.slots:
            slots.advance()
    assert not slots.slots
    assert [(r.tokens, r.reason) for r in records] == [alone(model, row) for row in ROWS]


def test_a_stop_id_and_a_halting_client_end_a_row_and_free_its_slot(model):
    greedy, _ = alone(model, Row([1, 2], Sampling(20, 0.0)))
    slots = Slots(model, DecodeStep(model))
    stopped, halted = Recorder(), Recorder(halt=3)
    stop = frozenset({greedy[5]})
    slots.join(Row([1, 2], Sampling(20, 0.0), stop), stopped.on_token, stopped.on_done)
    slots.join(Row([1, 3], Sampling(20, 0.0)), halted.on_token, halted.on_done)
    while slots.slots:
        slots.advance()
    before = greedy[: greedy.index(greedy[5])]  # up to its first stop id, not handed over
    assert (stopped.tokens, stopped.reason) == (before, "stop")
    assert (len(halted.tokens), halted.reason) == (3, "halted")


def test_decode_attention_over_a_length_a_row_is_each_row_alone():
    ops = decode_ops()
    assert ops is not None, "decode_ops.cpp did not build"
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(3, 4, 64)
        k, v = torch.randn(2, 3, 2, 700, 64).to(dtype).unbind(0)
        lengths = torch.tensor([5, 700, 300])
        together = ops.decode_attention(q, k, v, 1, None, None, lengths)
        for b, length in enumerate(lengths.tolist()):
            one = ops.decode_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], length)
            torch.testing.assert_close(together[b : b + 1], one, rtol=1e-5, atol=1e-6)


def test_the_compiled_step_decodes_rows_as_eager(model):
    """The step compiled for a position a row (batch 2: F.linear, not RowDot) equals eager."""
    rows = [ROWS[0], ROWS[4]]
    got = []
    for compiled in (False, True):
        slots = Slots(model, DecodeStep(model, compiled=compiled))
        records = [Recorder() for _ in rows]
        for row, record in zip(rows, records):
            slots.join(row, record.on_token, record.on_done)
        while slots.slots:
            slots.advance()
        got.append([r.tokens for r in records])
    assert got[0] == got[1] == [alone(model, row)[0] for row in rows]
