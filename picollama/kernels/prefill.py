"""Sampling's prefill attends through prefill_attention.cpp on a CPU.

PyTorch's CPU flash kernel multiplies through MKL, which is slow on AMD CPUs. A turn's new
tokens after a kept conversation (136 queries over 1,953 keys, SmolLM2-135M) took 4.1 ms a layer
through SDPA, 1.6 through prefill_attention and 1.1 with its bf16 products, on two Zen 5 cores.
While a prefill lasts, prefill_sdpa takes SDPA's place (model.SDPA_KERNEL). It hands SDPA every
case the kernel does not cover: another device or dtype, gradients, a float or per-head mask.

bf16 products (bf16_products) round the queries, keys, values and probabilities to bf16 and sum
in fp32, at twice fp32's rate on a CPU with AVX512-BF16 (elsewhere the kernel keeps fp32).
A model in bf16 loses nothing there: PyTorch's SDPA also rounds its probabilities to bf16. A
block-format model (block_linear.py) rounds every product's inputs to int8, so its logits move
about as much when its attention merely changes kernel (fp32 through SDPA against this one) as
with bf16 products: docs/serving.md#prefix-reuse has the figures.
"""

from functools import partial

import torch
import torch.nn.functional as F

from picollama.device import cpu_sdpa
from picollama.kernels.block_linear import BlockLinear
from picollama.kernels.decode_ops import decode_ops

HEAD_DIMS = (32, 64, 96, 128)  # the kernel's tiles
DTYPES = (torch.float32, torch.bfloat16)


def kernel_mask(q, k, mask, is_causal: bool):
    """The mask as prefill_attention takes it: (B or 1, T, S) bool, or None for causal from the
    end. False where the kernel does not cover the case."""
    (batch, _, length, _), keys = q.shape, k.shape[2]
    if mask is None:  # A lone query sees every key. SDPA's is_causal aligns at the start.
        return None if (length == 1 or (is_causal and length == keys)) else False
    if is_causal or mask.dtype != torch.bool or mask.dim() not in (2, 4):
        return False
    if mask.dim() == 4 and (mask.shape[1] != 1 or mask.shape[0] not in (1, batch)):
        return False
    if mask.shape[-2:] != (length, keys):
        return False
    return mask.reshape(-1, length, keys)


def covered(q, k, v) -> bool:
    """Whether prefill_attention computes SDPA for these tensors."""
    return (
        q.device.type == "cpu"
        and not (torch.is_grad_enabled() and q.requires_grad)
        and q.dim() == k.dim() == 4
        and q.shape[0] == k.shape[0]
        and q.dtype in DTYPES
        and k.dtype in DTYPES
        and k.dtype == v.dtype
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] % k.shape[1] == 0
        and q.shape[2] <= k.shape[2]
    )


def prefill_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, bf16=False):
    """F.scaled_dot_product_attention at the default scale, through prefill_attention where it
    covers the case. bf16: its products take bf16 inputs (bf16_products says where)."""
    ops = decode_ops() if covered(q, k, v) else None
    mask = False if ops is None else kernel_mask(q, k, attn_mask, is_causal)
    if mask is False:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )
    k, v = per_head_contiguous(k), per_head_contiguous(v)
    return ops.prefill_attention(q, k, v, mask, bf16).to(q.dtype)


def per_head_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t (B, heads, S, D), copied unless each head's rows already sit one after another (a KV
    cache's first S positions do)."""
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


def bf16_products(model) -> bool:
    """Whether the model's prefill attends with bf16 products: a bf16 model, or one whose
    products round their inputs to int8 (BlockLinear)."""
    if model.tok_embeddings.weight.dtype == torch.bfloat16:
        return True
    return any(isinstance(module, BlockLinear) for module in model.layers[0].modules())


def cpu_prefill_attention(model):
    """While it lasts, the model's attention on a CPU device is prefill_sdpa, with bf16 products
    where bf16_products says."""
    device = model.tok_embeddings.weight.device
    return cpu_sdpa(device, partial(prefill_sdpa, bf16=bf16_products(model)))
