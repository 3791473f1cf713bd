"""OpenAI's response shapes for chat completions and completions.

Answers go out whole or as server-sent chunks. A chat answer with tools offered is read for
tool calls (tools.calls_in). Streamed, it is held back until its choice ends, then sent as text
or as tool_calls. This module only shapes JSON. It never runs the model."""

import json
import time
import uuid
from dataclasses import dataclass, field

from picollama.sampling.completion_text import Entry
from picollama.serve.engine import Delta, Failed, Finished
from picollama.serve.protocol import Ask
from picollama.serve.tools import calls_in

LOWEST_LOGPROB = -9999.0  # OpenAI's value for a ruled-out token. JSON has no -inf.
DONE = "data: [DONE]\n\n"


@dataclass
class Choice:
    """One choice gathered from the engine's events."""

    text: str = ""
    entries: list[Entry] = field(default_factory=list)
    reason: str | None = None
    tokens: int = 0


@dataclass
class Head:
    """What every chunk of one response shares.

    That is its id, kind ("chat" or "text"), creation time and model. It also records whether
    logprobs and a usage chunk were asked for, and the names of the functions whose calls are
    read back from its answers (none: the answers are text). `held`: each streamed choice's text
    and logprob entries so far, where calls are read."""

    kind: str
    model: str
    logprobs: bool = False
    include_usage: bool = False
    tools: frozenset[str] = frozenset()
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    held: dict[int, Choice] = field(default_factory=dict)

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"

    def top(self, choices: list[dict], usage=None, streamed: bool = False) -> dict:
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        body = {
            "id": self.id,
            "object": kind + (".chunk" if streamed and self.kind == "chat" else ""),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if usage is not None or not streamed or self.include_usage:
            body["usage"] = usage
        return body


def head_for(ask: Ask, model: str) -> Head:
    """The Head of the answer to `ask`, from `model`."""
    tools = frozenset(f["name"] for f in ask.tools) if ask.tool_choice != "none" else frozenset()
    return Head(ask.kind, model, ask.logprobs is not None, ask.include_usage, tools)


def said(head: Head, text: str, reason: str | None) -> tuple[dict, str | None]:
    """(a chat choice's message: its text, or its tool calls; its finish_reason, "tool_calls"
    where it called)."""
    content, calls = calls_in(text, head.tools) if head.tools else (text, [])
    message = {"role": "assistant", "content": content, "refusal": None}
    if not calls:
        return message, reason
    return message | {"tool_calls": calls}, "tool_calls"


class Gathered:
    """A request's events folded into its choices, for a whole, unstreamed answer."""

    def __init__(self, n: int):
        self.choices = [Choice() for _ in range(n)]
        self.failed: Failed | None = None

    @property
    def over(self) -> bool:
        return self.failed is not None or all(c.reason for c in self.choices)

    def add(self, event):
        if isinstance(event, Failed):
            self.failed = event
        elif isinstance(event, Delta):
            choice = self.choices[event.choice]
            choice.text += event.text
            choice.entries += event.entries
        elif isinstance(event, Finished):
            self.choices[event.choice].reason = event.reason
            self.choices[event.choice].tokens = event.tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprob(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def chat_logprobs(entries: list[Entry]) -> dict:
    """A chat choice's logprobs: each token's text, logprob, bytes and top alternatives."""

    def one(text: str, value: float) -> dict:
        return {"token": text, "logprob": logprob(value), "bytes": list(text.encode())}

    content = [
        {**one(e.text, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def text_logprobs(entries: list[Entry]) -> dict:
    """A completion choice's logprobs in the legacy shape of parallel lists."""
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [logprob(e.logprob) for e in entries],
        "top_logprobs": [{t: logprob(v) for t, v in e.top} for e in entries],
        "text_offset": [e.start for e in entries],
    }


def whole(head: Head, gathered: Gathered, prompt_tokens: int) -> dict:
    """The unstreamed answer."""
    choices = []
    for i, choice in enumerate(gathered.choices):
        logprobs = None
        if head.logprobs:
            logprobs = (chat_logprobs if head.kind == "chat" else text_logprobs)(choice.entries)
        reason = choice.reason
        if head.kind == "chat":
            message, reason = said(head, choice.text, reason)
            answer = {"message": message}
        else:
            answer = {"text": choice.text}
        choices.append({"index": i, **answer, "logprobs": logprobs, "finish_reason": reason})
    used = usage(prompt_tokens, sum(c.tokens for c in gathered.choices))
    return head.top(choices, used)


def sse(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chunk(head: Head, index: int, text=None, entries=None, reason=None, role=False) -> str:
    """One choice's chunk. It carries new text with its logprobs, the chat role, or the end.
    Where calls are read (head.tools), text is held back until the end (held_chunks)."""
    if head.tools and not role:
        return held_chunks(head, index, text, entries, reason)
    return plain_chunk(head, index, text, entries, reason, role)


def plain_chunk(head: Head, index: int, text=None, entries=None, reason=None, role=False) -> str:
    """chunk's, as it goes out."""
    logprobs = None
    if head.logprobs and entries:
        logprobs = (chat_logprobs if head.kind == "chat" else text_logprobs)(entries)
    if head.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else {}
        answer = {"delta": {**delta, "content": text} if text else delta}
    else:
        answer = {"text": text or ""}
    choice = {"index": index, **answer, "logprobs": logprobs, "finish_reason": reason}
    return sse(head.top([choice], streamed=True))


def held_chunks(head: Head, index: int, text, entries, reason) -> str:
    """Nothing while the choice goes on: its text is held. At its end, its text or its
    tool_calls (each whole, with an index), then its finish_reason."""
    held = head.held.setdefault(index, Choice())
    held.text += text or ""
    held.entries += entries or []
    if reason is None:
        return ""
    message, reason = said(head, held.text, reason)
    if "tool_calls" not in message:
        text = plain_chunk(head, index, held.text, held.entries) if held.text else ""
        return text + plain_chunk(head, index, reason=reason)
    calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    logprobs = chat_logprobs(held.entries) if head.logprobs else None
    delta = {"tool_calls": calls} | ({"content": message["content"]} if message["content"] else {})
    delta = {"delta": delta, "logprobs": logprobs, "finish_reason": None}
    end = {"delta": {}, "logprobs": None, "finish_reason": reason}
    return "".join(sse(head.top([{"index": index, **c}], streamed=True)) for c in (delta, end))


def usage_chunk(head: Head, prompt_tokens: int, completion_tokens: int) -> str:
    """The last chunk, sent if stream_options.include_usage asks. It holds only the usage."""
    return sse(head.top([], usage(prompt_tokens, completion_tokens), streamed=True))
