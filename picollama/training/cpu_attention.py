"""The attention a CPU trains with. PyTorch's CPU flash kernel is slower at these lengths. So
causal self-attention is written out as two matrix products and a softmax, for the compiler to
fuse around."""

import torch
import torch.nn.functional as F

from picollama.device import cpu_sdpa

# The longest context written out. The (T, T) scores of every head are kept for the backward.
# The default's 256 was measured (docs/findings.md). Past this, flash attention keeps memory linear.
MAX_LEN = 512


def written_out_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """F.scaled_dot_product_attention for causal self-attention of q, k, v (B, heads, T, head dim).
    Up to MAX_LEN it is softmax(q·kᵀ/√d) in fp32, the future masked, times v. Else it is F's."""
    length = q.shape[-2]
    simple = attn_mask is None and is_causal and not enable_gqa and k.shape[-2] == length
    if not simple or length > MAX_LEN:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa
        )
    # The first half of the queries sees only the first half of the keys. Scoring the halves apart
    # skips a quarter of the (T, T) scores, all masked. That saves 6.5% of a step on a Zen 4.
    half = length // 2
    if not half:
        return attend(q, k, v, 0)
    first = attend(q[..., :half, :], k[..., :half, :], v[..., :half, :], 0)
    return torch.cat([first, attend(q[..., half:, :], k, v, half)], dim=-2)


def attend(q, k, v, start: int):
    """softmax(q·kᵀ/√d) in fp32 times v, for queries from position `start` over keys from 0.
    Each query sees the keys up to its own position."""
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    shape = (q.shape[-2], k.shape[-2])
    future = torch.ones(shape, dtype=torch.bool, device=q.device).triu(start + 1)
    return scores.masked_fill(future, float("-inf")).softmax(-1).to(v.dtype) @ v


def cpu_training_attention(device: torch.device):
    """While it lasts, the model's attention on a CPU device is written_out_sdpa. A compiled step
    of the default model ran 8-10% faster on a 2-core Zen 4, and 6.5% more in halves."""
    return cpu_sdpa(device, written_out_sdpa)
