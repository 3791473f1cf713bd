"""The values inside a prepared dataset's files, checked as they are opened: token ids within the
model's vocabulary, loss-mask bytes of 0 or 1, document offsets rising from 0 within their shard.
Each check is one vectorized pass over its file. data/loader.py opens the files and checks their
sizes against meta.json. A damaged file once trained silently, or stopped mid-run with an
IndexError."""

from pathlib import Path

import numpy as np

from picollama.cli import UserError

AGAIN = "prepare the dataset again with --force"


def check_ids(shard: np.memmap, vocab_size: int) -> None:
    """UserError naming the shard unless each token id lies in 0..vocab_size - 1."""
    if int(shard.min()) >= 0 and int(shard.max()) < vocab_size:
        return
    at = int(np.argmax((shard < 0) | (shard >= vocab_size)))
    raise UserError(
        f"{shard.filename} holds token id {int(shard[at]):,} (token {at:,}), outside the model's "
        f"vocabulary of {vocab_size:,} (model.vocab_size): the shard is damaged or holds another "
        f"tokenizer's ids; {AGAIN}"
    )


def check_mask(mask: np.memmap) -> np.memmap:
    """The mask, or a UserError naming its file if a byte is neither 0 nor 1."""
    if (top := int(mask.max())) > 1:
        raise UserError(
            f"{mask.filename} holds {top} at token {int(np.argmax(mask > 1)):,}: a loss mask holds "
            f"0 or 1 a token, so it is damaged; {AGAIN}"
        )
    return mask


def read_offsets(path: Path, tokens: int, first: bool) -> np.ndarray:
    """A shard's document offsets as int64: non-decreasing, each below its `tokens`, and from 0
    in the split's `first` shard. A UserError names the file otherwise."""
    try:
        offsets = np.load(path)
    except (OSError, ValueError, EOFError) as exc:
        problem = f"cannot be read ({str(exc).strip()[:120] or type(exc).__name__})"
    else:
        problem = offsets_problem(offsets, tokens, first)
    if problem:
        raise UserError(f"{path}: {problem}; it is damaged or from another dataset, so {AGAIN}")
    return offsets.astype(np.int64, copy=False)


def offsets_problem(offsets: np.ndarray, tokens: int, first: bool) -> str | None:
    """What is wrong with a shard's document offsets, or None."""
    if not isinstance(offsets, np.ndarray):  # np.load reads a .npz archive too.
        return f"holds a {type(offsets).__name__}, not an array of offsets"
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        return f"holds a {offsets.dtype} array of shape {offsets.shape}, not offsets"
    offsets = offsets.astype(np.int64, copy=False)  # So a difference never wraps around.
    if first and (not len(offsets) or offsets[0] != 0):
        return "its first document does not start at token 0"
    if len(offsets) and (falls := np.flatnonzero(np.diff(offsets) < 0)).size:
        return f"offset {falls[0] + 1} ({offsets[falls[0] + 1]:,}) falls below the one before"
    if len(offsets) and not 0 <= offsets[0] <= offsets[-1] < tokens:
        return f"an offset lies outside its shard's {tokens:,} tokens"
    return None
