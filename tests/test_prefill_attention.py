"""prefill_attention.cpp and kernels/prefill.py: a prefill's attention on a CPU is PyTorch's SDPA,
and every case the kernel does not cover goes to SDPA itself."""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

import model
from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.device import cpu_flags
from picollama.kernels.caches import setup_cache
from picollama.kernels.decode_ops import decode_ops
from picollama.kernels.prefill import bf16_products, cpu_prefill_attention, prefill_sdpa
from picollama.kernels.quantize import quantize
from picollama.lab.measure import prefill_products as products
from picollama.sampling.decode import prefill

pytestmark = pytest.mark.usefixtures("one_thread")
SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")


@pytest.fixture(scope="module")
def ops():
    built = decode_ops()
    if built is None:
        pytest.fail("decode_ops.cpp did not build (a C++ compiler is needed)")
    return built


def qkv(batch, heads, kv_heads, length, keys, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, length, head_dim)] + [(batch, kv_heads, keys, head_dim)] * 2
    return [torch.randn(shape, generator=generator).mul(2).to(dtype) for shape in shapes]


def sdpa(q, k, v, mask=None):
    """PyTorch's SDPA in float64, the oracle."""
    q, k, v = (t.double() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)


def assert_as_close_as_sdpa(got, q, k, v, mask=None):
    """got is the float64 oracle's within PyTorch's own float32 tolerance (assert_close's)."""
    torch.testing.assert_close(got, sdpa(q, k, v, mask).float())


def chunk_mask(length: int, keys: int) -> torch.Tensor:
    """The mask model.span gives a chunk of `length` queries after keys - length cached ones."""
    positions = torch.arange(keys - length, keys)
    return torch.arange(keys)[None, :] <= positions[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("length, keys", [(7, 7), (5, 41), (1, 17), (30, 30)])
def test_causal_from_the_end_is_sdpa(ops, dtype, heads, kv_heads, head_dim, length, keys):
    """No mask: query t sees keys up to keys - length + t, as a chunk after cached positions (and
    SDPA's is_causal where length == keys)."""
    q, k, v = qkv(2, heads, kv_heads, length, keys, head_dim, dtype)
    got = ops.prefill_attention(q, k, v, None)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert_as_close_as_sdpa(got, q, k, v, chunk_mask(length, keys))


@pytest.mark.parametrize("batch_mask", [False, True])
def test_a_mask_is_sdpas_with_rows_that_see_nothing_as_zeros(ops, batch_mask):
    """Any bool mask: each row sees the keys it marks. A row that sees none gives zeros, as
    SDPA does."""
    q, k, v = qkv(2, 6, 2, 9, 37, 64)
    mask = torch.rand(2 if batch_mask else 1, 9, 37, generator=torch.Generator().manual_seed(1))
    mask = mask > 0.4
    mask[:, 3] = False
    got = ops.prefill_attention(q, k, v, mask)
    assert_as_close_as_sdpa(got, q, k, v, mask[:, None])
    assert not got[:, :, 3].any()


def test_keys_and_values_may_be_a_caches_first_positions(ops):
    """A KV cache's slice (capacity past the keys) is read in place, as the model passes it."""
    q, k, v = qkv(1, 4, 2, 6, 64, 32)
    k, v = k[:, :, :20], v[:, :, :20]
    assert not k.is_contiguous()
    got = prefill_sdpa(q, k, v, chunk_mask(6, 20), enable_gqa=True)
    assert_as_close_as_sdpa(got, q, k, v, chunk_mask(6, 20))


@pytest.mark.parametrize(
    "case", ["float mask", "per-head mask", "causal, more keys", "no mask", "grad", "head dim 48"]
)
def test_prefill_sdpa_leaves_what_the_kernel_does_not_cover_to_sdpa(ops, case):
    q, k, v = qkv(1, 4, 4, 5, 5 if case != "causal, more keys" else 9, 48 if "48" in case else 32)
    mask, causal = None, case in ("causal, more keys", "grad", "head dim 48")
    if case == "float mask":
        mask = torch.zeros(5, 5).masked_fill(~chunk_mask(5, 5), float("-inf"))
    if case == "per-head mask":
        mask = chunk_mask(5, 5).expand(1, 4, 5, 5)
    if case == "grad":
        q.requires_grad_()
    got = prefill_sdpa(q, k, v, mask, is_causal=causal)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal))


def small_model() -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=128, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=97, max_seq_len=64)
    return Transformer(args).eval()


def test_the_swap_lasts_the_prefill_and_only_on_a_cpu():
    kernel, net = model.SDPA_KERNEL, small_model()
    with cpu_prefill_attention(net):
        assert model.SDPA_KERNEL.func is prefill_sdpa
    assert model.SDPA_KERNEL is kernel
    with cpu_prefill_attention(net.to("meta")):
        assert model.SDPA_KERNEL is kernel


def test_bf16_products_where_the_model_rounds_its_products_inputs_already():
    """A bf16 model's inputs are bf16 already. A block-format model rounds its products' inputs
    to int8. A float32 model keeps fp32 products."""
    net = small_model()
    assert not bf16_products(net)
    assert bf16_products(copy.deepcopy(net).to(torch.bfloat16))
    assert bf16_products(quantize(copy.deepcopy(net), "q4_1"))


BF16_BUILT = "avx512_bf16" in cpu_flags()  # -march=native builds vdpbf16ps here


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("length, keys", [(7, 7), (5, 41), (1, 17), (30, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_products_are_sdpa_on_bf16_inputs(ops, heads, kv_heads, head_dim, length, keys, dtype):
    """bf16 products: the float64 SDPA of the scaled queries, keys and values rounded to bf16,
    within 2^-8 of the largest output (the probabilities are rounded too). An odd key count
    pads the last pair with a zero. Without AVX512-BF16 the kernel keeps fp32 products."""
    q, k, v = qkv(2, heads, kv_heads, length, keys, head_dim, dtype)
    got = ops.prefill_attention(q, k, v, None, True)
    if not BF16_BUILT:
        assert torch.equal(got, ops.prefill_attention(q, k, v, None))
        return
    scale = head_dim**-0.5
    queries = (q.float() * scale).bfloat16().double() / scale
    expected = sdpa(queries, k.bfloat16(), v.bfloat16(), chunk_mask(length, keys))
    assert (got.double() - expected).abs().max() <= 2**-8 * expected.abs().max()


def test_bf16_products_take_a_mask_with_rows_that_see_nothing(ops):
    q, k, v = qkv(2, 6, 2, 9, 37, 64)
    mask = torch.rand(2, 9, 37, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[:, 3] = False
    got = ops.prefill_attention(q, k, v, mask, True)
    assert not got[:, :, 3].any()
    expected = sdpa(q.mul(0.125).bfloat16().double() * 8, k.bfloat16(), v.bfloat16(), mask[:, None])
    assert (got.double() - expected).abs().max() <= 2**-8 * expected.abs().max()


def test_a_prefill_after_cached_tokens_gives_the_models_logits(ops):
    """sampling's prefill, through the kernel, in two chunks: the logits of the model's plain
    forward over every token."""
    net = small_model()
    tokens = torch.randint(0, 97, (1, 40))
    with torch.inference_mode():
        expected = net(tokens)[:, -1]
        setup_cache(net, 1, 40)
        prefill(net, tokens, 25)
        got = prefill(net, tokens, 40, 25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_the_products_measure_reads_a_block_format_file_each_way(tmp_path, llama_cpp):
    """lab/measure/prefill_products.py: each way's perplexity near fp32 products', and its
    logits' argmax mostly llama.cpp's."""
    out = tmp_path / "products.json"
    assert run_command(products.main, ["--smoke", "--run", SMOLLM2, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == [*products.WAYS, products.DEQUANTIZED]
    assert results["fp32 products"]["perplexity_over_fp32"] == 1.0
    for way in results.values():
        assert 0.95 < way["perplexity_over_fp32"] < 1.05 and way["top1_agree"] > 0.8
