"""RoPE scaling: our inverse frequencies and attention scale against transformers' own RoPE
functions; the KV cache stays exact past the training length."""

import dataclasses

import pytest
import torch

from model import ModelArgs, Transformer, rope_frequencies
from picollama.convert.hf import hf_config

BASE = dict(dim=256, n_heads=4, n_layers=1, vocab_size=64, max_seq_len=512, rope_theta=10000.0)


def hf_rope(args: ModelArgs, seq_len: int):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**hf_config(args))
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        fn = rotary.compute_default_rope_parameters
    else:
        fn = ROPE_INIT_FUNCTIONS[rope_type]
    return fn(config=config, device="cpu", seq_len=seq_len)


@pytest.mark.parametrize(
    "scaling",
    [
        dict(rope_scaling="none"),
        dict(rope_scaling="linear", rope_factor=4.0),
        dict(rope_scaling="ntk", rope_factor=4.0),  # exported as plain RoPE, its base changed
        dict(rope_scaling="dynamic", rope_factor=1.0),
        dict(rope_scaling="dynamic", rope_factor=2.0),
        dict(rope_scaling="yarn", rope_factor=8.0),
        dict(rope_scaling="yarn", rope_factor=3.0, rope_theta=500000.0),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=128),
        dict(
            rope_scaling="llama3",
            rope_factor=8.0,
            rope_original_max_seq_len=8192,
            rope_theta=500000.0,
            max_seq_len=131072,
        ),
    ],
    ids=lambda d: "-".join(str(v) for v in d.values()),
)
@pytest.mark.parametrize("seq_len", [100, 512, 1500, 4096])
def test_frequencies_match_transformers(scaling, seq_len):
    args = ModelArgs(**{**BASE, **scaling})
    inv_freq, scale = rope_frequencies(args, seq_len)
    hf_inv_freq, hf_scale = hf_rope(args, seq_len)
    assert inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-7)


@pytest.mark.parametrize(
    "scaling",
    [
        # not "none": transformers' default RoPE has no partial rotary
        dict(rope_scaling="linear", rope_factor=1.0),
        dict(rope_scaling="linear", rope_factor=4.0),
        dict(rope_scaling="dynamic", rope_factor=2.0),
        dict(rope_scaling="yarn", rope_factor=8.0),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=128),
    ],
    ids=lambda d: d["rope_scaling"] + str(d["rope_factor"]),
)
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_partial_rotary_frequencies_match_transformers(scaling, fraction):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = ModelArgs(**{**BASE, **scaling}, rope_fraction=fraction)
    # Llama has no partial rotary: add it
    config = hf_config(dataclasses.replace(args, rope_fraction=1.0))
    config["rope_parameters"]["partial_rotary_factor"] = fraction
    config = transformers.LlamaConfig(**config)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS[args.rope_scaling](
        config=config, device="cpu", seq_len=1500
    )
    inv_freq, scale = rope_frequencies(args, 1500)
    assert inv_freq.shape == (int(64 * fraction) // 2,)
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-7)
    if scaling["rope_factor"] == 1.0:
        full = rope_frequencies(
            dataclasses.replace(args, rope_fraction=1.0, rope_scaling="none"), 1500
        )[0]
        # the rotated part keeps the full spectrum's range
        assert not torch.equal(inv_freq, full[: len(inv_freq)])
        torch.testing.assert_close(
            inv_freq, 10000.0 ** -(torch.arange(0, 64 * fraction, 2) / (64 * fraction))
        )


def test_yarn_attention_temperature():
    _, scale = rope_frequencies(ModelArgs(**BASE, rope_scaling="yarn", rope_factor=4.0), 2048)
    assert scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


@pytest.mark.parametrize("method", ["none", "linear", "ntk", "yarn", "llama3", "yarn-partial"])
def test_cache_equals_full_forward_past_training_length(method):
    torch.manual_seed(0)
    args = ModelArgs(
        **dict(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=50,
            max_seq_len=16,
            rope_factor=4.0,
        ),
        rope_scaling=method.removesuffix("-partial"),
        rope_fraction=0.5 if method.endswith("-partial") else 1.0,
    )
    model = Transformer(args).eval()
    # larger weights than the init's, so that attention is sharp and positions matter
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    tokens = torch.randint(0, 50, (1, 60))
    model.setup_cache(max_batch_size=1, max_seq_len=64)
    with torch.no_grad():
        steps = [model(tokens[:, :10], start_pos=0)] + [
            model(tokens[:, p : p + 1], start_pos=p) for p in range(10, 60)
        ]
        torch.testing.assert_close(torch.cat(steps, 1), model(tokens), atol=1e-4, rtol=0)
