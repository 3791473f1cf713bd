"""Key-token perplexity in the manner of LongPPL (Fang et al., ICLR 2025): perplexity on the tokens
whose loss depends on long context, which tracks long-context ability where plain perplexity, an
average dominated by tokens that local context predicts, does not."""

import math

import numpy as np

from picollama.lab.runs import spread

# LongPPL's thresholds (its code's alpha and beta): a key token's loss falls by more than GAIN nats
# from the short context to the long one, and ends below CONFIDENT nats (log-probability > -2)
GAIN = 2.0
CONFIDENT = 2.0


def key_token_mask(short: np.ndarray, long: np.ndarray) -> np.ndarray:
    """Which tokens are key tokens, from their losses with the short and the long context."""
    return (short - long > GAIN) & (long < CONFIDENT)


def pick_evaluator(losses: dict, short: str, long: str):
    """The (run, method) of `losses` ({(run, method): {length: token losses or None}}) that finds
    the most key tokens between the `short` and the `long` length (ties: the lower mean loss at
    `long`): the model that uses the long context most, as LongPPL picks a strong long-context
    model to find the key tokens every other model is scored on. None where none scores both."""
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
    """Perplexity on the key tokens (mask) at each length, with its ratio to the `short` length's
    (None where the length was not scored)."""
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
    """The key tokens between the `short` and `long` lengths, found by pick_evaluator, and each
    (run, method) of `losses` scored on them: (what was found, {(run, method): key_token_cells});
    no cells where no key token was found."""
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
