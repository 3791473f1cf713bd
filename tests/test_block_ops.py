"""block_ops.cpp's block-quantized products (Q8_0, Q4_0, Q4_1), their modules and the default.

The oracles: gguf-py's own quantize and dequantize (the file's levels), and PyTorch's matmul on
the dequantized weights. The kernel rounds each block of 32 inputs to int8 (scale amax / 127),
as llama.cpp does. So against the matmul on x it may be off by the rounding of x, at most half a
level: |error| <= sum over blocks of (amax / 254) * sum |w| of the block. Against the matmul on
x rounded the same way it matches to float32 summation (relative 1e-5)."""

import argparse
import json
import os
from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.convert import main as convert
from picollama.convert.main import imported_run
from picollama.device import cpu_flags
from picollama.kernels import block_linear, load
from picollama.kernels.block_linear import FORMATS, BlockLinear, block_ops
from picollama.kernels.float_linear import PRECISIONS, FloatLinear
from picollama.kernels.fused_step import DecodeStep
from picollama.kernels.load import load_to_sample, own_format
from picollama.kernels.quantize import quantize
from picollama.run_files import load_run
from picollama.sampling.prompts import encode_prompt

GGUF_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}
SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
needs_ops = pytest.mark.skipif(block_ops() is None, reason="block_ops.cpp did not build")


def gguf_round_trip(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """weight quantized and dequantized by gguf-py, as a GGUF file holds it after import."""
    raw = gguf.quants.quantize(weight.numpy(), GGUF_TYPES[kind])
    return torch.from_numpy(gguf.quants.dequantize(raw, GGUF_TYPES[kind]).copy())


def awkward_weight(out: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """Random rows with some awkward blocks: all zero, constant, one-signed, one large value."""
    weight = torch.randn(out, inputs, generator=torch.Generator().manual_seed(seed))
    weight[0, :32] = 0
    weight[1, 32:64] = 0.25
    weight[2, :32] = weight[2, :32].abs()
    weight[3, :32] = -weight[3, :32].abs()
    weight[4, 5] = 40.0
    return weight


@pytest.mark.parametrize("kind", FORMATS)
def test_rounding_again_gives_back_the_file_s_levels_and_rounds_as_gguf_does(kind):
    weight = awkward_weight(40, 96)
    stored = gguf_round_trip(weight, kind)
    assert torch.equal(BlockLinear.quantized(stored, kind).dequantized(), stored)
    assert torch.equal(BlockLinear.quantized(weight, kind).dequantized(), stored)


def rounded_inputs(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 rounded to int8 levels of scale amax / 127, as the kernel does."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0, 1 / scale)
    return ((blocks * inverse).round() * scale).view_as(x)


@needs_ops
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("batch", [1, 2, 4, 7])
def test_products_match_pytorch_s_matmul_on_the_dequantized_weight(kind, batch):
    """in = 224 (7 blocks, not a multiple of 256), out = 72 (4.5 tiles of 16 rows)."""
    layer = BlockLinear.quantized(awkward_weight(72, 224), kind)
    weight = layer.dequantized().double()
    x = torch.randn(batch, 224, generator=torch.Generator().manual_seed(batch))
    x[0, :32] = 0  # A zero block.
    ours = layer(x)
    assert ours.shape == (batch, 72) and ours.dtype == torch.float32
    exact = rounded_inputs(x).double() @ weight.T
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-4)
    amax = x.view(batch, -1, 32).abs().amax(-1).double()  # (batch, blocks)
    per_block = weight.abs().view(72, -1, 32).sum(-1)  # (out, blocks)
    bound = (amax / 254) @ per_block.T
    assert ((ours.double() - x.double() @ weight.T).abs() <= bound + 1e-4).all()


@needs_ops
@pytest.mark.parametrize("kind", FORMATS)
def test_every_path_agrees_bit_for_bit_and_rows_do_not_depend_on_their_batch(kind, monkeypatch):
    """AVX-512 VNNI, AVX2 and scalar add the same exact integers in the same float order."""
    if {"avx512_vnni", "avx512bw"} <= cpu_flags():  # The build has the VNNI path.
        assert block_ops().block_isa() == 2
    layer = BlockLinear.quantized(awkward_weight(80, 160, seed=1), kind)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(2))
    best = layer(x)
    for isa in ("avx2", "scalar"):
        monkeypatch.setattr(block_linear, "ISA", isa)
        assert torch.equal(layer(x), best), isa
    monkeypatch.setattr(block_linear, "ISA", "best")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(row[None]) for row in x])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, best) and torch.equal(layer(x), best)
    ours = layer(x.bfloat16())  # bf16 in, bf16 out: the float32 sums rounded once.
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, layer(x.bfloat16().float()).bfloat16())


def float_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far a float32 sum of x·w over `in` terms may be from the exact one: in · 2^-24 · Σ|x·w|
    (each of the `in` additions rounds once). With bfloat16 weights x is rounded to bfloat16
    first, as the kernel does, and each product is then exact."""
    return weight.shape[1] * 2.0**-24 * (x.abs().double() @ weight.abs().double().T)


@needs_ops
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("batch", [1, 2, 4, 6])
@pytest.mark.parametrize("shape", [(7, 33), (72, 224), (5, 1), (3, 200), (9, 576)])
def test_float_products_match_pytorch_s_matmul_within_float32_summation(precision, batch, shape):
    """Odd shapes: rows that end mid-vector, and x's batch beyond a pass of 4."""
    out, inputs = shape
    weight = awkward_weight(max(out, 8), max(inputs, 64), seed=out)[:out, :inputs].contiguous()
    weight = weight.to(PRECISIONS[precision])
    x = torch.randn(batch, inputs, generator=torch.Generator().manual_seed(batch))
    seen = x.bfloat16().float() if precision == "bf16" else x  # What the kernel multiplies.
    exact = seen.double() @ weight.double().T
    for isa in range(3):  # best, AVX2, scalar
        ours = block_ops().float_linear(x, weight, isa)
        assert ours.shape == (batch, out) and ours.dtype == torch.float32
        assert ((ours.double() - exact).abs() <= float_bound(seen, weight)).all(), isa
    ours = block_ops().float_linear(x.bfloat16(), weight, 0)  # bf16 in, bf16 out, rounded once.
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, block_ops().float_linear(x.bfloat16().float(), weight, 0).bfloat16())


@needs_ops
@pytest.mark.parametrize("precision", PRECISIONS)
def test_float_rows_do_not_depend_on_their_batch_threads_or_the_forced_path(precision, monkeypatch):
    """Each row's sums are its own: the same bits alone, in a batch and on 1 or 2 threads. The
    paths PICOLLAMA_BLOCK_ISA forces (block_linear.ISA) differ only in summation order."""
    layer = FloatLinear.stored(nn.Linear(160, 90, bias=False), precision)
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(3))
    best = layer(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(row[None]) for row in x])
        torch.set_num_threads(2)
        assert torch.equal(layer(x), best)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, best)
    seen = x.bfloat16().float() if precision == "bf16" else x
    exact = seen.double() @ layer.weight.double().T
    for isa in ("avx2", "scalar"):
        monkeypatch.setattr(block_linear, "ISA", isa)
        ours = layer(x)
        assert ((ours.double() - exact).abs() <= float_bound(seen, layer.weight)).all(), isa
        assert torch.equal(torch.cat([layer(row[None]) for row in x]), ours), isa


@needs_ops
@pytest.mark.parametrize("precision", PRECISIONS)
def test_float_weights_keep_their_precision_and_the_fused_step_joins_them(precision):
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32)
    args.tie_embeddings = True
    model = quantize(Transformer(args).eval(), precision).to(torch.float32)
    wq = model.layers[0].attention.wq
    assert isinstance(wq, FloatLinear) and wq.weight.dtype == PRECISIONS[precision]
    assert isinstance(model.output, FloatLinear)
    tied = model.output.weight is model.tok_embeddings.weight
    assert tied == (precision == "f32")  # An f32 output reads the embedding itself.
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():
        expected = model(tokens)[:, -1]
        step = DecodeStep(model)
        assert isinstance(step.layers[0].wqkv, FloatLinear)
        assert step.layers[0].wqkv.weight.shape == (64 + 2 * 32, 64)
        assert (step.output is model.output) == tied
        model.setup_cache(1, 16)
        model(tokens[:, :-1], start_pos=0)
        got = step(tokens[:, -1:], 4)[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def no_compiler(*args, **kwargs):
    raise OSError("no C++ compiler")


def test_without_a_compiler_it_warns_multiplies_dequantized_and_auto_stays_float(monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with pytest.warns(UserWarning, match="block_ops.cpp not built"):
        assert block_ops.__wrapped__() is None
    monkeypatch.setattr(block_linear, "block_ops", block_ops.__wrapped__)
    monkeypatch.setattr(load, "block_ops", block_ops.__wrapped__)
    layer = BlockLinear.quantized(awkward_weight(40, 64), "q4_1")
    x = torch.randn(3, 64)
    with pytest.warns(UserWarning):
        torch.testing.assert_close(layer(x), x @ layer.dequantized().T)
    config = {"converted_from": {"gguf": "m", "weight_type": "Q4_1", "output_type": "Q8_0"}}
    with pytest.warns(UserWarning):
        assert own_format(config, torch.device("cpu")) == ("none", None, False)
    config = {"converted_from": {"gguf": "m", "weight_type": "F32", "output_type": "F32"}}
    with pytest.warns(UserWarning):
        assert own_format(config, torch.device("cpu")) == ("none", None, True)
    layer = FloatLinear(torch.randn(5, 8).bfloat16())
    with pytest.warns(UserWarning):
        torch.testing.assert_close(layer(x[:, :8]), x[:, :8] @ layer.weight.float().T)


def tiny_model(dim: int = 64) -> Transformer:
    torch.manual_seed(0)
    args = ModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32)
    return Transformer(args).eval()


@needs_ops
@pytest.mark.parametrize("kind", FORMATS)
def test_the_fused_step_joins_block_layers_and_computes_the_model_s_logits(kind):
    model = quantize(tiny_model(), kind)
    assert isinstance(model.layers[0].attention.wq, BlockLinear)
    assert model.output.extra_repr().endswith("q8_0")  # Q4 files keep 8 bits or more there.
    tokens = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():
        expected = model(tokens)[:, -1]
        step = DecodeStep(model)
        block = step.layers[0]
        assert isinstance(block.wqkv, BlockLinear) and block.wqkv.out_features == 64 + 2 * 32
        assert isinstance(block.w13, BlockLinear)
        model.setup_cache(1, 16)
        model(tokens[:, :-1], start_pos=0)
        got = step(tokens[:, -1:], 4)[:, 0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "converted, wanted",
    [
        ({"gguf": "m", "weight_type": "Q4_1", "output_type": "Q8_0"}, ("q4_1", "q8_0", True)),
        ({"gguf": "m", "weight_type": "Q4_0", "output_type": "Q6_K"}, ("q4_0", "q8_0", True)),
        ({"gguf": "m", "weight_type": "Q8_0", "output_type": "F16"}, ("q8_0", "f32", True)),
        ({"gguf": "m", "weight_type": "Q4_K", "output_type": "Q6_K"}, ("q8_0", "q8_0", True)),
        ({"gguf": "m", "weight_type": "BF16", "output_type": "BF16"}, ("bf16", "bf16", True)),
        ({"gguf": "m", "weight_type": "F16", "output_type": "F16"}, ("f32", "f32", True)),
        ({"gguf": "m", "weight_type": "F32", "output_type": "F32"}, ("f32", "f32", True)),
        ({"gguf": "m", "metadata": {"general.file_type": 3}}, ("q4_1", None, True)),
        ({"gguf": "m", "metadata": {"general.file_type": 7}}, ("q8_0", None, True)),
        ({"hf_dir": "x", "config": {}}, ("none", None, False)),
        (None, ("none", None, False)),
    ],
)
def test_a_gguf_file_decodes_in_its_own_types_and_anything_else_as_before(converted, wanted):
    config = {} if converted is None else {"converted_from": converted}
    if wanted[0] in (*FORMATS, *PRECISIONS) and block_ops() is None:
        wanted = ("none", None, wanted[0] == "f32" and "F16" not in str(converted))
    assert own_format(config, torch.device("cpu")) == wanted
    assert own_format(config, torch.device("meta"))[0] == "none"
    if wanted[0] == "f32" and "F16" not in str(converted):  # F32 on a GPU: float32 as before.
        assert own_format(config, torch.device("meta")) == ("none", None, True)


@needs_ops
def test_generate_samples_a_q8_0_file_in_q8_0_by_default(
    make_tiny_run, tmp_path, monkeypatch, capsys
):
    import generate

    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    run, _ = make_tiny_run(5)
    assert (
        run_command(
            convert.main,
            ["to-gguf", "--run", str(run), "--out", str(tmp_path / "m.gguf"), "--type", "q8_0"],
        )
        == 0
    )
    argv = ["--run", str(tmp_path / "m.gguf"), "--prompt", "ab", "--max-new-tokens", "6"]
    assert run_command(generate.main, [*argv, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "q8_0 weights" in err, err
    imported = imported_run(tmp_path / "m.gguf")
    recorded = json.loads((imported / "config.json").read_text())["converted_from"]
    assert recorded["weight_type"] == "Q8_0"
    args = argparse.Namespace(run=str(tmp_path / "m.gguf"), dtype="auto", quantize="auto")
    model, _, dtype = load_to_sample(args, torch.device("cpu"))
    assert args.quantize == "q8_0" and isinstance(model.layers[0].attention.wq, BlockLinear)
    assert dtype == torch.float32  # What block formats decode in by default.
    args = argparse.Namespace(run=str(tmp_path / "m.gguf"), dtype="auto", quantize="q4_1")
    model, _, dtype = load_to_sample(args, torch.device("cpu"))
    assert model.layers[0].attention.wq.extra_repr().endswith("q4") and dtype == torch.float32


@needs_ops
def test_an_import_keeps_its_tiles_and_a_second_load_reads_them_unchanged(
    make_tiny_run, tmp_path, monkeypatch
):
    """The first load rounds and saves the tiles beside the import. The second reads them back:
    the same buffers, the same logits, and no rounding. A run folder of the user's keeps none."""
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    run, _ = make_tiny_run(5)
    out = str(tmp_path / "m.gguf")
    assert run_command(convert.main, ["to-gguf", "--run", str(run), "--out", out]) == 0
    args = argparse.Namespace(run=out, dtype="auto", quantize="q4_1")
    first, _, _ = load_to_sample(args, torch.device("cpu"))
    (tiles,) = imported_run(Path(out)).glob("tiles-q4_1-*.safetensors")
    rounded, rounding = [], BlockLinear.__dict__["quantized"]
    monkeypatch.setattr(BlockLinear, "quantized", lambda *a: rounded.append(a))
    second, _, _ = load_to_sample(args, torch.device("cpu"))
    assert rounded == [] and tiles.is_file()
    for (name, a), (_, b) in zip(first.named_buffers(), second.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(first(tokens), second(tokens))
    size = tiles.stat().st_size
    tiles.write_bytes(tiles.read_bytes()[:100])  # damaged: rounded again and replaced
    monkeypatch.setattr(BlockLinear, "quantized", rounding)
    third, _, _ = load_to_sample(args, torch.device("cpu"))
    assert torch.equal(first(tokens), third(tokens)) and tiles.stat().st_size == size
    args = argparse.Namespace(run=str(run), dtype="auto", quantize="q4_1")
    load_to_sample(args, torch.device("cpu"))
    assert not list(Path(run).glob("tiles-*"))


@needs_ops
@pytest.mark.parametrize("kind", ["bf16", "f16", "f32"])
def test_a_float_file_decodes_in_its_own_precision_with_float32_activations(
    kind, make_tiny_run, tmp_path, monkeypatch
):
    """BF16 stays bf16. F16 widens to f32, exactly (bf16 would round it again)."""
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    run, _ = make_tiny_run(5)
    out = str(tmp_path / "m.gguf")
    argv = ["to-gguf", "--run", str(run), "--out", out, "--type", kind]
    assert run_command(convert.main, argv) == 0
    args = argparse.Namespace(run=out, dtype="auto", quantize="auto")
    model, _, dtype = load_to_sample(args, torch.device("cpu"))
    precision = "bf16" if kind == "bf16" else "f32"
    assert args.quantize == precision and dtype == torch.float32
    wq = model.layers[0].attention.wq
    assert isinstance(wq, FloatLinear) and wq.weight.dtype == PRECISIONS[precision]


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
@needs_ops
def test_smollm2_in_its_own_q4_1_picks_the_float32_model_s_next_tokens(one_thread):
    """Teacher-forced over a passage, the Q4_1 model's top token is the float32 one's at most
    positions (llama.cpp rounds its inputs to int8 just the same)."""
    model, _, tokenizer = load_run(imported_run(Path(SMOLLM2)), "cpu", torch.float32)
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    tokens = torch.tensor([encode_prompt(tokenizer, text)])
    with torch.inference_mode():
        expected = model(tokens)
        quantize(model, "q4_1", "q8_0")
        got = model(tokens)
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1).min().item()
    assert cosine > 0.99, cosine
