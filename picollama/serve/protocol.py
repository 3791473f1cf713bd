"""Read and check OpenAI's request bodies, and shape its errors.

This module only checks request bodies. It never touches the model. Every refusal is one
ApiError."""

import json
import math
import re
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from picollama.cli.text import TextError, check_strings

# Values that mean "off" for fields this server does not implement. Clients often send these
# defaults, so they pass. Any other value is refused, naming the field.
NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "parallel_tool_calls": (True, False),
    "modalities": (["text"],),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}
# Fields this server cannot do. Any value but null is refused.
UNSUPPORTED = {
    "functions",
    "function_call",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
}
# Fields accepted and ignored. They change nothing in what a model answers.
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
SHARED = {"model", "n", "max_tokens", "seed", "stop", "stream", "stream_options", "temperature"}
SHARED |= {"top_p", "top_k"}
CHAT_FIELDS = SHARED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
CHAT_FIELDS |= {"response_format", "tools", "tool_choice"}
COMPLETION_FIELDS = SHARED | {"prompt", "logprobs"}
ROLES = ("system", "developer", "user", "assistant", "tool")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's names of functions and schemas
MAX_STOPS = 4
MAX_TOP_LOGPROBS = {"chat": 20, "text": 5}  # OpenAI's limits on top_logprobs and logprobs.
SEEDS = 2**32
LARGEST = 2**63 - 1  # torch's int64: a larger top_k failed inside the sampler, a 500
TEXTS = ("name", "reasoning_content", "thinking", "reasoning", "tool_call_id")  # a message's


class ApiError(Exception):
    """A refused request, with its HTTP status, OpenAI's error body and any headers to send."""

    def __init__(self, status: int, message: str, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


class Strict(BaseModel):
    """JSON types taken as they are. No "1" or true for 1, and no NaN."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class Shared(Strict):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class Function(Strict):  # A tool's function (`strict` ignored: calls follow it), or a call's.
    name: str
    description: str | None = None
    parameters: dict | None = None
    arguments: str | None = None  # A call's, as JSON.


class Tool(Strict):
    type: Literal["function"]
    function: Function


class JsonSchema(Strict):  # Its `strict` is ignored: the answer always follows the schema.
    name: str
    schema_: dict | None = Field(None, alias="schema")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class Call(Tool):  # One of an assistant message's tool_calls.
    id: str


class Calls(Strict):
    tool_calls: list[Call]


class ChatBody(Shared):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None


class CompletionBody(Shared):
    logprobs: int | None = None


@dataclass
class Ask:
    """What a checked request asks for: a conversation (chat) or prompts (text).

    It also says how to answer. Each prompt gets n choices. Given a seed, choice i uses seed + i."""

    kind: Literal["chat", "text"]
    model: str | None
    messages: list[dict] = field(default_factory=list)  # Chat, as the template reads them.
    prompts: list = field(default_factory=list)  # Text, as strings or lists of token ids.
    n: int = 1
    max_tokens: int | None = None  # If None, chat runs to the context's end and text stops at 16.
    max_tokens_param: str = "max_tokens"  # The field that gave it.
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None for none. Else the chosen token's and k others.
    stream: bool = False
    include_usage: bool = False
    schema: dict | None = None  # JSON that the answer follows (response_format), or None: text.
    tools: list[dict] = field(default_factory=list)  # The functions offered (name, parameters).
    tool_choice: str = "none"  # none, auto or required.
    tool_name: str | None = None  # The one function a required call must call, if named.


def read_json(raw: bytes) -> dict:
    """A request body as a JSON object. ApiError for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {json_type(body)}")
    check_texts(body)
    return body


def check_texts(body: dict):
    """ApiError naming the first field whose name or text is not UTF-8."""
    try:
        check_strings(body)
    except TextError as e:
        raise bad(str(e), e.path, "invalid_text") from None


def json_type(value) -> str:
    """What a JSON value is, in words."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return names.get(type(value), "a number")


def check_fields(body: dict, known: set[str]):
    """ApiError naming the first field this server does not know or implement at its value."""
    for name, value in body.items():
        if name in known or name in IGNORED or value is None or neutral(name, value):
            continue
        if name in NEUTRAL or name in UNSUPPORTED:
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")
        raise bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


def given(body: dict, known: set[str]) -> dict:
    """The body's fields that are not null, once check_fields has passed them."""
    check_fields(body, known)
    return {name: value for name, value in body.items() if value is not None}


def neutral(name: str, value) -> bool:
    """Whether value is one of NEUTRAL's for the field. Here true is not 1."""
    return any(
        value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL.get(name, ())
    )


def validated(model: type[Strict], body: dict, where: str = "") -> Strict:
    """The body as `model`. ApiError names the first field of the wrong type, within `where`."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        param = (where + param).lstrip(".")
        got = json_type(error.get("input"))
        message = error["msg"] if error["type"] == "missing" else f"{error['msg']}, not {got}"
        raise bad(f"'{param}': {message}", param) from None


def chat_request(body: dict, max_n: int) -> Ask:
    """A chat completion request, checked against OpenAI's fields.

    ApiError names the bad field. A null field counts as not given."""
    body = given(body, CHAT_FIELDS)
    checked = validated(ChatBody, body)
    if checked.max_tokens is not None and checked.max_completion_tokens is not None:
        if checked.max_tokens != checked.max_completion_tokens:
            raise bad("give max_tokens or max_completion_tokens, not both", "max_tokens")
    ask = shared(checked, body, "chat", max_n)
    ask.messages = messages(checked.messages)
    if checked.max_completion_tokens is not None:
        ask.max_tokens = positive(checked.max_completion_tokens, "max_completion_tokens")
        ask.max_tokens_param = "max_completion_tokens"
    if checked.top_logprobs is not None and not checked.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if checked.logprobs:
        top = checked.top_logprobs or 0
        ask.logprobs = in_range(top, "top_logprobs", 0, MAX_TOP_LOGPROBS["chat"])
    ask.schema = answer_format(checked.response_format)
    ask.tools = functions(checked.tools or [])
    ask.tool_choice, ask.tool_name = tool_choice(checked.tool_choice, ask.tools)
    return ask


def answer_format(value: ResponseFormat | None) -> dict | None:
    """The schema the answer follows: any object, json_schema's (any JSON if none), None: text."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return {"type": "object"}
    where = "response_format.json_schema"
    if value.json_schema is None or not NAME.fullmatch(value.json_schema.name):
        raise bad(f"'{where}' needs a name of 1 to 64 letters, digits, _ or -", where)
    return value.json_schema.schema_ or {}


def functions(tools: list[Tool]) -> list[dict]:
    """The tools' functions as templates read them. Their names are OpenAI's, and differ."""
    found = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.fullmatch(name) or name in {f["name"] for f in found}:
            where = f"tools[{i}].function.name"
            raise bad(f"'{where}' must be 1 to 64 letters, digits, _ or -, and new", where)
        found.append(tool.function.model_dump(exclude_none=True, exclude={"arguments"}))
    return found


def tool_choice(value, tools: list[dict]) -> tuple[str, str | None]:
    """(none, auto or required; the function named, if one is). Default: auto with tools."""
    named = validated(Tool, value, "tool_choice.") if isinstance(value, dict) else None
    choice = "required" if named else value or ("auto" if tools else "none")
    if choice not in ("none", "auto", "required"):
        raise bad("'tool_choice' must be none, auto, required or a function", "tool_choice")
    if choice != "none" and not tools:
        raise bad("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if named and named.function.name not in {f["name"] for f in tools}:
        raise bad("'tool_choice' names a function that is not among the tools", "tool_choice")
    return choice, named and named.function.name


def completion_request(body: dict, max_n: int) -> Ask:
    """A (legacy) completion request checked."""
    body = given(body, COMPLETION_FIELDS)
    checked = validated(CompletionBody, body)
    ask = shared(checked, body, "text", max_n)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    ask.prompts = prompts(body["prompt"])
    if len(ask.prompts) * ask.n > max_n:
        raise bad(f"prompts times n must be at most {max_n}, not {len(ask.prompts) * ask.n}", "n")
    if checked.logprobs is not None:
        ask.logprobs = in_range(checked.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS["text"])
    return ask


def shared(checked: Shared, body: dict, kind: str, max_n: int) -> Ask:
    """The fields both endpoints read, checked against OpenAI's ranges."""
    if checked.stream_options is not None and not checked.stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    temperature = 1.0 if checked.temperature is None else checked.temperature
    top_p = checked.top_p
    if top_p is not None and in_range(top_p, "top_p", 0, 1) == 0:
        temperature, top_p = 0.0, None  # A top_p of 0 keeps only the top token, so greedy.
    top_k = checked.top_k
    if top_k is not None and in_range(top_k, "top_k", -1, LARGEST) <= 0:
        top_k = None  # vLLM's -1 and llama.cpp's 0 both mean no top-k.
    return Ask(
        kind,
        checked.model,
        n=in_range(checked.n, "n", 1, max_n),
        max_tokens=positive(checked.max_tokens, "max_tokens"),
        temperature=in_range(temperature, "temperature", 0, 2),
        top_p=None if top_p == 1 else top_p,
        top_k=top_k,
        seed=None if checked.seed is None else in_range(checked.seed, "seed", 0, SEEDS - 1),
        stop=stops(body.get("stop")),
        stream=checked.stream,
        include_usage=bool(checked.stream_options and checked.stream_options.include_usage),
    )


def in_range(value, name: str, low, high):
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise bad(f"'{name}' must be {bounds}, not {value}", name)
    return value


def positive(value: int | None, name: str) -> int | None:
    return None if value is None else in_range(value, name, 1, None)


def stops(value) -> list[str]:
    """The stop field. It is a string, or a list of at most 4 non-empty ones."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOPS or not all(items):
        raise bad(f"'stop' takes at most {MAX_STOPS} non-empty strings", "stop")
    return items


def messages(raw: list) -> list[dict]:
    """The conversation as a chat template reads it: role, text, name, reasoning, an assistant's
    tool_calls and a tool's tool_call_id. A tool message answers the tool calls before it."""
    if not raw:
        raise bad("'messages' must hold at least one message", "messages")
    kept = [message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    for i, (prior, m) in enumerate(zip([{}] + kept, kept)):
        if m["role"] == "tool" and prior.get("role") != "tool" and "tool_calls" not in prior:
            raise bad(f"'messages[{i}]': a tool's result must follow a call", f"messages[{i}].role")
    return kept


def message(raw, where: str) -> dict:
    if not isinstance(raw, dict):
        raise bad(f"'{where}' must be an object", where)
    role = raw.get("role")
    if role == "function" or raw.get("function_call"):
        raise bad(f"'{where}': function_call is not supported: use tools", f"{where}.role")
    if role not in ROLES:
        raise bad(
            f"'{where}.role' must be one of {', '.join(ROLES)}, not {role!r}"[:300], f"{where}.role"
        )
    kept = {"role": role, "content": content(raw.get("content"), role, f"{where}.content")}
    for key in TEXTS:
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise bad(f"'{where}.{key}' must be a string, not {json_type(value)}", f"{where}.{key}")
        if value is not None:
            kept[key] = value
    if role == "assistant" and raw.get("tool_calls"):
        calls = validated(Calls, {"tool_calls": raw["tool_calls"]}, f"{where}.")
        kept["tool_calls"] = [call.model_dump(exclude_none=True) for call in calls.tool_calls]
    return kept


def content(value, role: str, where: str) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if value is None and role == "assistant":
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"'{where}[{i}]': only text parts are supported, not {str(kind)[:40]!r}",
                    f"{where}[{i}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"'{where}' must be a string or a list of text parts", where)


def prompts(value) -> list:
    """A completion's prompt. It is a string, a list of strings, or token ids or lists of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if token_ids(value):
            return [value]
        if all(token_ids(p) for p in value):
            return [list(p) for p in value]
    raise bad(
        "'prompt' must be a string, a list of strings, or a list of token ids (or of such lists)",
        "prompt",
    )


def token_ids(value) -> bool:
    """Whether value is a non-empty list of integers."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )
