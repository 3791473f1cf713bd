"""A model's per-token losses and top-1 hits on rows of tokens.

Rows are scored whole, through sliding windows, or in blocks of rows."""

import numpy as np
import torch
import torch.nn.functional as F

from model import Transformer
from picollama.lab.cost import HEAD_CHUNK, block_rows
from picollama.lab.interruptible import interruptible


def losses_and_hits(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cross-entropy and top-1 hits, both (B, T-1), of each of tokens[:, 1:].

    Each token is scored given everything before it. The logits are made HEAD_CHUNK positions at
    a time. At 32k tokens and a 49k vocabulary they would be 6 GB in float32 at once. Long
    lengths take minutes, so this runs in a worker thread (interruptible). A signal is then
    answered at once."""
    return interruptible(scored, model, tokens)


def scored(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """losses_and_hits, computed in this thread."""
    h = model.features(tokens[:, :-1])
    targets = tokens[:, 1:]
    losses, hits = [], []
    for start in range(0, h.shape[1], HEAD_CHUNK):
        logits = model.head(h[:, start : start + HEAD_CHUNK]).float()
        wanted = targets[:, start : start + HEAD_CHUNK]
        losses.append(F.cross_entropy(logits.transpose(1, 2), wanted, reduction="none"))
        hits.append(logits.argmax(-1) == wanted)
    return torch.cat(losses, dim=1), torch.cat(hits, dim=1)


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    return losses_and_hits(model, tokens)[0]


def sliding_losses(
    model: Transformer, tokens: torch.Tensor, context: int, stride: int | None = None
) -> torch.Tensor:
    """token_losses over (1, T) tokens, seen through windows of `context` tokens.

    The windows move by `stride`, by default context/2. Each token after the first window has at
    least context - stride tokens before it. A stride of context - 1 cuts windows that share only
    their ends, as train.py's validation does."""
    length = tokens.shape[1]
    stride = stride or max(context // 2, 1)
    pieces = []
    start = 0
    scored = 1  # The next target position.
    while scored < length:
        end = min(start + context, length)
        pieces.append(token_losses(model, tokens[:, start:end])[:, scored - start - 1 :])
        scored = end
        start += stride
    return torch.cat(pieces, dim=1)


def row_blocks(array: np.ndarray, length: int, device):
    """The rows of array in consecutive blocks, as tensors on device, of cost.block_rows rows."""
    rows = block_rows(length, len(array))
    for start in range(0, len(array), rows):
        yield torch.from_numpy(array[start : start + rows]).to(device)
