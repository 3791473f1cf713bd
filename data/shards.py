"""Token shards. Documents are encoded on all cores and written to fixed-size shards, which
meta.json lists. Writing resumes after an interruption."""

import os
from pathlib import Path

import numpy as np

from data.tokenizer import prompt_start
from picollama.cli import UserError

# Documents are encoded in pieces cut after a newline. This size ran ~25% faster than 8k pieces.
ENCODE_PIECE_CHARS = 1 << 10
# The most shard files a dataset may have, each with its .docs.npy. `--shard-tokens 1` once wrote
# 90,000 files of Shakespeare without a warning.
MAX_SHARDS = 10_000


def check_shard_count(tokens: int, shard_tokens: int, split: str = ""):
    """UserError when about `tokens`, of `split` or of both, would make more than MAX_SHARDS shard
    files. It is checked before the first is written, and again by ShardWriter."""
    shards = -(-tokens // shard_tokens)
    if shards > MAX_SHARDS:
        what = f"about {tokens:,} tokens" + (f" of {split}" if split else "")
        raise UserError(
            f"--shard-tokens {shard_tokens} would make {shards:,} shard files ({what}); at most "
            f"{MAX_SHARDS:,}: give --shard-tokens {-(-tokens // MAX_SHARDS)} or more"
        )


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def docs_name(shard_file: str) -> str:
    """The document offsets beside a shard: train-00000.bin -> train-00000.docs.npy."""
    return str(Path(shard_file).with_suffix(".docs.npy"))


def mask_name(shard_file: str) -> str:
    """The loss mask beside a conversations shard: train-00000.bin -> train-00000.mask.bin."""
    return str(Path(shard_file).with_suffix(".mask.bin"))


def split_shards(meta: dict, split: str) -> list[dict]:
    """[{"file", "tokens"}, ...] of a split, in order. Format 2 has one shard, <split>.bin."""
    info = meta["splits"][split]
    if "shards" in info:
        return info["shards"]
    return [{"file": f"{split}.bin", "tokens": info["tokens"]}]


def cuts_after_newlines(tokenizer) -> bool:
    """Whether cutting a text after a newline changes no id. It holds when no piece holds a
    newline, so none spans one, and the tokenizer adds nothing at a text's start."""
    pieces = (tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size()))
    no_newline_piece = not any("\n" in piece for piece in pieces)
    encode = tokenizer.encode
    return no_newline_piece and encode("a\nb") == encode("a\n") + encode("b")


def pieces_of(text: str, cut_at_newlines: bool):
    """The text in pieces of about ENCODE_PIECE_CHARS characters, each cut just after a newline.
    A longer line stays whole. Without cut_at_newlines the text stays whole."""
    if not cut_at_newlines:
        yield text
        return
    start = 0
    while start < len(text):
        end = len(text)
        if end - start > ENCODE_PIECE_CHARS:
            end = (
                text.rfind("\n", start, start + ENCODE_PIECE_CHARS) + 1
                or text.find("\n", start) + 1
                or end
            )
        yield text[start:end]
        start = end


def document_pieces(texts: list[str], cut_at_newlines: bool) -> tuple[list[str], list[int]]:
    """The pieces of all the texts, in order, and how many each text has."""
    pieces, counts = [], []
    for text in texts:
        before = len(pieces)
        pieces.extend(pieces_of(text, cut_at_newlines))
        counts.append(len(pieces) - before)
    return pieces, counts


def encode_pieces(tokenizer, pieces: list[str], threads: int) -> list[np.ndarray]:
    """The ids of each piece (int32), encoded by sentencepiece on `threads` threads without the GIL.
    They do not depend on the number of threads."""
    return tokenizer.encode(pieces, num_threads=threads, return_type="numpy") if pieces else []


def join_documents(tokenizer, encoded: list[np.ndarray], counts: list[int]):
    """(ids, lengths): BOS + ids + EOS of each text from its pieces' ids, concatenated (int32), and
    each one's length.

    The EOS teaches the model to end a text, so that generation can stop."""
    bos = np.array(prompt_start(tokenizer), dtype=np.int32)  # BOS where the tokenizer adds it.
    eos = np.array([tokenizer.eos_id()] if tokenizer.eos_id() >= 0 else [], dtype=np.int32)
    parts = []
    lengths = []
    first = 0
    for count in counts:
        pieces = encoded[first : first + count]
        parts += [bos, *pieces, eos]
        lengths.append(len(bos) + len(eos) + sum(len(ids) for ids in pieces))
        first += count
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return ids, np.array(lengths, dtype=np.int64)


class ShardWriter:
    """Appends a split's documents to shard files <split>-NNNNN.bin of exactly shard_tokens tokens.
    The last one holds fewer, and documents run on across shards. Each document's start, relative
    to its shard, goes to a raw int64 file in progress/. state() is what a resumed run needs. The
    files are cut back to it, so whatever came after is written again, identically."""

    def __init__(
        self,
        folder: Path,
        split: str,
        dtype: np.dtype,
        shard_tokens: int,
        state: dict | None = None,
    ):
        self.folder = Path(folder)
        self.split = split
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        state = state or {"tokens": 0, "bytes": 0, "shard_docs": []}
        self.tokens = state["tokens"]
        self.bytes = state["bytes"]
        self.shard_docs = list(state["shard_docs"])
        self.file = None  # The open shard, and its index.
        self.file_index = None
        (self.folder / "progress").mkdir(exist_ok=True)
        self._cut_back()

    def _raw_docs(self, index: int) -> Path:
        return self.folder / "progress" / f"{self.split}-{index:05d}.docs"

    def _cut_back(self):
        """Make the files hold exactly this state: later shards removed, the open one truncated."""
        open_index, open_tokens = divmod(self.tokens, self.shard_tokens)
        for path in [
            *self.folder.glob(f"{self.split}-*.bin"),
            *self.folder.glob(f"progress/{self.split}-*.docs"),
        ]:
            index = int(path.name[len(self.split) + 1 :].split(".")[0])
            if index > open_index or index == open_index and not open_tokens:
                path.unlink()
        for index in range(open_index):
            path = self.folder / shard_name(self.split, index)
            if not path.is_file() or path.stat().st_size != self.shard_tokens * self.dtype.itemsize:
                raise OSError(
                    f"{path}: a finished shard is missing or has the wrong size; cannot resume"
                )
        if open_tokens:
            self._raw_docs(open_index).touch()
            shard = self.folder / shard_name(self.split, open_index)
            for path, size in (
                (shard, open_tokens * self.dtype.itemsize),
                (self._raw_docs(open_index), self.shard_docs[open_index] * 8),
            ):
                if not path.is_file() or path.stat().st_size < size:
                    raise OSError(f"{path}: shorter than the progress recorded; cannot resume")
                os.truncate(path, size)

    def write(self, ids: np.ndarray, lengths: np.ndarray, text_bytes: int):
        """Append documents: ids as join_documents returns them, lengths the tokens of each."""
        starts = self.tokens + np.cumsum(lengths) - lengths
        shard_of = starts // self.shard_tokens
        for index in np.unique(shard_of):
            local = starts[shard_of == index] - index * self.shard_tokens
            self.shard_docs += [0] * (index + 1 - len(self.shard_docs))
            self.shard_docs[index] += len(local)
            with open(self._raw_docs(index), "ab") as file:
                local.astype(np.int64).tofile(file)
        ids = ids.astype(self.dtype, copy=False)
        written = 0
        while written < len(ids):
            index, used = divmod(self.tokens, self.shard_tokens)
            chunk = ids[written : written + self.shard_tokens - used]
            if self.file_index != index:
                check_shard_count(self.tokens + len(ids) - written, self.shard_tokens, self.split)
                self.close()
                self.file = open(self.folder / shard_name(self.split, index), "ab")
                self.file_index = index
            chunk.tofile(self.file)
            self.tokens += len(chunk)
            written += len(chunk)
            if self.tokens % self.shard_tokens == 0:
                self.close()  # A finished shard is on disk for good.
        self.shard_docs += [0] * (-(-self.tokens // self.shard_tokens) - len(self.shard_docs))
        self.bytes += text_bytes

    def close(self):
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
            self.file_index = None

    def state(self) -> dict:
        if self.file is not None:
            self.file.flush()
        return {"tokens": self.tokens, "bytes": self.bytes, "shard_docs": self.shard_docs}

    @property
    def shards_done(self) -> int:
        return self.tokens // self.shard_tokens

    def finish(self) -> dict:
        """Close the last shard and save each shard's document offsets (.docs.npy). Returns the
        manifest."""
        self.close()
        shards = []
        for index in range(-(-self.tokens // self.shard_tokens)):
            name = shard_name(self.split, index)
            raw = self._raw_docs(index)
            empty = np.zeros(0, dtype=np.int64)
            offsets = np.fromfile(raw, dtype=np.int64) if raw.is_file() else empty
            np.save(self.folder / docs_name(name), offsets)
            tokens = min(self.shard_tokens, self.tokens - index * self.shard_tokens)
            shards.append({"file": name, "tokens": tokens, "docs": self.shard_docs[index]})
        docs = sum(self.shard_docs)
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "docs": docs,
            "bytes_per_token": self.bytes / self.tokens if self.tokens else 0.0,
            "shards": shards,
        }
