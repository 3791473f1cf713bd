"""Linear layers on float32 or bfloat16 weights, run by float_ops.cpp.

A GGUF file's F32, F16 and BF16 weights decode in their own precision. PyTorch's products at
batch 1 (MKL's sgemv, oneDNN's bf16) stay on one core or convert the weight on every call.
FloatLinear keeps nn.Linear's row-major weight and multiplies it on every core, with AVX512_BF16
where the CPU has it. block_linear.py builds the C++ and picks its path (ISA). quantize.py
decides which layers get it."""

import torch
import torch.nn.functional as F
from torch import nn

from picollama.kernels import block_linear

PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16}  # quantize() modes.


class FloatLinear(nn.Module):
    """A bias-free CPU linear layer on a float32 or bfloat16 weight (out, in), summing in float32.

    The weight keeps its dtype when the model is cast, so a bfloat16 file stays bfloat16 under
    float32 activations. With bfloat16 weights the kernel rounds x to bfloat16, as llama.cpp
    does. The output has the input's dtype: float32 or bfloat16."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or not weight.is_contiguous():
            weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.weight = weight  # The same Parameter where it can be: a tied embedding stays tied.
        self.kept = weight.dtype

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight.dtype != self.kept:  # Keep the file's precision, whatever .to(dtype) did.
            self.weight = nn.Parameter(self.weight.to(self.kept), requires_grad=False)
        return self

    @classmethod
    def fits(cls, linear: nn.Module) -> bool:
        """Whether a layer is a CPU nn.Linear without a bias."""
        cpu = isinstance(linear, nn.Linear) and linear.weight.device.type == "cpu"
        return cpu and linear.bias is None

    @classmethod
    def stored(cls, linear: nn.Linear, precision: str) -> "FloatLinear":
        """linear's weight in `precision` (PRECISIONS). A weight already in it is shared."""
        weight = linear.weight
        if weight.dtype != PRECISIONS[precision]:
            weight = weight.detach().to(PRECISIONS[precision])
        return cls(weight)

    @classmethod
    def joined(cls, layers: list[nn.Module]) -> "FloatLinear | None":
        """One layer with the concatenated outputs of `layers`, or None unless all are FloatLinears
        of one dtype."""
        if not all(isinstance(layer, cls) and layer.kept == layers[0].kept for layer in layers):
            return None
        return cls(torch.cat([layer.weight.detach() for layer in layers]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = block_linear.block_ops()
        if ops is None:
            return F.linear(x, self.weight.to(x.dtype))
        return block_linear.product(ops, "float_linear", x, self.weight)

    def extra_repr(self) -> str:
        out, inputs = self.weight.shape
        return f"in_features={inputs}, out_features={out}, {self.kept}"
