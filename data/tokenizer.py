"""A tokenizer's identity: the sha256 of its tokenizer.model, which datasets and runs record."""

import hashlib
from pathlib import Path


def tokenizer_sha256(tokenizer: Path | str | bytes) -> str:
    """The sha256 (hex) of a sentencepiece model, given as its file or as its bytes."""
    model_proto = tokenizer if isinstance(tokenizer, bytes) else Path(tokenizer).read_bytes()
    return hashlib.sha256(model_proto).hexdigest()


def same_tokenizer(recorded: str | None, tokenizer: Path | str | bytes) -> bool:
    """Whether `tokenizer` (a file or bytes) has the recorded sha256; True when none is recorded."""
    return not recorded or recorded == tokenizer_sha256(tokenizer)
