"""Weight-only quantization, applied to a Transformer at load time.

Int8Linear, Int4Linear, block_linear.py's BlockLinear (llama.cpp's Q8_0, Q4_0, Q4_1) and
float_linear.py's FloatLinear (float32 or bfloat16 weights) replace its linear layers, and
`quantize` swaps them in. Only weights are quantized here. Activations keep a float dtype.
load.py picks the mode, a GGUF file's own by default."""

import torch
import torch.nn.functional as F
from torch import nn

from model import Transformer
from picollama.device import cpu_has_bf16
from picollama.kernels.block_linear import FORMATS, BlockLinear
from picollama.kernels.caches import quantize_rows
from picollama.kernels.decode_ops import decode_ops
from picollama.kernels.float_linear import PRECISIONS, FloatLinear

# "auto" is the run's own format: a GGUF file's weight type (load.py), else "none".
QUANTIZATIONS = ("auto", "none", "int8", "int4", *FORMATS, *PRECISIONS)


class Int8Linear(nn.Module):
    """A bias-free linear layer whose weight is int8, one scale (absmax / 127) per output row."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        # The CPU kernel takes bf16 scales.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Keep the kernel's dtype, whatever .to(dtype) cast it to.
        self.scale_bf16 = self.scale_bf16.to(torch.bfloat16)
        return self

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int8Linear":
        """weight (out, in) rounded to int8 per row. Its float32 scales follow .to(dtype)."""
        return cls(*quantize_rows(weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's int8 kernel (gpt-fast's on CPU) reads a quarter of fp32's bytes. With bf16
        # inputs it is fast on every CPU, AVX2 too, since bf16 → fp32 is a shift. A decode step's
        # matrix-vector products took 0.87 ms, against 2.2-3.3 ms in fp32, on one AVX2 core.
        # With fp32 inputs it is 4-6x slower than F.linear. So CPU inputs go in as bf16. That is
        # coarser than fp32 but finer than llama.cpp's q8_0, which rounds them to 8 bits.
        # The kernel returns garbage unless in_features is a multiple of 16 (torch 2.13).
        # Other shapes, and other devices, dequantize instead.
        if x.device.type == "cpu" and self.weight.shape[1] % 16 == 0:
            rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale_bf16)
            return out.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype)) * self.scale


class Int8RowDot(Int8Linear):
    """An Int8Linear for compiled CPU decode steps (see RowDot).

    Inductor writes one loop that reads each int8 weight row, widens it to fp32 and reduces it.
    _weight_int8pack_mm would be an extern call on bf16 inputs. SmolLM2-135M's matrix-vector
    products took 5.7 ms against 9.2 ms on one Zen 5 core. llama.cpp's whole q8_0 step took
    5.5 ms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:  # A batch uses PyTorch's kernel. Compiling fixes the branch.
            return super().forward(x)
        products = x.float().unsqueeze(-2) * self.weight.float()
        return (products.sum(-1) * self.scale).to(x.dtype)


class Int4Linear(nn.Module):
    """A bias-free CPU linear layer with a 4-bit weight.

    Each group of 32 inputs has a scale and a minimum, like llama.cpp's Q4_1. The weight is
    packed for PyTorch's CPU kernel, _weight_int4pack_mm_for_cpu, with bf16 inputs and outputs.
    The packing interleaves rows, so layers are not fused (see Concatenated)."""

    GROUP = 32

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # (in / GROUP, out, 2) bf16

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16)  # Kept bf16 for the kernel.
        return self

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        """Whether the kernel takes the layer's shape. Inputs need a multiple of 32, outputs 16."""
        return linear.in_features % cls.GROUP == 0 and linear.out_features % 16 == 0

    @classmethod
    def quantized(cls, weight: torch.Tensor) -> "Int4Linear":
        """weight (out, in) rounded to 16 levels between each group's minimum and maximum.

        `in` must be a multiple of GROUP."""
        out, inputs = weight.shape
        groups = weight.detach().float().view(out, inputs // cls.GROUP, cls.GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        levels = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.to(torch.int32).view(out, inputs), 1
        )
        # The kernel reads a weight as (level - 8)·scale + zero.
        scales_zeros = torch.stack((scale, low + 8 * scale), -1).transpose(0, 1)
        return cls(packed, scales_zeros.contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        # When exported for a compiled step, call the kernel by our own op's name (decode_ops.cpp).
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        if torch.compiler.is_exporting() and decode_ops() is not None:
            mm = torch.ops.picollama.int4_linear
        out = mm(rows, self.packed, self.GROUP, self.scales_zeros)
        return out.view(*x.shape[:-1], -1).to(x.dtype)


class Concatenated(nn.Module):
    """Layers that read one input, with their outputs concatenated. For Int4Linears, which cannot
    be joined."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.parts], -1)


def int8_dtype(device: torch.device, compiled: bool = False) -> torch.dtype:
    """The activation dtype for int8 weights: bf16 where the hardware has it, else float32.

    Norms and attention in emulated bf16 are slow. Int8Linear feeds its kernel bf16 on any CPU
    anyway. A compiled CPU step (Int8RowDot) runs fastest on float32. SmolLM2-135M took 5.3
    against 6.5 ms a step on one Zen 5 core."""
    if compiled and device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32


def quantize(model: Transformer, mode: str, output: str | None = None) -> Transformer:
    """The model for inference, its weights quantized in place as `mode` says.

    "none" leaves them as they are. "int8" makes every linear layer an Int8Linear. The embedding
    and the norms stay as they are. "int4" (CPU only) makes an Int4Linear wherever the shape fits
    the kernel, and the output layer an Int8Linear. "q8_0", "q4_0" and "q4_1" (CPU only) make a
    BlockLinear in that format of every layer whose inputs fill blocks of 32. "f32" and "bf16"
    (CPU only) make a FloatLinear of every layer, its weight kept in that precision. The output
    layer takes format `output` ("none" keeps it as it is). It defaults to q8_0 for 4-bit modes,
    as in llama.cpp's Q4 files. Quantize before casting the model to its activation dtype, since the
    weights are rounded from the ones given. load.py resolves "auto" before this."""
    if mode not in QUANTIZATIONS[1:]:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS[1:])}, not {mode!r}"
        )
    cpu = model.tok_embeddings.weight.device.type == "cpu"
    if mode in ("int4", *FORMATS, *PRECISIONS) and not cpu:
        raise ValueError(f"{mode} weights run on the CPU only (PyTorch's CPU int4 kernel, ours)")
    last = output or ("q8_0" if mode in ("q4_0", "q4_1") else mode)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if not isinstance(child, nn.Linear):
                continue
            # With int4 the output layer stays int8. llama.cpp's Q4 files keep it at 8 bits or more.
            if mode == "int8" or (mode == "int4" and child is model.output):
                setattr(module, name, Int8Linear.quantized(child.weight))
            elif mode == "int4" and Int4Linear.fits(child):
                setattr(module, name, Int4Linear.quantized(child.weight))
            elif mode in (*FORMATS, *PRECISIONS):  # An output of "none" stays as it is.
                kind = last if child is model.output else mode
                if kind in FORMATS and BlockLinear.fits(child):
                    setattr(module, name, BlockLinear.quantized(child.weight, kind))
                elif kind in PRECISIONS and FloatLinear.fits(child):
                    setattr(module, name, FloatLinear.stored(child, kind))
    return model.requires_grad_(False)
