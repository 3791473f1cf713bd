"""Tokenizers as runs and datasets hold them: a sentencepiece tokenizer.model or a Hugging Face
tokenizer.json. Both answer to sentencepiece's method names. A tokenizer's identity is the sha256
of its file, which datasets, run directories and checkpoints record."""

import hashlib
import json
from pathlib import Path

import numpy as np

from picollama.cli import UserError

# The files a tokenizer lives in, in the order they are looked for. New ones train as the first.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")
# Beside tokenizer.json. It holds the special tokens, the chat template, and whether a prompt
# starts with BOS.
TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_sha256(tokenizer: Path | str | bytes) -> str:
    """The sha256 (hex) of a tokenizer file (tokenizer.model or .json), as its path or its bytes."""
    model_proto = tokenizer if isinstance(tokenizer, bytes) else Path(tokenizer).read_bytes()
    return hashlib.sha256(model_proto).hexdigest()


def same_tokenizer(recorded: str | None, tokenizer: Path | str | bytes) -> bool:
    """Whether `tokenizer` (a file or its bytes) has the recorded sha256 (or none was recorded)."""
    return not recorded or recorded == tokenizer_sha256(tokenizer)


def tokenizer_file(folder: Path | str) -> Path | None:
    """The folder's tokenizer.model, else its tokenizer.json. None when it has neither."""
    return next((Path(folder) / n for n in TOKENIZER_FILES if (Path(folder) / n).is_file()), None)


def open_tokenizer(path: Path | str):
    """The tokenizer of a tokenizer.model or tokenizer.json file. ValueError if it is not one."""
    if Path(path).suffix == ".json":
        return HFTokenizer(path)
    import sentencepiece as spm

    try:
        tokenizer = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError):
        raise ValueError(f"{path} is not a sentencepiece model") from None
    try:
        config = json.loads(Path(path).with_name(TOKENIZER_CONFIG).read_text())
    except (OSError, ValueError):  # None, or not JSON. Keep sentencepiece's own way.
        config = None
    tokenizer.add_bos = adds_bos(config)
    return tokenizer


def load_tokenizer(model_proto: bytes, what, config: dict | None = None):
    """The tokenizer of a tokenizer.model's bytes, or a tokenizer.json's with its `config`. `what`
    names the file, or the folder it is in, in messages."""
    import sentencepiece as spm

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
    tokenizer.add_bos = adds_bos(config)  # Whether each document starts with BOS (join_documents).
    return tokenizer


def tokenizer_name(model_proto: bytes) -> str:
    """The file name of a tokenizer's bytes: tokenizer.json (JSON text) or tokenizer.model."""
    return "tokenizer.json" if model_proto.lstrip()[:1] == b"{" else "tokenizer.model"


def adds_bos(config) -> bool:
    """Whether a sentencepiece tokenizer with this tokenizer_config.json (its JSON, or None) starts
    each text with BOS. Yes, unless the file says add_bos_token false (llama.cpp's may)."""
    return not isinstance(config, dict) or config.get("add_bos_token") is not False


def prompt_start(tokenizer) -> list[int]:
    """What a prompt begins with: [BOS] where the tokenizer has one and adds it (spm ones do)."""
    adds = getattr(tokenizer, "add_bos", True)
    return [tokenizer.bos_id()] if adds and tokenizer.bos_id() >= 0 else []


def special_token(config: dict, key: str) -> str | None:
    """A tokenizer_config.json's special token: a string, or {"content": string} (transformers')."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    """A Hugging Face tokenizer.json (byte-level BPE, or sentencepiece-like) under the sentencepiece
    method names picollama calls. Special tokens and add_bos_token come from
    tokenizer_config.json."""

    def __init__(self, path: Path | str | None = None, spec: str = "", config: dict | None = None):
        """From a tokenizer.json file (and the tokenizer_config.json beside it), or their text."""
        from tokenizers import Tokenizer

        where = path or "tokenizer.json"
        try:
            if path is not None:
                spec = Path(path).read_text(encoding="utf-8")
                config_path = Path(path).with_name(TOKENIZER_CONFIG)
                config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            self.backend = Tokenizer.from_str(spec)
        except (Exception, OSError) as e:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{where} is not a Hugging Face tokenizer ({e})") from None
        self.config = config or {}
        if not isinstance(self.config, dict):
            raise ValueError(f"{TOKENIZER_CONFIG} beside {where} is not a JSON object")
        self.ids = {key: self.token_id(special_token(self.config, key)) for key in SPECIAL_KEYS}
        self.add_bos = self.config.get("add_bos_token")
        if not isinstance(self.add_bos, bool):  # Not said: ask its post-processor.
            first = self.backend.encode("a", add_special_tokens=True).ids[:1]
            self.add_bos = self.bos_id() >= 0 and first == [self.bos_id()]

    def token_id(self, token: str | None) -> int:
        found = self.backend.token_to_id(token) if isinstance(token, str) else None
        return -1 if found is None else found

    def encode(self, text: str | list[str], num_threads=None, return_type=None) -> list:
        """Token ids of a text, or of each of a list of texts, with no BOS or EOS added. return_type
        "numpy" gives int32 arrays. Special tokens in the text, such as a chat template's, match
        whole, as in llama.cpp. tokenizers picks its own threads."""
        if isinstance(text, str):
            return self.backend.encode(text, add_special_tokens=False).ids
        encoded = self.backend.encode_batch(text, add_special_tokens=False)
        if return_type == "numpy":
            return [np.array(e.ids, dtype=np.int32) for e in encoded]
        return [e.ids for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def get_piece_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_piece(self, i: int) -> str:
        """The text of token i, not its byte-level spelling (where a newline is Ċ)."""
        return self.backend.decode([i], skip_special_tokens=False)

    def bos_id(self) -> int:
        return self.ids["bos_token"]

    def eos_id(self) -> int:
        return self.ids["eos_token"]

    def unk_id(self) -> int:
        return self.ids["unk_token"]

    def pad_id(self) -> int:
        return self.ids["pad_token"]


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
