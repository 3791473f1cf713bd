"""OpenAI's response shapes for chat completions and completions.

Answers go out whole or as server-sent chunks. This module only shapes JSON. It never runs
the model."""

import json
import time
import uuid
from dataclasses import dataclass, field

from picollama.sampling.completion_text import Entry
from picollama.serve.engine import Delta, Failed, Finished

LOWEST_LOGPROB = -9999.0  # OpenAI's value for a ruled-out token. JSON has no -inf.
DONE = "data: [DONE]\n\n"


@dataclass
class Head:
    """What every chunk of one response shares.

    That is its id, kind ("chat" or "text"), creation time and model. It also records whether
    logprobs and a usage chunk were asked for."""

    kind: str
    model: str
    logprobs: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

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


@dataclass
class Choice:
    """One choice gathered from the engine's events."""

    text: str = ""
    entries: list[Entry] = field(default_factory=list)
    reason: str | None = None
    tokens: int = 0


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
        if head.kind == "chat":
            said = {"message": {"role": "assistant", "content": choice.text, "refusal": None}}
        else:
            said = {"text": choice.text}
        choices.append({"index": i, **said, "logprobs": logprobs, "finish_reason": choice.reason})
    used = usage(prompt_tokens, sum(c.tokens for c in gathered.choices))
    return head.top(choices, used)


def sse(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chunk(head: Head, index: int, text=None, entries=None, reason=None, role=False) -> str:
    """One choice's chunk. It carries new text with its logprobs, the chat role, or the end."""
    logprobs = None
    if head.logprobs and entries:
        logprobs = (chat_logprobs if head.kind == "chat" else text_logprobs)(entries)
    if head.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else {}
        said = {"delta": {**delta, "content": text} if text else delta}
    else:
        said = {"text": text or ""}
    choice = {"index": index, **said, "logprobs": logprobs, "finish_reason": reason}
    return sse(head.top([choice], streamed=True))


def usage_chunk(head: Head, prompt_tokens: int, completion_tokens: int) -> str:
    """The last chunk, sent if stream_options.include_usage asks. It holds only the usage."""
    return sse(head.top([], usage(prompt_tokens, completion_tokens), streamed=True))
