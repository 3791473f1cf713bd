"""decode.decode_rows, the one static loop: each row of a batch samples, stops and reports alone."""

import pytest
import torch

from model import ModelArgs, Transformer
from picollama.sampling.decode import decode_rows, generate
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampling


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=128)
    return Transformer(ModelArgs(**{**args.to_dict(), "multiple_of": 16})).eval()


def decode(model, rows, **kwargs) -> tuple[list[list[int]], dict, list]:
    """(each row's tokens, each row's end reason, every Token handed over as (row, token))."""
    reasons, handed = {}, []

    def on_token(row, token):
        handed.append((row, token))
        return False

    outputs = decode_rows(model, rows, on_token, reasons.__setitem__, **kwargs)
    return outputs, reasons, handed


def test_a_seeded_row_draws_as_generate_does_alone(model):
    for sampling in (Sampling(20, 0.0), Sampling(20, 0.9, seed=3), Sampling(20, 1.1, 8, 0.9, 4)):
        alone = generate(model, [[1, 5, 9]], sampling)
        assert decode(model, [Row([1, 5, 9], sampling)])[0] == alone


def test_each_row_of_a_mixed_batch_is_what_it_is_alone(model):
    rows = [
        Row([1, 2, 3, 4, 5, 6, 7], Sampling(12, 0.9, seed=1)),
        Row([1], Sampling(30, 0.0), logprobs=2),
        Row([1, 8, 8], Sampling(5, 1.2, top_k=5, seed=2)),
        Row([1, 9, 10, 11], Sampling(9, 1.0, top_p=0.7, seed=1)),
    ]
    together, reasons, _ = decode(model, rows)
    assert together == [decode(model, [row])[0][0] for row in rows]
    assert [len(tokens) for tokens in together] == [12, 30, 5, 9]
    assert reasons == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_stop_ids_and_a_true_on_token_end_a_row(model):
    greedy = decode(model, [Row([1, 2], Sampling(20, 0.0))])[0][0]
    stop = greedy[5]
    rows = [Row([1, 2], Sampling(20, 0.0), frozenset({stop})), Row([1, 3], Sampling(20, 0.0))]
    halted = []

    def on_token(row, token):
        halted.append(row)
        return row == 1 and halted.count(1) == 3

    reasons = {}
    outputs = decode_rows(model, rows, on_token, reasons.__setitem__)
    assert outputs[0] == greedy[: greedy.index(stop)] and stop not in outputs[0]
    assert len(outputs[1]) == 3 and halted.count(1) == 3
    assert reasons == {0: "stop", 1: "halted"}


def test_logprobs_are_the_models_log_softmax_best_first(model):
    rows = [Row([1, 4], Sampling(3, 0.0), logprobs=3), Row([1, 4], Sampling(3, 0.0))]
    outputs, _, handed = decode(model, rows)
    tokens = [token for row, token in handed if row == 0]
    assert [row for row, token in handed if token.logprob is None] == [1, 1, 1]
    logits = model(torch.tensor([[1, 4, *outputs[0][:2]]]))[0, 1:].float().log_softmax(-1)
    for token, expected in zip(tokens, logits):
        assert token.logprob == pytest.approx(expected[token.id].item(), abs=1e-4)
        assert [i for i, _ in token.top] == expected.topk(3).indices.tolist()
        assert token.top[0][1] >= token.top[1][1] >= token.top[2][1] and token.logprob <= 0
