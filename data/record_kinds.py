"""What the records of .jsonl files hold: text or conversations. A source holds one kind. Files
that mix the two are refused with the count of each. A row that is no JSON object, or JSON that
Python cannot read, is refused with its line."""

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
    except (ValueError, RecursionError):  # Counted as neither. The line is refused elsewhere.
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


def parsed_line(line: bytes | str, where: str):
    """json.loads(line), or a UserError naming `where` for JSON Python cannot read: an integer
    too long, or nesting too deep for its parser (its RecursionError was a traceback). Other broken
    JSON raises ValueError, as json.loads does."""
    try:
        return json.loads(line)
    except RecursionError:
        raise UserError(
            f"{where}: JSON nested too deep to read (Python's parser stops near "
            f"{sys.getrecursionlimit():,} levels); flatten or remove it"
        ) from None
    except ValueError as e:
        if problem := too_long_number(e, where):
            raise problem from None
        raise


def check_json_rows(path: Path) -> None:
    """UserError naming the first row of a .jsonl/.json file that is not a JSON object, before
    the datasets package reads it. It crashed the process on a first row of null and skipped a
    null row after a record. A row is told by its first byte, "{", in one pass that parses
    nothing. A file may instead be one JSON document, as datasets reads it: an object, or a list
    of objects."""
    first, bad = b"", None
    with open(path, "rb") as file:
        for row, line in enumerate(file, 1):
            line = line.removeprefix(b"\xef\xbb\xbf" if row == 1 else b"").lstrip()
            first = first or line
            if line and not line.startswith(b"{"):
                bad = row
                break
    if bad is None:
        return
    if not document_start(first):
        raise not_rows(path, bad)
    try:
        document = parsed_line(path.read_text(encoding="utf-8-sig"), str(path))
    except UserError:
        raise
    except ValueError:
        check_json_records(path)  # Says where it breaks.
        raise not_rows(path, bad) from None
    items = document if isinstance(document, list) else [document]
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise UserError(
                f"{path}: item {index} of its JSON document is {json.dumps(item)[:40]}, not a "
                'JSON object such as {"text": "..."}; fix or remove it'
            )


def document_start(line: bytes) -> bool:
    """Whether a file's first line starts one JSON document, not a row: a list, or an object
    that goes on past the line."""
    if line.startswith(b"["):
        return True
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return line.startswith(b"{")
    return False


def not_rows(path: Path, row: int) -> UserError:
    """The error for a row of a JSON Lines file that is not a JSON object."""
    return UserError(
        f"{path}: not valid JSON Lines (row {row}): each row must be one JSON object, "
        'such as {"text": "..."}; fix or remove that row'
    )


def check_json_records(path: Path) -> None:
    """UserError naming the first row of a .jsonl/.json file that is not a JSON object, parsing
    each. A .json file may instead be one JSON document. Then the error says where it breaks,
    unless it looks like rows."""
    broken = None
    if path.suffix.lower() == ".json":
        try:
            parsed_line(path.read_text(encoding="utf-8-sig"), str(path))
            return
        except json.JSONDecodeError as exc:
            broken = f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno})"
    with open(path, encoding="utf-8-sig", newline="\n") as file:
        rows = ((row, line) for row, line in enumerate(file, 1) if line.strip())
        for count, (row, line) in enumerate(rows):
            try:
                value = parsed_line(line, f"{path} row {row}")
            except UserError:
                raise
            except ValueError:
                value = None
            if isinstance(value, dict):
                continue
            if broken and not count:  # Its first line is no record: a document, not rows.
                raise UserError(broken)
            raise not_rows(path, row)
