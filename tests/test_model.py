"""model.py against the seed documents' worked numbers, against itself (cache, causality) and against Hugging Face's Llama."""
import math

import pytest
import torch

from convert import from_hf_state_dict, hf_config, to_hf_state_dict
from model import FeedForward, ModelArgs, RMSNorm, Transformer, apply_rotary

transformers = pytest.importorskip("transformers")

TINY = dict(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, multiple_of=16)
CONFIGS = {
    "mha": ModelArgs(**TINY),
    "gqa": ModelArgs(**TINY, n_kv_heads=2),
    "tied": ModelArgs(**TINY, n_kv_heads=1, tie_embeddings=True),
}


def make_model(args: ModelArgs, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args).eval()


@pytest.mark.parametrize(
    "x, expected",
    [([2.0, -1.0, 3.0, 0.0], [1.069, -0.535, 1.604, 0.000]), ([0.5, -1.2, 0.8, 0.3], [0.643, -1.543, 1.029, 0.386])],
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
    freqs_cis = model.rope(0, 600, "cpu")
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        return (apply_rotary(q, freqs_cis[m : m + 1]) * apply_rotary(k, freqs_cis[n : n + 1])).sum().item()

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


def hf_llama(args: ModelArgs, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**hf_config(args))
    return transformers.LlamaForCausalLM(config).eval(), config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_hf_matches_hf_logits(name):
    hf, config = hf_llama(CONFIGS[name])
    with torch.no_grad():  # HF's default init is too small to tell permutations apart: give it real variance
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    ours = from_hf_state_dict(hf.state_dict(), config).eval()
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_matches_our_logits(name):
    ours = make_model(CONFIGS[name])
    hf, _ = hf_llama(CONFIGS[name], seed=1)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_hf_round_trip_is_exact():
    ours = make_model(CONFIGS["tied"])
    back = from_hf_state_dict(to_hf_state_dict(ours), hf_config(ours.args))
    assert back.args.hidden_dim == ours.args.hidden_dim
    assert {k: v for k, v in back.args.to_dict().items() if k not in ("multiple_of", "ffn_hidden_dim")} == {
        k: v for k, v in ours.args.to_dict().items() if k not in ("multiple_of", "ffn_hidden_dim")
    }
    assert back.output.weight is back.tok_embeddings.weight
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


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
    assert ModelArgs.from_dict(args.to_dict()) == args
    model = make_model(args)
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.flops_per_token(32) > 6 * model.num_params() - 6 * 97 * 64  # embeddings are not matmuls
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
        ModelArgs(**{**TINY, **kwargs})
    with pytest.raises(ValueError, match="unknown model argument"):
        ModelArgs.from_dict({**TINY, "dimm": 3})


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
    freqs = model.rope(0, 1100, "cpu")  # far past max_seq_len=32; 1001 is not representable in bf16
    assert freqs.dtype == torch.complex64 and freqs.shape == (1100, 8)
    assert abs(freqs[1001, 0].item() - complex(math.cos(1001), math.sin(1001))) < 1e-3
