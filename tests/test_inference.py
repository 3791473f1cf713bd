"""The fused decode step (eager and compiled) and int8 weights compute what the plain
model does."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from model import ModelArgs, Transformer, apply_rotary, rope_frequencies, rope_rotations
from picollama.kernels.caches import quantize_rows, setup_cache
from picollama.kernels.decode_ops import cpu_isa, decode_ops, isa_class
from picollama.kernels.fused_step import DecodeStep, RowDot, projection
from picollama.kernels.quantize import Int4Linear, Int8Linear, Int8RowDot, quantize
from picollama.kernels.timing import compiled_unless_slower, pick_step, tune_threads
from picollama.sampling import decode as decoding
from picollama.sampling.decode import DecodeOptions
from picollama.sampling.sampler import Sampling

# tiny models on one thread throughout (conftest.one_thread: two stall each other on a busy 2-core
# machine, 5-50x slower here); the compiled steps are compiled for one thread as before
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, multiple_of=16
)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
STATIC_SCALINGS = [
    dict(rope_scaling="none"),
    dict(rope_scaling="linear", rope_factor=4.0),
    dict(rope_scaling="ntk", rope_factor=4.0),
    dict(rope_scaling="yarn", rope_factor=4.0),
    dict(rope_scaling="llama3", rope_factor=4.0, rope_original_max_seq_len=16),
]


def make_model(sharp=True, **overrides) -> Transformer:
    """A random tiny model; sharp: with weights N(0, 0.3), so that numeric differences show in the
    logits."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY | overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if sharp and not name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return model


def copy_of(model: Transformer) -> Transformer:
    twin = Transformer(model.args).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@torch.inference_mode()
def step_logits(model: Transformer, decode, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T - prefill, vocab) of one-token steps through `decode` after prefilling through
    the model."""
    model.setup_cache(tokens.shape[0], tokens.shape[1])
    try:
        model(tokens[:, :prefill], start_pos=0)
        return torch.cat(
            [decode(tokens[:, p : p + 1], start_pos=p) for p in range(prefill, tokens.shape[1])], 1
        )
    finally:
        model.reset_cache()


@pytest.mark.parametrize("scaling", STATIC_SCALINGS, ids=lambda d: d["rope_scaling"])
def test_the_real_rotation_is_the_complex_product(scaling):
    # the one RoPE of the model and the fused step, against pairs as complex numbers turned by
    # polar(scale, angle)
    args = ModelArgs(**TINY | scaling)
    x = torch.randn(2, 40, 4, args.head_dim)
    inv_freq, scale = rope_frequencies(args, 40)
    angles = torch.outer(torch.arange(40.0), inv_freq)
    turned = (
        torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        * torch.polar(torch.full_like(angles, scale), angles)[:, None]
    )
    torch.testing.assert_close(
        torch.view_as_real(turned).flatten(-2),
        apply_rotary(x, rope_rotations(args, 0, 40, "cpu")),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize("scaling", STATIC_SCALINGS, ids=lambda d: d["rope_scaling"])
def test_fused_step_gives_the_models_logits(scaling):
    model = make_model(**scaling)
    # past max_seq_len: the table grows
    reference, tokens = copy_of(model), torch.randint(0, 97, (2, 48))
    expected = step_logits(reference, reference, tokens, 5)
    got = step_logits(model, DecodeStep(model), tokens, 5)
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_fusing_keeps_one_copy_of_each_weight():
    model = make_model()
    before = {name: p.clone() for name, p in model.named_parameters()}
    step = DecodeStep(model)
    attention = model.layers[0].attention
    assert step.layers[0].wqkv.weight.data_ptr() == attention.wq.weight.data_ptr()
    assert (
        attention.wv.weight.untyped_storage().data_ptr()
        == attention.wq.weight.untyped_storage().data_ptr()
    )
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    tied = make_model(tie_embeddings=True)
    # the output keeps reading the embeddings (a compiled step compiles when called)
    for compiled in (False, True):
        assert (
            DecodeStep(tied, compiled=compiled).output.weight.data_ptr()
            == tied.tok_embeddings.weight.data_ptr()
        )


def test_dynamic_ntk_is_refused():
    with pytest.raises(ValueError, match="dynamic NTK"):
        DecodeStep(make_model(rope_scaling="dynamic", rope_factor=2.0))


def test_generate_with_the_fused_step_gives_the_same_tokens():
    model = make_model()
    expected = decoding.generate(copy_of(model), PROMPTS, Sampling(20, temperature=0))
    assert (
        decoding.generate(
            model, PROMPTS, Sampling(20, temperature=0), options=DecodeOptions(DecodeStep(model))
        )
        == expected
    )


def test_int8_weights_round_per_output_row():
    # rows of very different sizes
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]
    layer = Int8Linear.quantized(weight)
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().amax(1).eq(127).all()
    dequantized = layer.weight.float() * layer.scale[:, None]
    # half a step per row
    assert ((dequantized - weight).abs() <= layer.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(3, 5, 64)
    expected = x @ dequantized.T
    # per output row: their sizes differ 10,000-fold
    error = (layer(x) - expected).abs().amax((0, 1))
    # the CPU kernel takes bf16 inputs: ~0.4% each
    assert (error <= 0.01 * expected.abs().amax((0, 1))).all()
    unaligned = Int8Linear.quantized(weight[:, :40])  # not a multiple of 16: dequantized in fp32
    torch.testing.assert_close(
        unaligned(x[..., :40]), x[..., :40] @ (unaligned.weight * unaligned.scale[:, None]).T
    )


# 40: not a multiple of 16, which the int8 kernel gets wrong
@pytest.mark.parametrize("in_features", [64, 40])
def test_int8_in_bf16_matches_dequantized_weights(in_features):
    layer = Int8Linear.quantized(torch.randn(17, in_features)).to(torch.bfloat16)
    x = torch.randn(1, in_features, dtype=torch.bfloat16)
    expected = x.float() @ (layer.weight.float() * layer.scale.float()[:, None]).T
    torch.testing.assert_close(
        layer(x).float(), expected, atol=0.02 * expected.abs().max().item(), rtol=0
    )


@pytest.mark.parametrize("sharp", [False, True])
def test_int8_model_stays_close_and_its_fused_step_matches_it(sharp):
    model = make_model(sharp)
    reference = copy_of(model)
    quantize(model, "int8").to(torch.bfloat16)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    tokens = torch.randint(0, 97, (1, 24))
    with torch.inference_mode():
        plain, full = model(tokens).float(), reference(tokens)
    if not sharp:  # int8 and bf16 rounding (0.7% here), not a different model
        assert (plain - full).abs().max() < 0.02 * full.abs().max()
    fused = step_logits(model, DecodeStep(model), tokens, 5).float()
    torch.testing.assert_close(fused, plain[:, 5:], atol=0.01 * plain.abs().max().item(), rtol=0)


def test_int8_layer_cast_to_float32_keeps_its_kernel():
    """generate.py casts a quantized model to its activation dtype: that must not move its CPU
    kernel's scales off bf16 (which sent fp32 models back to dequantizing every weight)."""
    layer = Int8Linear.quantized(torch.randn(24, 32))
    x = torch.randn(2, 32)
    torch.testing.assert_close(copy.deepcopy(layer).to(torch.float32)(x), layer(x), atol=0, rtol=0)


def test_projection_concatenates_int8_rows_and_scales():
    layers = [Int8Linear.quantized(torch.randn(n, 32)) for n in (8, 4, 4)]
    x = torch.randn(2, 32)
    expected = torch.cat([layer(x) for layer in layers], -1)
    torch.testing.assert_close(projection(layers, rows=False)[0](x), expected, atol=0, rtol=0)


def test_quantize_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="int8"):
        quantize(make_model(), "int3")


def test_compiled_step_gives_the_same_tokens_without_recompiling(one_thread):
    """The step compiled ahead of time: one library serves every position and cache length (the RoPE
    table growing too), a batch of two gets one of its own, the KV caches and tables stay inputs
    (not stale constants)."""
    model = make_model(n_layers=1, max_seq_len=16, rope_scaling="linear", rope_factor=4.0)
    reference = copy_of(model)
    step = DecodeStep(model, compiled=True)
    fused = DecodeOptions(step)
    # on the CPU: products written by Inductor
    assert isinstance(step.layers[0].w13, RowDot)
    # cache lengths 17, 42, 16
    for prompts, new in (([[1, 5, 6, 7]], 13), ([[1, 9]], 40), ([[1, 2, 3]], 13)):
        expected = decoding.generate(reference, prompts, Sampling(new, temperature=0))
        assert (
            decoding.generate(model, prompts, Sampling(new, temperature=0), options=fused)
            == expected
        )
    assert list(step.compiled) == [("shared", 1, 1)]
    for new in (13, 20):  # rows of a token buffer as wide as the run
        prompts = [[1, 5, 6, 7], [1, 9, 2, 3]]
        expected = decoding.generate(reference, prompts, Sampling(new, temperature=0))
        assert (
            decoding.generate(model, prompts, Sampling(new, temperature=0), options=fused)
            == expected
        )
    assert list(step.compiled) == [("shared", 1, 1), ("shared", 2, 2)]
    # up to the cache's last slot, whose keys are the whole cache
    tokens = torch.randint(0, 97, (1, 12))
    expected = step_logits(reference, reference, tokens, 5)
    torch.testing.assert_close(step_logits(model, step, tokens, 5), expected, atol=1e-4, rtol=0)


def test_compiled_int8_step_reads_the_model_weights(one_thread):
    """int8 weights compiled (Int8RowDot, fp32 inputs): the logits of the same model with its
    weights dequantized to fp32 (the eager int8 kernel rounds its inputs to bf16), and the library
    reads the step's tensors (user-managed constants), so a weight changed in place shows in its
    next call."""
    dequantized = make_model(n_layers=1)
    model = quantize(copy.deepcopy(dequantized), "int8")
    with torch.no_grad():
        for module in dequantized.modules():
            if isinstance(module, torch.nn.Linear):
                rounded = Int8Linear.quantized(module.weight)
                module.weight.copy_(rounded.weight.float() * rounded.scale[:, None])
    step = DecodeStep(model, compiled=True)
    assert isinstance(step.layers[0].w13, Int8RowDot)
    tokens = torch.randint(0, 97, (1, 12))
    expected = step_logits(dequantized, DecodeStep(dequantized), tokens, 5)

    # the prefill as the dequantized model's (the int8 model's eager forward rounds inputs to bf16)
    model.setup_cache(1, 12)
    dequantized.setup_cache(1, 12)
    dequantized(tokens[:, :5], start_pos=0)
    for ours, theirs in zip(model.layers, dequantized.layers):
        ours.attention.cache.k.copy_(theirs.attention.cache.k)
        ours.attention.cache.v.copy_(theirs.attention.cache.v)
    got = torch.cat([step(tokens[:, p : p + 1], start_pos=p) for p in range(5, 12)], 1)
    model.reset_cache()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    step.output.weight.zero_()
    assert not step_logits(model, step, tokens, 5).any()


@pytest.mark.parametrize(
    "flags, isa",
    [
        ({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"),
        ({"avx2", "avx512f"}, "avx512"),
        ({"sse4_2", "fma", "avx2"}, "avx2"),
        ({"neon"}, "other"),
    ],
)
def test_isa_class(flags, isa):
    assert isa_class(flags) == isa
    assert cpu_isa() in ("amx", "avx512_bf16", "avx512", "avx2", "other")


def slowed(step, seconds):
    return lambda tokens, start_pos: (time.sleep(seconds), step(tokens, start_pos=start_pos))[1]


def test_pick_step_keeps_the_faster_step_and_says_when_it_is_eager(one_thread):
    model = make_model()
    step = DecodeStep(model)
    chosen, note = pick_step(model, step, slowed(step, 0.002))
    assert chosen is step and note.startswith(
        "--compile: the compiled decode step ran slower than eager"
    )
    fast = DecodeStep(model)
    assert pick_step(model, slowed(step, 0.002), fast) == (fast, None)
    # the timing's cache is gone
    assert all(attention.cache is None for attention in step.attentions)


def test_step_threads_hold_while_it_runs_and_are_restored(one_thread):
    model = make_model()
    step = DecodeStep(model, threads=2)
    seen = []
    step.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    tokens = torch.randint(0, 97, (2, 12))
    reference = copy_of(model)
    expected = step_logits(reference, reference, tokens, 5)
    # two threads split the reductions otherwise than one: 1.5e-5 apart on a Xeon with AMX
    torch.testing.assert_close(step_logits(model, step, tokens, 5), expected, atol=5e-5, rtol=0)
    assert set(seen) == {2} and torch.get_num_threads() == 1
    # on one thread there is nothing to choose
    assert tune_threads(model, DecodeStep(model)) is None


def test_compiled_unless_slower_decodes_like_the_model(one_thread):
    model = make_model(n_layers=1)
    expected = decoding.generate(copy_of(model), PROMPTS[:2], Sampling(12, temperature=0))
    step, note = compiled_unless_slower(model, DecodeStep(model), batch=2)
    assert note is None or note.startswith("--compile:")
    fused = DecodeOptions(step)
    got = decoding.generate(model, PROMPTS[:2], Sampling(12, temperature=0), options=fused)
    assert got == expected
    # timed at the batch it decodes
    assert step.compiled is None or list(step.compiled) == [("shared", 2, 2)]
    # the model's layers hold views of the chosen step's weights (the other's copy went with it)
    storage = step.layers[0].wqkv.weight.untyped_storage().data_ptr()
    assert model.layers[0].attention.wv.weight.untyped_storage().data_ptr() == storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, head_dim, length",
    [(1, 9, 3, 64, 700), (2, 6, 6, 48, 17), (1, 4, 2, 16, 1), (3, 8, 1, 128, 300)],
)
def test_decode_attention_kernel_is_sdpa(dtype, batch, heads, kv_heads, head_dim, length):
    """decode_ops.cpp: PyTorch's SDPA over the first `length` cached positions (fp32, bf16
    and int8 caches (one scale a token and head), grouped queries, a cache with more rows and
    slots than used)."""
    ops = decode_ops()
    if ops is None:
        pytest.fail("decode_ops.cpp did not build (a C++ compiler is needed)")
    attend = ops.decode_attention
    torch.manual_seed(0)
    q = torch.randn(batch, heads, head_dim)
    k, v = (torch.randn(batch + 1, kv_heads, length + 5, head_dim) for _ in range(2))
    if dtype == torch.int8:
        (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
        keys, values = k * k_scale[..., None], v * v_scale[..., None]
        got = attend(q, k, v, length, k_scale, v_scale)
    else:
        k, v = k.to(dtype), v.to(dtype)
        keys, values = k.float(), v.float()
        got = attend(q, k, v, length)
    keys, values = keys[:batch, :, :length], values[:batch, :, :length]
    expected = F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)
    torch.testing.assert_close(got, expected[:, :, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype, tolerance", [(torch.bfloat16, 0.02), (torch.int8, 0.05)])
def test_compiled_step_on_a_smaller_cache(one_thread, kv_dtype, tolerance):
    """kv_dtype bf16 or int8: the compiled fp32 step reads and writes a bf16 or int8 KV cache (the
    model's prefill too); its logits stay within 2% (bf16) or 5% (int8: 16-dim heads rounded to
    255 levels) of the largest logit of the fp32 cache's, on a model with sharp N(0, 0.3)
    weights. One layer, as the other compiled tests: a second adds ~30% to each compile (~10 s)
    and takes no path the first does not (int8 cache here: 2.4% off, 3.7% with two layers)."""
    model = make_model(n_layers=1)
    step = DecodeStep(model, compiled=True, kv_dtype=kv_dtype)
    tokens = torch.randint(0, 97, (1, 12))
    expected = step_logits(model, DecodeStep(model), tokens, 5)
    setup_cache(model, 1, 12, step.kv_dtype)
    model(tokens[:, :5], start_pos=0)
    assert model.layers[0].attention.cache.k.dtype == kv_dtype
    got = torch.cat([step(tokens[:, p : p + 1], start_pos=p) for p in range(5, 12)], 1)
    model.reset_cache()
    assert (got - expected).abs().max() < tolerance * expected.abs().max()


def test_int4_linear_is_its_groups_dequantized():
    """Int4Linear: 16 levels between each group of 32 inputs' minimum and maximum (Q4_1), through
    PyTorch's CPU kernel: the product of the dequantized weight within bf16 rounding."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    layer = Int4Linear.quantized(weight)
    groups = weight.view(48, 2, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    dequantized = (((groups - low) / step).round() * step + low).view(48, 64)
    assert (dequantized - weight).abs().max() <= step.max() / 2 + 1e-6
    x = torch.randn(3, 64)
    expected = F.linear(x.bfloat16().float(), dequantized)
    torch.testing.assert_close(layer(x), expected, atol=0.05, rtol=0.01)


def test_int4_model_decodes_compiled_as_eager(one_thread):
    """--quantize int4: the compiled step (the kernel under picollama::int4_linear) gives the eager
    step's logits, and both the model's; the output layer is int8 (as in llama.cpp's Q4 files).
    One layer, as the other compiled tests: a second adds ~30% to the compile."""
    model = quantize(make_model(n_layers=1), "int4")
    assert isinstance(model.layers[0].attention.wq, Int4Linear)
    assert isinstance(model.output, Int8Linear)
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        expected = model(tokens)[:, 5:]
    eager = step_logits(model, DecodeStep(model), tokens, 5)
    torch.testing.assert_close(eager, expected, atol=1e-4, rtol=1e-4)
    # compiled, the int8 head reads fp32 inputs (Int8RowDot) where eager rounds them to bf16
    compiled = step_logits(model, DecodeStep(model, compiled=True), tokens, 5)
    torch.testing.assert_close(compiled, expected, atol=0.05, rtol=0.01)
