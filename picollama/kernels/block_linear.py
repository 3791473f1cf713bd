"""Linear layers on llama.cpp's block formats, Q8_0, Q4_0 and Q4_1, run by block_ops.cpp.

A GGUF file's Q8_0 and Q4 weights were dequantized on import (convert/from_gguf.py). Rounding
them again here, as ggml does, gives back the file's own levels and fp16 scales. BlockLinear packs
them into block_ops.cpp's tiles of 16 rows. Its product rounds the input to int8 per block of 32,
as llama.cpp does. This module builds the C++ and knows the formats. quantize.py decides which
layers get them."""

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from picollama import REPO_ROOT
from picollama.kernels.decode_ops import build_lock, cpu_isa

BLOCK = 32  # Inputs a block (llama.cpp's QK8_0, QK4_0, QK4_1).
ROWS = 16  # Output rows a tile (block_ops.cpp).
FORMATS = ("q8_0", "q4_0", "q4_1")
# block_ops.cpp's paths. "best" is AVX-512 VNNI where built, then AVX2, then scalar.
# PICOLLAMA_BLOCK_ISA=avx2 or scalar forces the others, read once at import. Tests set ISA.
ISAS = {"best": 0, "avx2": 1, "scalar": 2}
ISA = os.environ.get("PICOLLAMA_BLOCK_ISA", "best")
if ISA not in ISAS:
    said = f"PICOLLAMA_BLOCK_ISA={ISA!r} is not one of {', '.join(ISAS)}: using best"
    warnings.warn(said, stacklevel=2)
    ISA = "best"


@functools.cache
def block_ops():
    """block_ops.cpp and float_ops.cpp as a Python module (block_linear, float_linear, block_isa).

    None without a C++ compiler. Importing it also registers torch.ops.picollama.block_linear and
    float_linear, which compiled steps call. The first call builds it (~8 s on 2 cores) into the
    project's cache, for this CPU's ISA class and torch. Without a compiler it warns, and
    BlockLinear and FloatLinear multiply with PyTorch."""
    from torch.utils.cpp_extension import load

    paths = [Path(__file__).parent / name for name in ("block_ops.cpp", "float_ops.cpp")]
    texts = "|".join(path.read_text() for path in paths)
    key = f"{texts}|{cpu_isa()}|{torch.__version__}"
    folder = REPO_ROOT / ".cache" / "extensions" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(folder):
            module = load(  # Not load_inline, which puts torch/extension.h first.
                "picollama_block_ops",
                sources=[str(path) for path in paths],
                is_python_module=True,
                build_directory=str(folder),
                # ATen's parallel_for is inlined here. Without -fopenmp it runs on one thread.
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
    except Exception as e:  # No compiler, or a failing one.
        warnings.warn(f"block_ops.cpp not built ({e}); block weights are dequantized", stacklevel=2)
        return None
    torch.library.register_fake("picollama::block_linear")(_linear_shape)
    torch.library.register_fake("picollama::float_linear")(_float_shape)
    return module


def _linear_shape(x, levels, scales, out_features, isa):
    return x.new_empty(x.shape[0], out_features)


def _float_shape(x, weight, isa):
    return x.new_empty(x.shape[0], weight.shape[0])


def rounded(values: torch.Tensor) -> torch.Tensor:
    """C's roundf, halves away from zero (gguf-py's np_roundf). torch.round takes halves to even."""
    return values.sign() * (values.abs() + 0.5).floor()


def quantize_blocks(weight: torch.Tensor, kind: str) -> tuple:
    """weight (out, in) rounded as ggml rounds `kind`, one block of 32 inputs at a time.

    Returns levels (out, in / 32, 32) and the fp16 scale and minimum (out, in / 32) of each block.
    A weight is scale·level + minimum. Q8_0 levels are -127..127 with minimum 0. Q4 levels are
    0..15. Q4_0's minimum is -8·scale. The arithmetic is gguf-py's, in float32, so the levels
    are the file's."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    if kind == "q8_0":
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        levels = rounded(blocks * inverse(scale))
        low = torch.zeros_like(scale)
    elif kind == "q4_1":
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        scale = (high - low) / 15
        levels = ((blocks - low) * inverse(scale) + 0.5).trunc().clamp(0, 15)
    elif kind == "q4_0":
        # The signed value of largest magnitude, the first where two tie.
        top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        scale = top / -8
        levels = (blocks * inverse(scale) + 8.5).trunc().clamp(0, 15)
        low = -8 * scale.half().float()
    else:
        raise ValueError(f"block format must be one of {', '.join(FORMATS)}, not {kind!r}")
    return levels, scale.squeeze(-1).half(), low.squeeze(-1).half()


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale, and 0 where the scale is 0 (an all-zero block)."""
    return torch.where(scale == 0, 0, 1 / scale)


def tiles(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, q8: bool) -> tuple:
    """quantize_blocks' output in block_ops.cpp's layout: (levels, scales) of (G, K, ...).

    Rows are padded to a multiple of 16 with zero blocks."""
    out, K = scale.shape
    pad = -out % ROWS
    levels, scale, low = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (levels, scale, low))
    groups = (out + pad) // ROWS
    if q8:  # Byte 64c + 4r + j: row r, input 4c + j, stored + 128.
        data = (levels + 128).to(torch.uint8).view(groups, ROWS, K, 8, 4)
    else:  # Byte 64c + 4r + j: row r, inputs 4c + j (low nibble) and 16 + 4c + j (high).
        nibbles = levels.to(torch.uint8)
        data = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).view(groups, ROWS, K, 4, 4)
    data = data.permute(0, 2, 3, 1, 4).reshape(groups, K, -1)
    parts = [scale] if q8 else [scale, low]
    scales = torch.stack([p.view(groups, ROWS, K).transpose(1, 2) for p in parts], 2)
    return data.contiguous(), scales.reshape(groups, K, -1).view(torch.int16).contiguous()


class BlockLinear(nn.Module):
    """A bias-free CPU linear layer on Q8_0 or Q4 (Q4_0, Q4_1) weights, in block_ops.cpp's tiles.

    Its buffers are integers (fp16 scales kept as their bits), so casting the model to a dtype
    leaves them be. The output has the input's dtype: float32 or bfloat16."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor, out_features: int):
        super().__init__()
        self.register_buffer("levels", levels)  # (G, K, 512) Q8_0 or (G, K, 256) Q4, uint8
        self.register_buffer("scales", scales)  # (G, K, 16) or (G, K, 32) int16, fp16 bits
        self.out_features = out_features
        self.in_features = levels.shape[1] * BLOCK

    @classmethod
    def fits(cls, linear: nn.Module) -> bool:
        """Whether a layer is a CPU nn.Linear whose inputs come in whole blocks of 32."""
        cpu = isinstance(linear, nn.Linear) and linear.weight.device.type == "cpu"
        return cpu and linear.in_features % BLOCK == 0

    @classmethod
    def quantized(cls, weight: torch.Tensor, kind: str) -> "BlockLinear":
        """weight (out, in) in format `kind` (FORMATS), rounded as ggml rounds it."""
        levels, scale, low = quantize_blocks(weight, kind)
        return cls(*tiles(levels, scale, low, kind == "q8_0"), weight.shape[0])

    @classmethod
    def joined(cls, layers: list["BlockLinear"]) -> "BlockLinear | None":
        """One layer with the concatenated outputs of `layers`, or None where they cannot be joined.

        They join when they share a format and inputs, and all but the last fill whole tiles."""
        first = layers[0]
        same = all(
            isinstance(layer, cls) and layer.levels.shape[1:] == first.levels.shape[1:]
            for layer in layers
        )
        if not same or any(layer.out_features % ROWS for layer in layers[:-1]):
            return None
        levels = torch.cat([layer.levels for layer in layers])
        scales = torch.cat([layer.scales for layer in layers])
        return cls(levels, scales, sum(layer.out_features for layer in layers))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) these tiles hold."""
        groups, K, size = self.levels.shape
        scales = self.scales.view(torch.float16).float().view(groups, K, -1, ROWS)
        if size == 512:
            levels = self.levels.view(groups, K, 8, ROWS, 4).float() - 128
            low = torch.zeros_like(scales[:, :, 0])
        else:
            nibbles = self.levels.view(groups, K, 4, ROWS, 4)
            levels = torch.cat((nibbles & 15, nibbles >> 4), 2).float()
            low = scales[:, :, 1]
        # (G, K, c, r, j) -> (G, r, K, c, j): each row's inputs in order.
        weight = levels.permute(0, 3, 1, 2, 4) * scales[:, :, 0].transpose(1, 2)[..., None, None]
        weight = weight + low.transpose(1, 2)[..., None, None]
        return weight.reshape(groups * ROWS, -1)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = block_ops()
        if ops is None:
            return F.linear(x, self.dequantized().to(x.dtype))
        return product(ops, "block_linear", x, self.levels, self.scales, self.out_features)

    def extra_repr(self) -> str:
        kind = "q8_0" if self.levels.shape[2] == 512 else "q4"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def product(ops, name: str, x: torch.Tensor, *weights) -> torch.Tensor:
    """The product `name` of block_ops' module (block_linear, float_linear) of x's rows with
    `weights`, shaped and typed as x. Eager calls go through pybind11. A traced call goes
    through the registered op, which a compiled step calls."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype not in (torch.float32, torch.bfloat16):
        rows = rows.float()
    linear = getattr(ops, name)
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        linear = getattr(torch.ops.picollama, name)
    out = linear(rows.contiguous(), *weights, ISAS[ISA])
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], -1)
    return out.to(x.dtype)
