"""Read a prepared dataset (meta.json, token shards, document offsets) as batches of token ids.
It checks the files against meta.json, but never tokenizes text."""

import json
import math
from pathlib import Path

import numpy as np
import torch

from data.shard_values import check_ids, check_mask, read_offsets
from data.shards import docs_name, mask_name, split_shards
from data.tokenizer import same_tokenizer, tokenizer_file, tokenizer_sha256
from picollama.cli import UserError
from picollama.cli.flags import check_type
from picollama.cli.named_files import inside
from picollama.config.model_args import SIZE_LIMITS

SPLITS = ("train", "val")


def load_meta(data_dir) -> dict:
    """The dataset's meta.json as a dict. UserError unless it holds a JSON object."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(
            f"{data_dir} is not a prepared dataset (no meta.json); run python data/prepare.py first"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        raise UserError(
            f"{path} is not valid JSON ({exc}); prepare the dataset again with --force"
        ) from None
    if not isinstance(meta, dict):
        raise UserError(
            f"{path} holds {json.dumps(meta)[:40]}, not the JSON object prepare writes; "
            "prepare the dataset again with --force"
        )
    return meta


def checked_meta(data_dir) -> dict:
    """load_meta, with the keys training reads checked, and a UserError naming a bad one. The
    tokenizer is checked against the sha256 meta.json records. Training would not notice another."""
    meta = load_meta(data_dir)
    try:
        for key, kind in (("vocab_size", int), ("bytes_per_token", float)):
            check_type(f"{data_dir}/meta.json {key}", meta.get(key), kind)
        for split in SPLITS:
            tokens = meta["splits"][split].get("tokens")
            check_type(f"{data_dir}/meta.json splits.{split}.tokens", tokens, int)
    except (KeyError, TypeError, AttributeError):
        raise UserError(
            f"{data_dir}/meta.json lacks its splits; prepare the dataset again with --force"
        ) from None
    if not (math.isfinite(meta["bytes_per_token"]) and meta["bytes_per_token"] > 0):
        raise UserError(
            f"{data_dir}/meta.json bytes_per_token must be a positive number, not "
            f"{meta['bytes_per_token']!r}; prepare the dataset again with --force"
        )
    check_meta_counts(data_dir, meta)
    check_dataset_tokenizer(data_dir, meta)
    return meta


def check_meta_counts(data_dir, meta: dict) -> None:
    """UserError unless meta.json's vocab_size lies in 1..SIZE_LIMITS' and each split's token count
    is its shards' sum. open_tokens holds each shard to its file's size. A false count once passed
    the "too few tokens" check and was printed as the dataset's size."""
    where = f"{data_dir}/meta.json"
    vocab_size, limit = meta["vocab_size"], SIZE_LIMITS["vocab_size"]
    if not 0 < vocab_size <= limit:
        raise UserError(
            f"{where} vocab_size must be 1 to {limit:,}, not {vocab_size:,}; prepare the "
            "dataset again with --force"
        )
    for split in SPLITS:
        try:
            counted = sum(int(shard["tokens"]) for shard in split_shards(meta, split))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where} lacks the {split} split's shards ({exc})") from None
        tokens = meta["splits"][split]["tokens"]
        if tokens != counted:
            raise UserError(
                f"{where} splits.{split}.tokens is {tokens:,}, but its shards hold {counted:,} "
                "tokens; prepare the dataset again with --force"
            )


def check_dataset_tokenizer(data_dir, meta: dict) -> None:
    """UserError unless data_dir holds a tokenizer (tokenizer.model or tokenizer.json) with the
    sha256 meta.json records. Any one passes where it records none. The shards hold that
    tokenizer's ids."""
    path = tokenizer_file(data_dir)
    recorded = check_type(
        f"{data_dir}/meta.json tokenizer_sha256", meta.get("tokenizer_sha256"), str | None
    )
    if path is None:
        raise UserError(
            f"{data_dir} has no tokenizer.model or tokenizer.json; put back the one it was "
            "prepared with"
        )
    if not same_tokenizer(recorded, path):
        raise UserError(
            f"{path} is not the tokenizer {data_dir} was prepared with (sha256 "
            f"{tokenizer_sha256(path)[:12]}, meta.json records {recorded[:12]}): the shards hold "
            f"another tokenizer's ids; put back its own {path.name} or prepare the dataset again"
        )


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


class ShardedTokens:
    """A split in several shards, read as one sequence: len(), slices (copied), integer indexing."""

    def __init__(self, shards: list[np.memmap]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(shard) for shard in shards])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(len(self))
            first = int(np.searchsorted(self.starts, start, side="right")) - 1
            parts = []
            while start < stop:
                shard = self.shards[first]
                take = min(stop, int(self.starts[first + 1])) - start
                offset = start - int(self.starts[first])
                parts.append(shard[offset : offset + take])
                start += take
                first += 1
            return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        positions = np.asarray(index)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens takes slices and integer positions, not {index!r}")
        positions = np.where(positions < 0, positions + len(self), positions)
        which = np.searchsorted(self.starts, positions, side="right") - 1
        out = np.empty(positions.shape, dtype=self.dtype)
        for shard in np.unique(which):
            mask = which == shard
            out[mask] = self.shards[shard][positions[mask] - self.starts[shard]]
        return out[()] if out.ndim == 0 else out

    def __array__(self, dtype=None, copy=None):
        return np.concatenate(self.shards).astype(dtype or self.dtype, copy=False)


def shard_path(data_dir, name, split: str) -> Path:
    """A file of a split's shard as meta.json names it, inside the dataset (named_files.inside)."""
    return inside(name, Path(data_dir) / "meta.json", f"splits.{split}.shards")


def open_tokens(data_dir, split) -> np.memmap | ShardedTokens:
    """The split's token ids as a read-only memmap, or a ShardedTokens over its shards' memmaps.
    Nothing is loaded into memory up front. UserError unless each shard holds exactly the tokens
    meta.json counts."""
    _check_split(split)
    meta = load_meta(data_dir)
    try:
        dtype = np.dtype(meta["dtype"])
        shards = split_shards(meta, split)
        sizes = [(shard["file"], int(shard["tokens"])) for shard in shards]
    except (KeyError, TypeError, ValueError) as exc:
        problem = f"lacks the {split} split's dtype or shards ({exc})"
        raise UserError(
            f"{data_dir}/meta.json {problem}; prepare the dataset again with --force"
        ) from None
    memmaps = []
    for name, tokens in sizes:
        path = shard_path(data_dir, name, split)
        size = path.stat().st_size if path.is_file() else 0
        expected = tokens * dtype.itemsize
        if size != expected or not tokens:
            raise UserError(
                f"{path} holds {size:,} bytes but meta.json counts {tokens:,} {dtype.name} tokens "
                f"({expected:,} bytes): the shard is truncated, missing or from another dataset; "
                "prepare it again with --force"
            )
        memmaps.append(np.memmap(path, dtype=dtype, mode="r"))
    if not memmaps:
        raise UserError(
            f"{data_dir}: the {split} split has no tokens; prepare it again with --force"
        )
    return memmaps[0] if len(memmaps) == 1 else ShardedTokens(memmaps)


def open_mask(data_dir, split) -> np.memmap | ShardedTokens:
    """A conversations dataset's loss mask of the split, shaped as open_tokens' tokens. It is uint8,
    1 on each token the loss trains, from X.mask.bin beside each shard. UserError unless each has
    one byte per shard token."""
    _check_split(split)
    meta = load_meta(data_dir)
    if meta.get("kind", "text") != "conversations":
        raise UserError(
            f"{data_dir} is a {meta.get('kind', 'text')} dataset, not a chat (conversations) "
            "dataset, so it has no loss mask on replies; make one from conversations with python "
            "data/prepare.py --source chats.jsonl --tokenizer RUN --out DIR"
        )
    memmaps = []
    for shard in split_shards(meta, split):
        path = shard_path(data_dir, mask_name(shard["file"]), split)
        size = path.stat().st_size if path.is_file() else 0
        if size != int(shard["tokens"]) or not size:
            raise UserError(
                f"{path} holds {size:,} bytes but meta.json counts {int(shard['tokens']):,} "
                "tokens (one mask byte each): it is missing, truncated or from another dataset; "
                "prepare it again with --force"
            )
        memmaps.append(check_mask(np.memmap(path, dtype=np.uint8, mode="r")))
    if not memmaps:
        raise UserError(f"{data_dir}: the {split} split has no mask; prepare it again with --force")
    return memmaps[0] if len(memmaps) == 1 else ShardedTokens(memmaps)


def doc_offsets(data_dir, split) -> np.ndarray:
    """Start offset (the BOS position) of each document in the split: int64, ascending, first 0.
    UserError naming a .docs.npy that breaks this or points past its shard (one pass over each)."""
    _check_split(split)
    offsets = []
    start = 0
    for shard in split_shards(load_meta(data_dir), split):
        path = shard_path(data_dir, docs_name(shard["file"]), split)
        shard_offsets = read_offsets(path, int(shard["tokens"]), first=not offsets)
        offsets.append(shard_offsets + start)
        start += int(shard["tokens"])
    return np.concatenate(offsets)


def check_token_ids(data_dir, split, vocab_size: int) -> None:
    """UserError naming a shard of the split that holds a token id outside 0..vocab_size - 1, which
    no embedding of that vocabulary holds (an IndexError mid-run once). One vectorized pass over
    the shards (shard_values.check_ids)."""
    tokens = open_tokens(data_dir, split)
    for shard in tokens.shards if isinstance(tokens, ShardedTokens) else [tokens]:
        check_ids(shard, vocab_size)


def _to_device(
    windows: np.ndarray, device, unpredictable: np.ndarray | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split (B, T+1) windows into int64 x and y = x shifted by one, both contiguous, on device.
    y is -100, ignored by the loss, where `unpredictable` (B, T+1) marks the token."""
    x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1], dtype=np.int64))
    y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:], dtype=np.int64))
    if unpredictable is not None:
        y[torch.from_numpy(unpredictable[:, 1:])] = -100
    if torch.device(device).type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.to(device), y.to(device)


def _check_fits(tokens: np.ndarray, split: str, seq_len: int) -> None:
    if seq_len < 1:
        raise UserError(f"seq_len must be at least 1, got {seq_len}")
    if seq_len + 1 > len(tokens):
        raise UserError(
            f"seq_len {seq_len} needs {seq_len + 1} tokens but the {split} split has only "
            f"{len(tokens)}"
        )


def copy_vocabulary(meta: dict) -> np.ndarray:
    """The token ids random copy spans draw from, uniformly. That is the whole vocabulary but its
    control tokens (unk, BOS, EOS, pad), so no language prior can predict a span."""
    special = {meta.get(key) for key in ("unk_id", "bos_id", "eos_id", "pad_id")}
    return np.array([i for i in range(meta["vocab_size"]) if i not in special], dtype=np.int64)


def plant_copies(
    windows: np.ndarray, rng: np.random.Generator, vocabulary: np.ndarray, span: int, repeats: int
):
    """Plant a random span of `span` ids from `vocabulary` in each row of windows (B, T), in place.
    `repeats` exact copies follow later in the row, at random places. The row's own text fills the
    gaps, which may be empty. Returns the (B, T) mask of tokens nothing can predict: the first
    occurrence and each copy's first token."""
    rows, length = windows.shape
    occurrences = repeats + 1
    free = length - occurrences * span
    if free < 0:
        raise UserError(
            f"a copy span of {span} tokens and {repeats} repeats need {occurrences * span} tokens; "
            f"the window has {length}"
        )
    starts = (
        np.sort(rng.integers(0, free + 1, size=(rows, occurrences)), axis=1)
        + np.arange(occurrences) * span
    )
    spans = vocabulary[rng.integers(0, len(vocabulary), size=(rows, span))]
    positions = starts[:, :, None] + np.arange(span)  # (rows, occurrences, span)
    windows[np.arange(rows)[:, None, None], positions] = spans[:, None, :]
    unpredictable = np.zeros(windows.shape, dtype=bool)
    unpredictable[np.arange(rows)[:, None], positions[:, 0]] = True
    unpredictable[np.arange(rows)[:, None], starts] = True
    return unpredictable


class RandomBatches:
    """Random windows of seq_len+1 tokens from a split, seeded and resumable. Under torchrun every
    rank draws the same global batch and keeps its own rows (train.py). So the data never depends
    on the number of ranks.

    With copy_fraction > 0, each window gets synthetic copy data with that probability
    (plant_copies). These are Bi-Induct-style forward-copy snippets (Sabry & Belz 2025), planted
    here inside real text. Their unpredictable tokens are -100 in y, so the loss trains only the
    copies and the text. They give induction heads something to form on. `generate.py
    extrapolate`'s copy probe tells whether they did."""

    def __init__(
        self,
        data_dir,
        split,
        batch_size,
        seq_len,
        seed=0,
        device="cpu",
        copy_fraction=0.0,
        copy_span=16,
        copy_repeats=1,
    ):
        if not 0 <= copy_fraction < 1:
            raise UserError(f"copy_fraction must be at least 0 and below 1, not {copy_fraction}")
        if copy_span < 2 or copy_repeats < 1:
            raise UserError(
                f"copy_span must be >= 2 and copy_repeats >= 1, not {copy_span} and {copy_repeats}"
            )
        if copy_fraction and copy_span * (copy_repeats + 1) > seq_len + 1:
            raise UserError(
                f"copy_span × (copy_repeats + 1) = {copy_span * (copy_repeats + 1)} tokens do not "
                f"fit a window of seq_len + 1 = {seq_len + 1}; shorten the span or repeat it less"
            )
        self.tokens = open_tokens(data_dir, split)
        _check_fits(self.tokens, split, seq_len)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.device = device
        self.copy_fraction = copy_fraction
        self.copy_span = copy_span
        self.copy_repeats = copy_repeats
        self.vocabulary = copy_vocabulary(load_meta(data_dir)) if copy_fraction else None
        self.rng = np.random.default_rng(seed)

    def starts(self) -> np.ndarray:
        """The batch's windows' first positions: uniform, with replacement."""
        return self.rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (batch_size, seq_len), int64, on the device."""
        starts = self.starts()
        windows = [self.tokens[start : start + self.seq_len + 1] for start in starts]
        windows = np.stack(windows).astype(np.int64)
        if not self.copy_fraction:
            return _to_device(windows, self.device)
        rows = np.flatnonzero(self.rng.random(self.batch_size) < self.copy_fraction)
        unpredictable = np.zeros(windows.shape, dtype=bool)
        copies = windows[rows]
        unpredictable[rows] = plant_copies(
            copies, self.rng, self.vocabulary, self.copy_span, self.copy_repeats
        )
        windows[rows] = copies
        return _to_device(windows, self.device, unpredictable)

    def state_dict(self) -> dict:
        """Plain-Python state (JSON- and torch.save-able) that load_state_dict resumes exactly."""
        return {"task": "text", "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        # Older states name no task. They name a rank, always 0, and world size 1.
        if state.get("task", "text") != "text":
            raise UserError(
                "the checkpoint's loader state is not a text dataset's; resume with its data.task"
            )
        self.rng.bit_generator.state = state["rng"]


def eval_batches(data_dir, split, batch_size, seq_len, max_batches=None, device="cpu"):
    """Sequential, non-overlapping (x, y) batches over the split, deterministic, at most
    max_batches. Window i covers x = tokens[i*seq_len : (i+1)*seq_len]. The last batch may have
    fewer than batch_size rows."""
    tokens = open_tokens(data_dir, split)
    _check_fits(tokens, split, seq_len)
    num_windows = (len(tokens) - 1) // seq_len
    for batch_index, first in enumerate(range(0, num_windows, batch_size)):
        if max_batches is not None and batch_index >= max_batches:
            return
        last = min(first + batch_size, num_windows)
        windows = np.stack(
            [tokens[i * seq_len : (i + 1) * seq_len + 1] for i in range(first, last)]
        )
        yield _to_device(windows, device)


def document_windows(data_dir, split, length, num_windows, seed=0) -> np.ndarray:
    """(num_windows, length) int64 windows, each inside a single document, deterministic for a
    seed. Documents shorter than length are skipped. UserError if none is long enough."""
    tokens = open_tokens(data_dir, split)
    starts = doc_offsets(data_dir, split)
    lengths = np.diff(np.append(starts, len(tokens)))
    usable = lengths >= length
    if not usable.any():
        raise UserError(
            f"no {split} document is {length} tokens long (the longest has {lengths.max()}); "
            "use a shorter length or a corpus with longer documents"
        )
    # Every valid window start across the usable documents, numbered 0..total-1 in document order.
    doc_starts = starts[usable]
    positions = lengths[usable] - length + 1
    cumulative = np.cumsum(positions)
    total = int(cumulative[-1])
    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(total, size=num_windows, replace=num_windows > total))
    docs = np.searchsorted(cumulative, picks, side="right")
    window_starts = doc_starts[docs] + picks - (cumulative[docs] - positions[docs])
    return np.array(
        [tokens[start : start + length] for start in window_starts], dtype=np.int64
    ).reshape(-1, length)
