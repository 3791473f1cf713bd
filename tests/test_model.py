"""model.py against the seed documents' worked numbers and against itself (cache, causality, the
RoPE table)."""

import dataclasses
import math

import pytest
import torch

import model as model_module
from model import FeedForward, ModelArgs, RMSNorm, Transformer, apply_rotary, rope_rotations
from picollama.config.model_args import checked_model_args, model_args_from_dict

TINY = dict(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, multiple_of=16)
CONFIGS = {"mha": ModelArgs(**TINY), "gqa": ModelArgs(**TINY, n_kv_heads=2)}


def make_model(args: ModelArgs, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args).eval()


def rotations(model: Transformer, start: int, end: int, device="cpu") -> torch.Tensor:
    """The rotations of positions start..end-1 the model's RoPE gives (from its table)."""
    return model.pos_embeddings.rotations(model.args, end, device)[start:end]


@pytest.mark.parametrize(
    "x, expected",
    [
        ([2.0, -1.0, 3.0, 0.0], [1.069, -0.535, 1.604, 0.000]),
        ([0.5, -1.2, 0.8, 0.3], [0.643, -1.543, 1.029, 0.386]),
        ([1.1, -2.7, 1.8, 0.7], [0.629, -1.544, 1.030, 0.400]),
    ],
)
def test_rmsnorm_worked_examples(x, expected):
    y = RMSNorm(4, eps=0.0)(torch.tensor(x))
    assert torch.allclose(y, torch.tensor(expected), atol=1e-3)


def test_swiglu_worked_example():
    # x=1.5, W1=2.0, b1=0.5, W2=3.0, b2=0: Swish(3.5)·4.5. The biases ride on a constant input of 1.
    ffn = FeedForward(dim=2, hidden_dim=1)
    with torch.no_grad():
        ffn.w1.weight.copy_(torch.tensor([[2.0, 0.5]]))
        ffn.w3.weight.copy_(torch.tensor([[3.0, 0.0]]))
        ffn.w2.weight.copy_(torch.tensor([[1.0], [0.0]]))
    out = ffn(torch.tensor([1.5, 1.0]))
    assert abs(out[0].item() - 15.28) < 0.01


def rotate(vec, position, theta):
    freqs_cis = torch.polar(torch.ones(1, 1), torch.tensor([[position * theta]]))
    return apply_rotary(torch.tensor(vec).view(1, 1, 1, 2), freqs_cis).view(2)


def test_rope_worked_example():
    q, k = rotate([1.0, 0.5], 1, 0.1), rotate([1.0, 0.5], 3, 0.1)
    assert torch.allclose(q, torch.tensor([0.945, 0.597]), atol=1e-3)
    assert torch.allclose(k, torch.tensor([0.807, 0.774]), atol=1e-3)
    assert abs(torch.dot(q, k).item() - 1.225) < 1e-3


def test_rope_score_depends_only_on_offset():
    model = make_model(ModelArgs(**TINY))
    freqs_cis = rotations(model, 0, 600, "cpu")
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        return (
            (apply_rotary(q, freqs_cis[m : m + 1]) * apply_rotary(k, freqs_cis[n : n + 1]))
            .sum()
            .item()
        )

    for offset in (0, 1, 7, 50, 300):
        scores = [score(m + offset, m) for m in (0, 3, 100, 250)]
        assert max(scores) - min(scores) < 1e-4, (offset, scores)


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_cache_equals_full_forward(name):
    model = make_model(CONFIGS[name])
    tokens = torch.randint(0, 97, (2, 30))
    full = model(tokens)
    model.setup_cache(max_batch_size=2, max_seq_len=32)
    chunks = [model(tokens[:, :9], start_pos=0), model(tokens[:, 9:20], start_pos=9)]
    chunks += [model(tokens[:, p : p + 1], start_pos=p) for p in range(20, 30)]
    assert torch.allclose(torch.cat(chunks, dim=1), full, atol=1e-5)
    model.reset_cache()
    assert torch.equal(model(tokens), full)  # a plain forward never touches the cache


def test_causality():
    model = make_model(CONFIGS["gqa"])
    tokens = torch.randint(0, 97, (1, 20))
    changed = tokens.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 97
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_tiny_model_overfits_a_batch():
    model = make_model(ModelArgs(**TINY, n_kv_heads=2)).train()
    tokens = torch.randint(0, 97, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_loss_ignores_minus_100():
    model = make_model(CONFIGS["mha"])
    tokens = torch.randint(0, 97, (1, 9))
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100
    logits = model(tokens[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits[0, 4:], targets[0, 4:])
    assert torch.allclose(model(tokens[:, :-1], targets=targets), expected)


def test_args_round_trip_and_counts():
    args = CONFIGS["gqa"]
    assert model_args_from_dict(args.to_dict()) == args
    model = make_model(args)
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert ModelArgs(dim=4096, n_heads=32, multiple_of=256).hidden_dim == 11008  # Llama 2 7B's rule


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=65), "divisible by n_heads"),
        (dict(n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(rope_scaling="bogus"), "rope_scaling"),
        (dict(dim=0), "positive"),
    ],
)
def test_bad_model_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        checked_model_args(**{**TINY, **kwargs})
    with pytest.raises(ValueError, match="unknown model argument"):
        model_args_from_dict({**TINY, "dimm": 3})


def test_too_long_prompt_is_a_clear_error():
    model = make_model(CONFIGS["mha"])
    with pytest.raises(ValueError, match="setup_cache"):
        model(torch.zeros(1, 4, dtype=torch.long), start_pos=0)
    model.setup_cache(max_batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match="KV cache of 16 tokens"):
        model(torch.zeros(1, 20, dtype=torch.long), start_pos=0)
    with pytest.raises(ValueError, match="KV cache of 16 tokens"):
        model(torch.zeros(1, 1, dtype=torch.long), start_pos=16)
    with pytest.raises(ValueError, match="max_batch_size"):
        model(torch.zeros(2, 1, dtype=torch.long), start_pos=0)


def test_rope_is_float32_past_max_seq_len():
    model = make_model(CONFIGS["mha"]).to(torch.bfloat16)
    # far past max_seq_len=32; 1001 is not representable in bf16
    freqs = rotations(model, 0, 1100, "cpu")
    assert freqs.dtype == torch.complex64 and freqs.shape == (1100, 8)
    assert abs(freqs[1001, 0].item() - complex(math.cos(1001), math.sin(1001))) < 1e-3


SCALINGS = [
    dict(rope_scaling="none"),
    dict(rope_scaling="linear", rope_factor=4.0),
    dict(rope_scaling="yarn", rope_factor=4.0),
    dict(rope_scaling="dynamic", rope_factor=4.0),
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda d: d["rope_scaling"])
def test_rope_table_equals_computing_the_rotations(scaling):
    model = make_model(ModelArgs(**{**TINY, **scaling}))
    model.setup_cache(max_batch_size=1, max_seq_len=48)
    # past max_seq_len=32 the table grows: it then covers 40..48 and 90..100 in turn
    for start, end in [(0, 32), (5, 6), (40, 48), (90, 100), (5, 6)]:
        assert torch.equal(
            rotations(model, start, end, "cpu"), rope_rotations(model.args, start, end, "cpu")
        )


def test_decoding_does_not_recompute_the_rotations(monkeypatch):
    model = make_model(CONFIGS["gqa"])
    calls, compute = [], model_module.rope_frequencies
    monkeypatch.setattr(model_module, "rope_frequencies", lambda *a: calls.append(a) or compute(*a))
    model.setup_cache(max_batch_size=1, max_seq_len=32)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), start_pos=0)
        for pos in range(8, 20):
            model(torch.zeros(1, 1, dtype=torch.long), start_pos=pos)
    assert len(calls) == 1


def test_rope_table_follows_meta_loading_dtype_and_new_args():
    source = make_model(CONFIGS["gqa"])
    tokens = torch.randint(0, 97, (1, 20))
    with torch.device("meta"):  # as checkpoint.model_from_state_dict builds models
        model = Transformer(CONFIGS["gqa"]).eval()
    model.load_state_dict(source.state_dict(), assign=True)
    assert torch.equal(model(tokens), source(tokens))
    model.to(torch.bfloat16)
    assert rotations(model, 0, 4, "cpu").dtype == torch.complex64
    assert rotations(model, 0, 4, "meta").device.type == "meta"
    model.args = dataclasses.replace(
        model.args, rope_scaling="linear", rope_factor=4.0, rope_original_max_seq_len=8
    )
    assert torch.equal(rotations(model, 0, 32, "cpu"), rope_rotations(model.args, 0, 32, "cpu"))
    model.args = CONFIGS["gqa"]
    assert torch.equal(rotations(model, 0, 32, "cpu"), rotations(source, 0, 32, "cpu"))


def test_a_rope_table_built_while_sampling_serves_training():
    model = make_model(CONFIGS["mha"]).train()
    tokens = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        model(tokens)
    # inference tensors cannot be saved for backward
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    assert model.tok_embeddings.weight.grad is not None


def test_compiled_decode_step_follows_new_rope_args():
    model = make_model(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=50, max_seq_len=16))
    # dynamo's tracing is what the RoPE table must pass
    step = torch.compile(model, dynamic=True, backend="eager")
    tokens = torch.randint(0, 50, (1, 10))
    # as generate.py does
    for scaling in (dict(rope_scaling="none"), dict(rope_scaling="linear", rope_factor=4.0)):
        model.args = dataclasses.replace(model.args, **scaling)
        model.setup_cache(max_batch_size=1, max_seq_len=16)
        with torch.no_grad():
            # the same weights, built for these args
            expected = make_model(model.args)(tokens)[:, 4:]
            model(tokens[:, :4], start_pos=0)
            got = torch.cat([step(tokens[:, p : p + 1], start_pos=p) for p in range(4, 10)], 1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
