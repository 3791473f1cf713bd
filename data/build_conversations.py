"""Prepare a chat dataset: conversations as token shards, each with its loss mask. As in
build.py, a preparation resumes after an interruption."""

import errno
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import build
from data.build import SHARD_TOKENS, check_free_disk, finish, given_tokenizer, resumable, start
from data.chat_rows import encoded_conversation
from data.conversations import conversation_files, read_conversations
from data.dataset_dir import (
    FORMAT_VERSION,
    check_own,
    existing_output,
    partial_dir,
    read_json,
    summary,
    write_json,
)
from data.shards import ShardWriter, mask_name, shard_name
from data.sources import default_name, iter_blocks, source_fingerprint, utf8_size
from data.splitting import SEED, VAL_FRACTION, ChatSplitter
from data.tokenizer import load_tokenizer
from picollama import REPO_ROOT
from picollama.chat_template import load_chat_template
from picollama.cli import UserError
from picollama.cli.outputs import check_writable, exclusive, remove, replace, resolved

SPLITS = ("train", "val")
# How val is chosen: ChatSplitter's rule, by tokens. Datasets split by bytes before it differ.
SPLIT_INPUTS = {"val_fraction": VAL_FRACTION, "seed": SEED, "split": "tokens"}
BLOCK_BYTES = build.BLOCK_BYTES  # Of JSONL. Conversations are split, encoded and saved by block.


class MaskWriter:
    """Appends a split's loss mask, one uint8 per token, to X.mask.bin beside each shard X.bin.
    Masks are cut where the shards are. On resume they hold exactly `tokens`, the shards'
    progress."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, tokens: int):
        self.folder, self.split = folder, split
        self.shard_tokens, self.tokens = shard_tokens, tokens
        done, left = divmod(tokens, shard_tokens)
        for path in folder.glob(f"{split}-*.mask.bin"):
            index = int(path.name[len(split) + 1 :].split(".")[0])
            if index > done or index == done and not left:
                path.unlink()
        for index in range(done + (left > 0)):
            path, size = self.path(index), shard_tokens if index < done else left
            if not path.is_file() or path.stat().st_size < size:
                raise OSError(f"{path}: shorter than the progress recorded; cannot resume")
            os.truncate(path, size)

    def path(self, index: int) -> Path:
        """The mask file beside the split's shard `index`."""
        return self.folder / mask_name(shard_name(self.split, index))

    def write(self, mask: np.ndarray):
        """Append the mask of tokens just written to the shards, synced to disk."""
        written = 0
        while written < len(mask):
            index, used = divmod(self.tokens, self.shard_tokens)
            chunk = mask[written : written + self.shard_tokens - used].astype(np.uint8)
            with open(self.path(index), "ab") as file:
                chunk.tofile(file)
                file.flush()
                os.fsync(file.fileno())
            self.tokens += len(chunk)
            written += len(chunk)


def encode_block(
    tokenizer, template: str, records: list, special_in_content=False, keep=None
) -> list:
    """(text, ids, mask) of each (where, messages) record, cut to its first `keep` tokens. A
    UserError names the line of one the template or tokenizer cannot mask. Special tokens' text in
    a message is plain text, unless special_in_content."""
    rows, trusted = [], special_in_content
    for where, messages in records:
        try:
            text, ids, mask = encoded_conversation(tokenizer, template, messages, trusted, keep)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        rows.append((text, np.array(ids, dtype=np.int64), np.array(mask, dtype=np.uint8)))
    return rows


def held_out(splitter: ChatSplitter, index: int, rows: list, last: bool) -> list[bool]:
    """Which of a block's conversations go to val, as the ChatSplitter chooses by tokens."""
    if index == 0 and last and len(rows) < 2:
        raise UserError(
            "the source holds one conversation; preparing needs two at least (one is held out "
            "for validation)"
        )
    return splitter(index, [len(ids) for _, ids, _ in rows], last)


def commit_block(work: Path, progress: dict, rows: list, flags: list, writers: dict, masks: dict):
    """Append a block's conversations to their split's shards and masks, then record it in the
    progress file: it is done."""
    for split, held in zip(SPLITS, (False, True)):
        chosen = [row for row, flag in zip(rows, flags) if flag == held]
        if not chosen:
            continue
        ids = np.concatenate([row[1] for row in chosen])
        mask = np.concatenate([row[2] for row in chosen])
        lengths = np.array([len(row[1]) for row in chosen], dtype=np.int64)
        writers[split].write(ids, lengths, sum(utf8_size(row[0]) for row in chosen))
        masks[split].write(mask)
        progress["supervised"][split] += int(mask.sum())
        progress["at_keep"] += int((lengths == progress["keep_tokens"]).sum())
    progress["splits"] = {split: writer.state() for split, writer in writers.items()}
    write_json(work / "progress" / "progress.json", progress)


def check_room(work: Path, rows: list, size: int, left: int, dtype: np.dtype):
    """OSError (ENOSPC) when the shards and masks of `left` more bytes of JSONL would not fit.
    The work so far is kept, to resume. It estimates from the tokens a byte `rows` gave."""
    per_byte = sum(len(row[1]) for row in rows) / size * (1 + 1 / dtype.itemsize)  # Plus the mask.
    try:
        check_free_disk(work, left, per_byte, dtype)
    except UserError as e:
        raise OSError(errno.ENOSPC, str(e)) from None


def encode_all(work: Path, progress: dict, tokenizer, template: str, writers: dict, options):
    """Encode, split and commit the blocks of conversations not yet done, with a progress bar."""
    masks = {s: MaskWriter(work, s, writers[s].shard_tokens, writers[s].tokens) for s in SPLITS}
    counts = [(writer.tokens, sum(writer.shard_docs)) for writer in writers.values()]
    splitter = ChatSplitter(
        sum(n for n, _ in counts), counts[1][0], sum(n for _, n in counts), counts[1][1]
    )
    records = read_conversations(options["files"], options["max_docs"])
    blocks = iter_blocks(((record[:2], record[2]) for record in records), BLOCK_BYTES)
    read = progress["bytes_read"]
    total = options["total"]
    bar = tqdm(total=total, initial=read, desc="encoding", unit="B", unit_scale=True, disable=None)
    with bar:
        for index, block, sizes, last in blocks:
            if index < progress["blocks"]:
                continue
            trusted, keep = options["special_in_content"], progress["keep_tokens"]
            rows = encode_block(tokenizer, template, block, trusted, keep)
            if index == progress["blocks"]:  # First block this run: check room for all.
                check_room(work, rows, sum(sizes), total - read, writers["train"].dtype)
            flags = held_out(splitter, index, rows, last)
            progress.update(blocks=index + 1, bytes_read=progress["bytes_read"] + sum(sizes))
            commit_block(work, progress, rows, flags, writers, masks)
            bar.update(sum(sizes))
    if not writers["train"].tokens + writers["val"].tokens:
        raise UserError(f"{options['source']}: no conversations (every line is blank)")


def run_context(folder: Path) -> int | None:
    """The context of the run whose tokenizer prepares the conversations: model.max_seq_len in its
    config.json, or a Hugging Face config's max_position_embeddings. None where it names none."""
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        return None
    model = config.get("model")
    found = model.get("max_seq_len") if isinstance(model, dict) else None
    found = found or config.get("max_position_embeddings")
    return found if type(found) is int and found > 0 else None


def build_dataset(out_dir: Path, work: Path, inputs: dict, model_proto: bytes, options) -> dict:
    """Prepare out_dir from the conversations in `options`, block by block, resuming work if it
    can. Bad input is a UserError, and nothing is kept."""
    meta = read_json(work / "meta.json")
    if meta and meta.get("inputs") == inputs:  # Interrupted while renaming, so complete already.
        remove(work / "progress")
        replace(work, out_dir)
        return meta
    progress = resumable(work, inputs)
    if progress is None:
        progress, _ = start(work, inputs, [], model_proto, 0)
    else:
        read = progress["bytes_read"]
        print(f"resuming the interrupted preparation in {work} after {read:,} bytes")
    progress.setdefault("supervised", dict.fromkeys(SPLITS, 0))
    progress.setdefault("at_keep", 0)
    progress["keep_tokens"] = inputs.get("keep_tokens")
    config = inputs["tokenizer_config"]
    tokenizer = load_tokenizer(model_proto, work, config)
    dtype = np.dtype(np.uint16 if tokenizer.get_piece_size() <= 1 << 16 else np.uint32)
    shard_tokens = inputs["shard_tokens"]
    writers = {
        split: ShardWriter(work, split, dtype, shard_tokens, progress["splits"].get(split))
        for split in SPLITS
    }
    try:
        encode_all(work, progress, tokenizer, config["chat_template"], writers, options)
    except UserError:
        remove(work)  # Once fixed, the inputs differ, so none of this is of use.
        raise
    conversations = {split: sum(writers[split].shard_docs) for split in SPLITS}
    meta = {
        "source": f"conversations from {len(options['files'])} file(s) of {options['source']}",
        "command": options["command"],
        "inputs": inputs,
        "kind": "conversations",
        "conversations": conversations,
        "supervised_tokens": progress["supervised"],
        # Those kept to their first inputs.keep_tokens tokens: longer ones, and any that long.
        "conversations_at_keep": progress["at_keep"],
    }
    return finish(work, out_dir, writers, tokenizer, model_proto, meta)


def prepare_conversations(
    source: str,
    out_dir=None,
    tokenizer=None,
    force=False,
    max_docs=None,
    command=None,
    shard_tokens=SHARD_TOKENS,
    special_in_content=False,
    context=None,
) -> Path:
    """Prepare a chat dataset directory from JSONL conversations and return its path. It uses the
    chat template and tokenizer of `tokenizer`, a run directory or its tokenizer file. Special
    tokens' text in a message is plain text, unless special_in_content (trusted data). A longer
    conversation keeps `context` + 2 tokens (run_context by default), more than a row holds."""
    files = conversation_files(source)
    if files is None:
        raise UserError(f'{source}: no .jsonl records of "messages" or "conversations"')
    if not tokenizer:
        raise UserError(
            f"{source} holds conversations: they are prepared with the tokenizer and chat template "
            "of the run they train, --tokenizer RUN"
        )
    if shard_tokens < 1 or max_docs is not None and max_docs < 1:
        raise UserError("--shard-tokens and --max-docs must be positive")
    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "data" / default_name(source)
    inputs = {
        "format": FORMAT_VERSION,
        "kind": "conversations",
        **source_fingerprint(source),
        "max_docs": max_docs,
        **SPLIT_INPUTS,
        "block_bytes": BLOCK_BYTES,
        "shard_tokens": shard_tokens,
    }
    if special_in_content:  # Only then, so that datasets prepared before stay the same inputs.
        inputs["special_in_content"] = True
    model_proto = given_tokenizer(tokenizer, 0, inputs)
    folder = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
    if context := context or run_context(folder):
        inputs["keep_tokens"] = context + 2  # A row holds train.seq_len + 1 <= context + 1.
    template = load_chat_template(folder)  # Its own, or the default for a run trained here.
    inputs["tokenizer_config"] = {**inputs.get("tokenizer_config", {}), "chat_template": template}
    with exclusive(out_dir):  # One writer at a time, from the check of what is there to the rename.
        if meta := existing_output(out_dir, inputs, force):
            print(f"already prepared (same inputs; --force rebuilds): {summary(out_dir, meta)}")
            return out_dir
        check_writable(out_dir, inputs=files, directory=True)
        check_own(out_dir)
        options = {
            "source": source,
            "files": files,
            "max_docs": max_docs,
            "total": sum(path.stat().st_size for path in files),
            "command": list(command or sys.argv),
            "special_in_content": special_in_content,
        }
        target = resolved(out_dir)  # Never rename a folder over a link.
        report(out_dir, build_dataset(target, partial_dir(target), inputs, model_proto, options))
    return out_dir


def report(out_dir: Path, meta: dict):
    """What a preparation wrote, in a line, and a note of the conversations it kept short."""
    trained = sum(meta["supervised_tokens"].values())
    total = sum(meta["splits"][split]["tokens"] for split in SPLITS)
    print(f"wrote {summary(out_dir, meta)}; {trained / total:.0%} of the tokens supervised")
    if kept := meta.get("conversations_at_keep"):
        keep = meta["inputs"]["keep_tokens"]
        print(
            f"note: {kept:,} conversation(s) kept to their first {keep:,} tokens, past any row "
            f"of a context of {keep - 2:,} (--context); training cuts them to a row"
        )
