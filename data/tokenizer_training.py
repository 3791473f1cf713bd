"""Train a dataset's tokenizer. It is a byte-fallback sentencepiece model, BPE or unigram, trained
on a seeded sample of the text."""

import io
import os
import re

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from data.sources import utf8_size
from picollama.cli import UserError
from picollama.config.values import CHOICES

MAX_SENTENCE_CHARS = 16_384  # Longer lines reach the trainer in pieces.
# The algorithms a tokenizer may be trained with (data/prepare.py --tokenizer-type). BPE trains on
# the text's lines, and line breaks fall back to bytes. Kudo's unigram language model trains on
# pieces of UNIGRAM_CHUNK characters that keep their line breaks, so pieces such as ",\n" may form.
# On Shakespeare, unigram scored 0.014 bits/byte lower at 3 seeds (docs/findings.md).
TOKENIZER_TYPES = CHOICES["data.tokenizer_type"]  # ("bpe", "unigram"), as the config checks.
UNIGRAM_CHUNK = 4096
# sentencepiece's options. Byte-fallback BPE sees the text exactly as it is, with no normalization
# and no spaces added or removed. So decode(encode(text)) == text for any UTF-8 text. Digits split
# one by one.
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


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenizer_sample(texts: list[str], cap: int, seed: int) -> list[str]:
    """What the tokenizer trains on: all the texts when they hold at most `cap` bytes. Else a
    seeded random choice of whole texts, kept in corpus order, up to `cap` bytes. The last one is
    cut short."""
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


def text_characters(documents: list[str]) -> int:
    """How many characters of the documents are not whitespace."""
    return sum(len(word) for document in documents for word in document.split())


def training_sentences(documents: list[str], kind: str = "bpe"):
    """Lines of the documents, as sentencepiece trains on lines. Very long lines come in pieces.
    For a unigram tokenizer, pieces of UNIGRAM_CHUNK characters, line breaks kept."""
    for document in tqdm(documents, desc="training tokenizer", unit="doc", disable=None):
        if kind == "unigram":
            for start in range(0, len(document), UNIGRAM_CHUNK):
                yield document[start : start + UNIGRAM_CHUNK]
            continue
        for line in document.split("\n"):
            for start in range(0, len(line), MAX_SENTENCE_CHARS):
                yield line[start : start + MAX_SENTENCE_CHARS]


def train_tokenizer(documents: list[str], vocab_size: int, seed: int, kind: str = "bpe") -> bytes:
    """A byte-fallback sentencepiece model (serialized) of `kind` (TOKENIZER_TYPES) that
    round-trips any UTF-8 text."""
    letters = text_characters(documents)
    if not letters:
        size = sum(map(len, documents))
        raise UserError(
            f"the corpus holds no text: the {size:,} characters a tokenizer would train on are "
            "all whitespace (spaces, tabs, line breaks); prepare a source that holds text"
        )
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(documents, kind),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=cpu_count(),
            **(TOKENIZER_RECIPE | {"model_type": kind}),
        )
    except RuntimeError as exc:
        message = str(exc)
        if most := re.search(r"Please set it to a value <= (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too large for this corpus: the text a tokenizer "
                f"trains on holds {letters:,} non-whitespace character{'s' * (letters != 1)}, "
                f"from which sentencepiece can learn at most {most[1]} pieces; use --vocab-size "
                f"{most[1]} or less, or more text"
            ) from None
        if least := re.search(r"required_chars\. \d+ vs (\d+)", message):
            raise UserError(
                f"--vocab-size {vocab_size} is too small for this corpus: it needs at least "
                f"{least[1]} (256 byte pieces, 3 special pieces and its common characters)"
            ) from None
        raise UserError(f"tokenizer training failed: {message.strip().splitlines()[0]}") from None
    return model.getvalue()
