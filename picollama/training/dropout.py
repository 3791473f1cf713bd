"""Dropout for when data is scarce, kept out of the model's forward. A forward hook drops what
writes to the residual stream: the embedding, each attention's wo and each FFN's w2. Those are
the places nanoGPT drops."""

from functools import partial

import torch.nn.functional as F
from torch import nn


def drop(p: float, module: nn.Module, args, output):
    return F.dropout(output, p, module.training)


def add_dropout(model: nn.Module, p: float):
    """Zero each residual write's elements with probability p while the model trains (0: none)."""
    if not p:
        return
    writers = [model.tok_embeddings]
    for layer in model.layers:
        writers += [layer.attention.wo, layer.feed_forward.w2]
    for module in writers:
        module.register_forward_hook(partial(drop, p))
