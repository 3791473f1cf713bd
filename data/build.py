"""Build a dataset folder: the tokenizer, the shards block by block, then meta.json. It resumes
after an interruption, one writer at a time."""

import itertools
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.dataset_dir import (
    FORMAT_VERSION,
    check_own,
    existing_output,
    partial_dir,
    read_json,
    summary,
    write_json,
)
from data.shards import (
    ShardWriter,
    check_shard_count,
    cuts_after_newlines,
    document_pieces,
    encode_pieces,
    join_documents,
)
from data.sources import (
    HF_DEFAULT_MAX_BYTES,
    default_name,
    iter_blocks,
    iter_documents,
    open_source,
    source_fingerprint,
    utf8_size,
)
from data.splitting import SEED, VAL_FRACTION, Splitter
from data.tokenizer import (
    TOKENIZER_CONFIG,
    load_tokenizer,
    tokenizer_file,
    tokenizer_name,
    tokenizer_sha256,
)
from data.tokenizer_training import cpu_count, tokenizer_sample, train_tokenizer
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.outputs import (
    check_free_space,
    check_writable,
    exclusive,
    remove,
    replace,
    resolved,
)

BLOCK_BYTES = 32_000_000  # Documents are split, encoded and saved in blocks of this much text.
# BPE training is single-threaded. Its time and memory grow with the sample's size and variety.
# On 40 MB of Python sources, 8 MB trained a 4,096-piece vocabulary in ~8 s (0.31 GB). 32 MB took
# ~35 s (0.57 GB), yet compressed held-out text only 0.8% better (0.9% at 16,384 pieces). So the
# tokenizer trains on at most 8 MB, a seeded choice of the first block's training documents.
# Shakespeare (5.06 MB) fits whole.
TOKENIZER_SAMPLE_BYTES = 8_000_000
SHARD_TOKENS = 100_000_000


def resumable(work: Path, inputs: dict) -> dict | None:
    """Progress of an interrupted preparation of these inputs in `work`. Else None (removing it)."""
    progress = read_json(work / "progress" / "progress.json")
    if progress and progress.get("inputs") == inputs and tokenizer_file(work) is not None:
        return progress
    remove(work)
    return None


def first_blocks(blocks, splitter: Splitter, sample_bytes: int) -> list[tuple]:
    """The first split blocks, enough for sample_bytes of text, at least one. UserError if none."""
    head = []
    total = 0
    for index, texts, sizes, last in blocks:
        head.append((index, *splitter(index, texts, sizes, last), sum(sizes)))
        total += sum(sizes)
        if total >= sample_bytes:
            break
    if not head:
        raise UserError("the corpus is empty (no non-empty documents)")
    return head


def check_free_disk(
    folder: Path, source_bytes: int | None, tokens_per_byte: float, dtype: np.dtype
):
    """UserError when the shards of source_bytes more text bytes (None: unknown) would not fit."""
    if source_bytes is None:
        return
    needed = int(source_bytes * tokens_per_byte * dtype.itemsize * 1.05) + (1 << 20)
    check_free_space(folder, needed, f"the shards to {folder}")


def check_room(
    work: Path, left: int | None, done: int, per_byte: float, dtype: np.dtype, shard_tokens: int
):
    """UserError, before another shard is written, if the shards of the `left` text bytes (None:
    unknown) would not fit. They count `per_byte` tokens a byte after `done` tokens. Too little
    disk or too many files fail. A preparation with no shard yet leaves nothing behind."""
    if left is None:
        return
    try:
        check_free_disk(work, left, per_byte, dtype)
        check_shard_count(done + int(left * per_byte), shard_tokens)
    except UserError:
        if not done:
            remove(work)
        raise


def start(
    work: Path, inputs: dict, head: list, model_proto: bytes | None, vocab_size: int
) -> tuple[dict, bytes]:
    """Start afresh in `work` with the tokenizer, trained on `head` unless given. Returns the
    progress."""
    if model_proto is None:
        texts = [text for _, train, _, _ in head for text in train]
        sample = tokenizer_sample(texts, TOKENIZER_SAMPLE_BYTES, SEED)
        model_proto = train_tokenizer(sample, vocab_size, SEED, inputs.get("tokenizer_type", "bpe"))
    remove(work)
    (work / "progress").mkdir(parents=True)
    (work / tokenizer_name(model_proto)).write_bytes(model_proto)
    if "tokenizer_config" in inputs:  # Special tokens, add_bos_token, the chat template.
        write_json(work / TOKENIZER_CONFIG, inputs["tokenizer_config"])
    progress = {"inputs": inputs, "blocks": 0, "bytes_read": 0, "splits": {}}
    write_json(work / "progress" / "progress.json", progress)
    return progress, model_proto


def encode_blocks(work: Path, blocks, progress: dict, tokenizer, writers: dict, workers: int, bar):
    """Encode each block on `workers` threads, append it to the shards, and commit the progress.

    sentencepiece encodes blocks in the background, without the GIL. Meanwhile this thread cuts the
    next block into pieces and writes the one before. So the cores keep encoding. Blocks are
    written in order."""
    cut = cuts_after_newlines(tokenizer)
    pool = ThreadPoolExecutor(1, thread_name_prefix="encode")
    pending = None
    try:
        for block in blocks:
            pieces, counts = document_pieces(block[1] + block[2], cut)
            encoding = pool.submit(encode_pieces, tokenizer, pieces, workers)
            if pending:
                commit_block(work, *pending, progress, tokenizer, writers, bar)
            pending = block, encoding, counts
        if pending:
            commit_block(work, *pending, progress, tokenizer, writers, bar)
    finally:
        pool.shutdown(cancel_futures=True)


def commit_block(
    work: Path, block: tuple, encoding, counts: list, progress: dict, tokenizer, writers: dict, bar
):
    """Append an encoded block to the shards, then record it in the progress file: it is done."""
    index, train, val, size = block
    ids, lengths = join_documents(tokenizer, encoding.result(), counts)
    boundary = int(lengths[: len(train)].sum())
    writers["train"].write(ids[:boundary], lengths[: len(train)], sum(map(utf8_size, train)))
    writers["val"].write(ids[boundary:], lengths[len(train) :], sum(map(utf8_size, val)))
    progress.update(blocks=index + 1, bytes_read=progress["bytes_read"] + size)
    progress["splits"] = {split: writer.state() for split, writer in writers.items()}
    write_json(work / "progress" / "progress.json", progress)
    tokens = sum(writer.tokens for writer in writers.values())
    shards = sum(writer.shards_done for writer in writers.values())
    bar.set_postfix_str(f"{tokens:,} tokens, {shards} shards done", refresh=False)
    bar.update(size)


def finish(
    work: Path, out_dir: Path, writers: dict, tokenizer, model_proto: bytes, meta: dict
) -> dict:
    """Write each shard's offsets and meta.json, then rename work to out_dir, complete."""
    splits = {split: writer.finish() for split, writer in writers.items()}
    if not splits["val"]["tokens"]:
        raise UserError(
            f"no document went to validation; prepare more documents (the work so far is in {work})"
        )
    meta = {
        "format": FORMAT_VERSION,
        "vocab_size": tokenizer.get_piece_size(),
        "dtype": writers["train"].dtype.name,
        "bos_id": tokenizer.bos_id(),
        "eos_id": tokenizer.eos_id(),
        "unk_id": tokenizer.unk_id(),
        "pad_id": tokenizer.pad_id(),
        "splits": splits,
        "bytes_per_token": splits["val"]["bytes_per_token"],
        "tokenizer_sha256": tokenizer_sha256(model_proto),
        **meta,
    }
    write_json(work / "meta.json", meta)
    remove(work / "progress")
    replace(work, out_dir)
    return meta


def build(
    out_dir: Path, work: Path, inputs: dict, model_proto: bytes | None, options: dict
) -> dict:
    """Prepare out_dir from the source in `options`, block by block, resuming work if it can."""
    meta = read_json(work / "meta.json")
    if meta and meta.get("inputs") == inputs:  # Interrupted while renaming, so complete already.
        remove(work / "progress")
        replace(work, out_dir)
        return meta
    source, max_bytes = options["source"], options["max_bytes"]
    streams, description, total = open_source(source, options["text_field"], max_bytes)
    documents = iter_documents(streams, source, options["max_docs"], max_bytes)
    blocks = iter_blocks(documents, BLOCK_BYTES)
    progress, model_proto, splitter, head = begin(work, inputs, blocks, model_proto, options)
    tokenizer = load_tokenizer(model_proto, work, inputs.get("tokenizer_config"))
    dtype = np.dtype(np.uint16 if tokenizer.get_piece_size() <= 1 << 16 else np.uint32)
    writers = {
        split: ShardWriter(
            work, split, dtype, inputs["shard_tokens"], progress["splits"].get(split)
        )
        for split in ("train", "val")
    }
    done = sum(writer.tokens for writer in writers.values())
    read = progress["bytes_read"]
    tokens_per_byte = done / read if done else sample_tokens_per_byte(tokenizer, head)
    check_room(work, total and total - read, done, tokens_per_byte, dtype, inputs["shard_tokens"])
    rest = (
        (index, *splitter(index, texts, sizes, last), sum(sizes))
        for index, texts, sizes, last in blocks
        if index >= progress["blocks"]
    )
    bar = tqdm(total=total, initial=read, desc="encoding", unit="B", unit_scale=True, disable=None)
    with bar:
        todo = itertools.chain(head, rest)
        encode_blocks(work, todo, progress, tokenizer, writers, options["workers"], bar)
    meta = {"source": description, "command": options["command"], "inputs": inputs}
    return finish(work, out_dir, writers, tokenizer, model_proto, meta)


def begin(work: Path, inputs: dict, blocks, model_proto: bytes | None, options: dict) -> tuple:
    """(progress, model_proto, splitter, head) for these inputs in `work`. An interrupted
    preparation is resumed. Else a new one starts on the first blocks (head), read for its
    tokenizer."""
    progress = resumable(work, inputs)
    if progress is not None:
        read = progress["bytes_read"]
        print(f"resuming the interrupted preparation in {work} after {read:,} bytes")
        splitter = Splitter(read, progress["splits"].get("val", {}).get("bytes", 0))
        return progress, tokenizer_file(work).read_bytes(), splitter, []
    splitter = Splitter()
    head = first_blocks(blocks, splitter, TOKENIZER_SAMPLE_BYTES if model_proto is None else 1)
    progress, model_proto = start(work, inputs, head, model_proto, options["vocab_size"])
    return progress, model_proto, splitter, head


def sample_tokens_per_byte(tokenizer, head: list) -> float:
    """Tokens per byte of the first blocks' text, from a 256k-character sample. One long string
    encodes slowly: 10 MB took 7 s."""
    sample = "".join(text for _, train, _, _ in head for text in train[:100])[: 1 << 18] or "a"
    return len(tokenizer.encode(sample)) / utf8_size(sample)


def prepare(
    source="shakespeare",
    vocab_size=4096,
    out_dir=None,
    tokenizer=None,
    force=False,
    text_field="text",
    max_docs=None,
    max_bytes=None,
    command=None,
    shard_tokens=SHARD_TOKENS,
    workers=None,
    source_key="--source",
    tokenizer_type="bpe",
) -> Path:
    """Prepare a dataset directory (see --help) and return its path. Errors say source_key."""
    out_dir = Path(out_dir or REPO_ROOT / "data" / default_name(source, tokenizer_type))
    if source.startswith("hf:") and max_bytes is None:
        max_bytes = HF_DEFAULT_MAX_BYTES
    counts = {"--max-docs": max_docs, "--shard-tokens": shard_tokens, "--workers": workers}
    for name, value in counts.items():
        if value is not None and value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    inputs = {
        "format": FORMAT_VERSION,
        **source_fingerprint(source, source_key),
        "text_field": text_field,
        "max_docs": max_docs,
        "max_bytes": max_bytes or None,
        "val_fraction": VAL_FRACTION,
        "seed": SEED,
        "block_bytes": BLOCK_BYTES,
        "shard_tokens": shard_tokens,
    }
    model_proto = given_tokenizer(tokenizer, vocab_size, inputs, tokenizer_type)
    with exclusive(out_dir):  # One writer at a time, from the check of what is there to the rename.
        if meta := existing_output(out_dir, inputs, force):
            print(f"already prepared (same inputs; --force rebuilds): {summary(out_dir, meta)}")
            return out_dir
        files = [file for file, _, _ in inputs.get("files", [])]
        check_writable(out_dir, inputs=files, directory=True)
        check_own(out_dir)
        options = {
            "source": source,
            "text_field": text_field,
            "max_docs": max_docs,
            "max_bytes": max_bytes or None,
            "vocab_size": vocab_size,
            "workers": workers or cpu_count(),
            "command": list(command or sys.argv),
        }
        with warnings.catch_warnings():
            # Library chatter from datasets. Real failures arrive as exceptions.
            warnings.simplefilter("ignore")
            target = resolved(out_dir)  # Never rename a folder over a link.
            meta = build(target, partial_dir(target), inputs, model_proto, options)
        print(f"wrote {summary(out_dir, meta)}")
    return out_dir


def given_tokenizer(tokenizer, vocab_size: int, inputs: dict, kind: str = "bpe") -> bytes | None:
    """The serialized --tokenizer, or None if one of `kind` is trained. Its identity goes in
    `inputs`. A trained BPE one is recorded as before kinds existed, so older datasets are reused.
    A given one is of its own kind."""
    if not tokenizer:
        if vocab_size < 1:
            raise UserError(f"--vocab-size must be positive, got {vocab_size}")
        inputs.update(vocab_size=vocab_size, tokenizer_sample_bytes=TOKENIZER_SAMPLE_BYTES)
        if kind != "bpe":
            inputs["tokenizer_type"] = kind
        return None
    tokenizer_path = Path(tokenizer)
    if tokenizer_path.is_dir():  # A run directory or a dataset. Take its tokenizer.
        tokenizer_path = tokenizer_file(tokenizer_path) or tokenizer_path / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path}: no such tokenizer file")
    model_proto = tokenizer_path.read_bytes()
    config_path = tokenizer_path.with_name(TOKENIZER_CONFIG)
    # A tokenizer.json's special tokens. Beside a tokenizer.model, such as an imported llama.cpp
    # vocabulary, it says whether documents start with BOS.
    if config_path.is_file() or tokenizer_name(model_proto) == "tokenizer.json":
        inputs["tokenizer_config"] = read_json(config_path) if config_path.is_file() else {}
    load_tokenizer(model_proto, str(tokenizer_path), inputs.get("tokenizer_config"))
    inputs["tokenizer_sha256"] = tokenizer_sha256(model_proto)
    return model_proto
