"""What the records of .jsonl files hold: text or conversations. A source holds one kind. Files
that mix the two are refused with the count of each."""

import json
import sys
from pathlib import Path

from picollama.cli import UserError

CHAT_KEYS = ("messages", "conversations")


def record_kind(line: bytes | str) -> str | None:
    """ "chat" for a JSON object with a conversation key, "text" for another JSON object, else
    None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return "chat" if any(key in record for key in CHAT_KEYS) else "text"


def mixed_kinds(files: list, source: str | None = None) -> UserError | None:
    """The error to raise when the .jsonl files hold both text records and conversations, else
    None. It gives both counts and the first row of the kind there is less of. Each file is read
    once more, so call it only on the way to an error."""
    counts, first = {"text": 0, "chat": 0}, {}
    for path in files:
        if Path(path).suffix.lower() != ".jsonl":
            continue
        with open(path, "rb") as file:
            for number, raw in enumerate(file, 1):
                kind = record_kind(raw) if raw.strip() else None
                if kind:
                    counts[kind] += 1
                    first.setdefault(kind, f"{path} line {number}")
    if not all(counts.values()):
        return None
    source = source or (str(files[0]) if len(files) == 1 else f"the {len(files)} files")
    fewer = "chat" if counts["chat"] < counts["text"] else "text"
    name = {"chat": "conversation", "text": "text"}[fewer]
    return UserError(
        f"{source}: {counts['text']:,} text records and {counts['chat']:,} conversation records "
        f"mixed; the first {name} record is {first[fewer]}; a dataset holds one kind, so put "
        "them in separate sources"
    )


def too_long_number(error: ValueError, where: str) -> UserError | None:
    """The error for a JSON line holding an integer longer than Python reads, else None."""
    if isinstance(error, json.JSONDecodeError) or "digits" not in str(error):
        return None
    return UserError(
        f"{where}: a number too long to read (Python reads integers of at most "
        f"{sys.get_int_max_str_digits():,} digits); write it as a string"
    )
