"""Gated attention (model.attention_gate; Qiu et al. 2025, Qwen3-Next's): the heads' output, before
wo, times σ(wg·x) elementwise, x the layer's (normed) input — a non-linearity between wv and wo, and
a way for a head to add nothing. registry.py puts it in model.py's OUTPUT_GATES."""

import torch
from torch import nn

from model import ModelArgs


class AttentionGate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.wg = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out (B, T, heads·head_dim): the heads' outputs side by side; x (B, T, dim)."""
        return out * torch.sigmoid(self.wg(x))
