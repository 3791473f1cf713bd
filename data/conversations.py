"""Chat datasets in JSONL: records of OpenAI's "messages" or ShareGPT's "conversations". An error
names the bad line."""

import json
from pathlib import Path

from data.record_kinds import mixed_kinds, parsed_line
from data.sources import local_files
from picollama.cli import UserError
from picollama.cli.text import check_strings, checked_bytes

# The roles the OpenAI-compatible server takes (picollama/serve/protocol.py), then ShareGPT's.
ROLES = ("system", "developer", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
# The two shapes. Each maps the record's key to the keys of a message's role and content.
SHAPES = {"messages": ("role", "content"), "conversations": ("from", "value")}
# Roles and ShareGPT senders of tool calls and their results, which are not supported.
TOOL_ROLES = ("tool", "function", "ipython", "function_call", "observation")
KEPT_KEYS = ("name", "reasoning_content", "thinking", "reasoning")  # Passed on to the template.
# What describe calls a JSON value of each Python type json.loads gives.
JSON_KINDS = {str: "string", int: "number", float: "number", bool: "boolean", list: "array"}
PEEK_LINES = 100  # Lines read for the first JSON record, which tells what a .jsonl holds.


def conversation_files(source: str) -> list[Path] | None:
    """The .jsonl files of a source whose records hold conversations, or None for a text source.
    The first JSON record of the first .jsonl file decides. UserError when conversations come
    with files of another kind."""
    if source == "shakespeare" or source.startswith("hf:"):
        return None
    files = local_files(source)
    jsonl = [path for path in files if path.suffix.lower() == ".jsonl"]
    for path in jsonl:
        check_not_empty(path)
    if not jsonl or first_shape(jsonl[0]) is None:
        return None
    others = [str(path) for path in files if path not in jsonl]
    if others:
        raise UserError(
            f"{source}: {jsonl[0]} holds conversations but {others[0]} is not a .jsonl file; a "
            "chat dataset is .jsonl files of conversations alone"
        )
    return jsonl


def check_not_empty(path: Path):
    """UserError naming a .jsonl file with no record, not even a blank line's worth of text."""
    with open(path, "rb") as file:
        if not any(line.strip() for line in file):
            raise UserError(f"{path}: an empty file, with no record; remove it or fill it")


def first_shape(path: Path) -> str | None:
    """ "messages" or "conversations" where the file's first JSON object (among its first lines)
    holds that key, else None. A line with a number too long to read, or nested too deep, is
    refused, naming it: taken for no JSON, it made a file of conversations read as text."""
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in zip(range(1, PEEK_LINES + 1), file):
            try:
                record = parsed_line(line, f"{path} line {number}")
            except UserError:
                raise
            except ValueError:
                continue
            if isinstance(record, dict):
                return next((key for key in SHAPES if key in record), None)
    return None


def read_conversations(files: list[Path], max_docs: int | None = None):
    """(where, messages, size) of each record, in order. where is "FILE line N", the messages are
    OpenAI's with a "train" flag each, size is the line's bytes. Blank lines are skipped, at most
    max_docs records read. A UserError names the first bad line."""
    count = 0
    for path in files:
        with open(path, "rb") as file:
            for number, raw in enumerate(file, 1):
                if max_docs and count >= max_docs:
                    return
                where = f"{path} line {number}"
                line = decoded(raw, where).removeprefix("\ufeff" if number == 1 else "")
                if line.strip():
                    try:
                        messages = checked_record(line, where)
                    except UserError:
                        if mixed := mixed_kinds(files):
                            raise mixed from None
                        raise
                    yield where, messages, len(raw)
                    count += 1


def decoded(raw: bytes, where: str) -> str:
    """A line's text. UserError unless it is UTF-8."""
    return checked_bytes(raw, where, "; convert the file to UTF-8 first")


def checked_record(line: str, where: str) -> list[dict]:
    """A record's messages, OpenAI-shaped and checked: roles, text content, an assistant turn to
    train. A UserError names the line and the problem."""
    try:
        record = parsed_line(line, where)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    check_strings(record, where)  # A "\ud800" escape decodes to a lone surrogate.
    keys = [key for key in SHAPES if isinstance(record, dict) and key in record]
    if len(keys) != 1:
        raise UserError(
            f'{where}: a record is a JSON object with "messages" (OpenAI\'s shape) or '
            f'"conversations" (ShareGPT\'s), one of them; this one holds {describe(record)}'
        )
    turns = record[keys[0]]
    if not isinstance(turns, list) or not turns:
        raise UserError(f'{where}: "{keys[0]}" must be a non-empty list of messages')
    messages = [
        checked_message(turn, f"{where}: {keys[0]}[{i}]", keys[0]) for i, turn in enumerate(turns)
    ]
    replies = [message for message in messages if message["role"] == "assistant"]
    if not replies:
        raise UserError(f"{where}: no assistant turn; a conversation trains on its replies")
    if not any(message["train"] for message in replies):
        raise UserError(f'{where}: every assistant turn is "train": false; nothing to train')
    return messages


def describe(record) -> str:
    """What a JSON value holds, for a message: its keys, or its kind."""
    if isinstance(record, dict):
        keys = ", ".join(json.dumps(key) for key in list(record)[:6])
        return f"the keys {keys}" if keys else "no key"
    kind = "null" if record is None else JSON_KINDS.get(type(record), type(record).__name__)
    return f"a JSON {kind}"


def checked_message(turn, where: str, shape: str) -> dict:
    """One message of a record of this shape as OpenAI's {"role", "content", "train"} (and the keys
    a template may read)."""
    role_key, content_key = SHAPES[shape]
    if not isinstance(turn, dict):
        raise UserError(f"{where}: a message is a JSON object, not {describe(turn)}")
    role = turn.get(role_key)
    if turn.get("tool_calls") or turn.get("function_call") or role in TOOL_ROLES:
        raise UserError(f"{where}: tool calls are not supported; leave out this conversation")
    known = SHAREGPT_ROLES if shape == "conversations" else dict(zip(ROLES, ROLES))
    if not isinstance(role, str) or role not in known:
        raise UserError(
            f"{where}: unknown {role_key} {json.dumps(role)[:60]} (one of {', '.join(known)})"
        )
    message = {"role": known[role], "content": text_content(turn.get(content_key), where)}
    message.update((key, turn[key]) for key in KEPT_KEYS if isinstance(turn.get(key), str))
    train = turn.get("train", True)
    if not isinstance(train, bool):
        raise UserError(f'{where}: "train" is true or false, not {json.dumps(train)[:60]}')
    if "train" in turn and train and message["role"] != "assistant":
        raise UserError(f'{where}: "train": true on a {role} message; only replies train')
    message["train"] = train and message["role"] == "assistant"
    return message


def text_content(value, where: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined. UserError if empty."""
    if isinstance(value, list) and value:
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                name = kind.removeprefix("input_").removesuffix("_url")  # image_url: image
                raise UserError(
                    f"{where}: {name} parts are not supported (a {json.dumps(kind)[:40]} part); "
                    "content is text or a list of text parts"
                )
        texts = [part.get("text") for part in value if isinstance(part, dict)]
        if len(texts) == len(value) and all(isinstance(text, str) for text in texts):
            value = "".join(texts)
    if not isinstance(value, str):
        raise UserError(f"{where}: the content must be text, not {describe(value)}")
    if not value.strip():
        raise UserError(f"{where}: empty content")
    return value
