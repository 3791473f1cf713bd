"""Key-token perplexity, in the manner of LongPPL (Fang et al., ICLR 2025).

It is perplexity on the tokens whose loss depends on long context. Plain perplexity averages
over all tokens, and local context predicts most of them. So it misses long-context ability,
which key-token perplexity tracks."""

import math

import numpy as np

from picollama.lab.runs import spread

# LongPPL's thresholds, its code's alpha and beta. A key token's loss falls by more than GAIN
# nats from the short context to the long one. It ends below CONFIDENT nats (log-prob > -2).
GAIN = 2.0
CONFIDENT = 2.0


def key_token_mask(short: np.ndarray, long: np.ndarray) -> np.ndarray:
    """Which tokens are key tokens, from their losses with the short and the long context."""
    return (short - long > GAIN) & (long < CONFIDENT)


def pick_evaluator(losses: dict, short: str, long: str):
    """The (run, method) that finds the most key tokens between the `short` and `long` lengths.

    `losses` maps (run, method) to {length: token losses or None}. Ties go to the lower mean loss
    at `long`. This picks the model that uses long context most. LongPPL likewise picks a strong
    long-context model to find the key tokens that all models are scored on. None if no pair
    scores both lengths."""
    best, best_rank = None, None
    for pair, by_length in losses.items():
        if by_length.get(short) is None or by_length.get(long) is None:
            continue
        found = int(key_token_mask(by_length[short], by_length[long]).sum())
        rank = (-found, float(by_length[long].mean()))
        if best_rank is None or rank < best_rank:
            best, best_rank = pair, rank
    return best


def key_token_cells(by_length: dict, mask: np.ndarray, short: str) -> dict:
    """Perplexity on the key tokens (mask) at each length, and its ratio to the `short` one's.

    A length that was not scored gets None."""
    cells = {}
    for length, token_losses in by_length.items():
        cells[length] = None
        if token_losses is not None:
            loss = spread(token_losses[mask])
            cells[length] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
    reference = cells.get(short)
    for cell in filter(None, cells.values()):
        cell["ratio"] = cell["perplexity"] / reference["perplexity"] if reference else None
    return cells


def key_tokens(losses: dict, short: int, long: int) -> tuple[dict, dict]:
    """Find key tokens between the `short` and `long` lengths, and score every pair on them.

    pick_evaluator finds them. Returns (what was found, {(run, method): key_token_cells}). With
    no key tokens found, there are no cells."""
    short, long = str(short), str(long)
    evaluator = pick_evaluator(losses, short, long)
    found = {"short": int(short), "long": int(long), "gain": GAIN, "confident": CONFIDENT}
    found |= {"evaluator": evaluator and list(evaluator), "count": 0, "scored": 0}
    if evaluator is None:
        return found, {}
    mask = key_token_mask(losses[evaluator][short], losses[evaluator][long])
    found |= {"count": int(mask.sum()), "scored": int(mask.size)}
    if not mask.any():
        return found, {}
    return found, {
        pair: key_token_cells(by_length, mask, short) for pair, by_length in losses.items()
    }
