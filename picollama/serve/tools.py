"""Tools: OpenAI's function tools offered to the model, and the calls read back from its answers.

A chat template that reads `tools` renders them in its own format. Another (SmolLM2's, the
default) gets them in a system message, INSTRUCTIONS, which asks for a call as a JSON object.
A required call (tool_choice "required" or a named function) decodes under the call's JSON
schema (answer_schema), so even a model never trained on tools answers with a valid call. Calls
are read back from an answer's text in OpenAI's shape (calls_in). This module never runs the
model: it only shapes messages, schemas and calls.
"""

import json
import re
import uuid
from functools import lru_cache

from jinja2 import meta

from picollama.chat_template import compiled, environment
from picollama.serve.protocol import Ask

INSTRUCTIONS = (
    "You can call these functions. To call one, answer with nothing but a JSON object "
    '{"name": <the function\'s name>, "arguments": <an object of its arguments>}.\n\n'
    "Functions:\n"
)
# What templates' own call formats leave around a call once it is taken out of the text.
WRAPPERS = re.compile(r"</?tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|```(?:json)?")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
DEFINITIONS = ("$defs", "definitions")  # where a schema's "$ref"s point: kept at the root


@lru_cache(maxsize=8)
def reads_tools(template: str) -> bool:
    """Whether a chat template renders `tools` (it reads the variable)."""
    compiled(template)  # its syntax error first
    return "tools" in meta.find_undeclared_variables(environment().parse(template))


def conversation(ask: Ask, template: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render the request with. A template that reads tools gets the
    tools (none where tool_choice is none) and the messages, calls' arguments as objects, as
    transformers' templates read them. Another gets the tools in a system message, calls as
    JSON in the assistant's text, and tool results as user messages."""
    tools = [{"type": "function", "function": f} for f in ask.tools if ask.tool_choice != "none"]
    if reads_tools(template):
        return [with_objects(m) for m in ask.messages], tools or None
    names = {c["id"]: c["function"]["name"] for m in ask.messages for c in m.get("tool_calls", ())}
    messages = [spelled(m, names) for m in ask.messages]
    if not tools:
        return messages, None
    text = INSTRUCTIONS + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
        return [first, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def arguments_object(arguments: str | None):
    """A call's arguments as an object where they are one in JSON ({} for none), else as they
    were."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def function_called(call: dict) -> dict:
    """A call's function as templates read it: its name, and its arguments as an object."""
    return {**call["function"], "arguments": arguments_object(call["function"].get("arguments"))}


def with_objects(message: dict) -> dict:
    """A message whose tool calls' arguments are objects, not JSON text."""
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": function_called(c)} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def spelled(message: dict, names: dict[str, str]) -> dict:
    """A message as a template without tools reads it: an assistant's calls as JSON objects
    after its text (as INSTRUCTIONS asks), a tool's result as a user message naming its
    function (`names`: each call id's)."""
    if message["role"] == "tool":
        name = names.get(message.get("tool_call_id"), "a function")
        return {"role": "user", "content": f"{name} returned: {message['content']}"}
    if "tool_calls" not in message:
        return message
    calls = [json.dumps(function_called(c), ensure_ascii=False) for c in message["tool_calls"]]
    text = "\n".join(filter(None, [message["content"], *calls]))
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}


def call_schema(function: dict) -> dict:
    """The JSON schema of a call: {"name": the function's, "arguments": its parameters}. The
    parameters' definitions move to the root, where their "$ref"s ("#/$defs/...") point."""
    parameters = dict(function.get("parameters") or NO_ARGUMENTS)
    definitions = {key: parameters.pop(key) for key in DEFINITIONS if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
    }


def answer_schema(ask: Ask) -> dict | None:
    """The JSON schema the answer decodes under, or None for free text. A required call is one
    to an allowed function. With tools on auto, response_format's schema or a call. Else
    response_format's."""
    if ask.tool_choice == "required":
        allowed = [f for f in ask.tools if ask.tool_name in (None, f["name"])]
        return any_of([call_schema(f) for f in allowed])
    if ask.schema is not None and ask.tool_choice == "auto":
        return any_of([call_schema(f) for f in ask.tools] + [ask.schema])
    return ask.schema


def any_of(schemas: list[dict]) -> dict:
    """A schema any of `schemas` meets. Their definitions move to its root."""
    if len(schemas) == 1:
        return schemas[0]
    parts, definitions = [dict(schema) for schema in schemas], {key: {} for key in DEFINITIONS}
    for part in parts:
        for key in DEFINITIONS:
            definitions[key].update(part.pop(key, {}))
    return {"anyOf": parts} | {key: found for key, found in definitions.items() if found}


def calls_in(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """(the text left, None if nothing is; the calls in it, in OpenAI's shape). A call is a JSON
    object naming one of `names` with its arguments (or parameters) as an object, alone or in a
    list of calls. Templates' wrappers around calls (<tool_call>...) go with them."""
    decoder, calls, left, at = json.JSONDecoder(), [], [], 0
    for start in re.finditer(r"[{\[]", text):
        if start.start() < at:
            continue
        try:
            value, end = decoder.raw_decode(text, start.start())
        except ValueError:
            continue
        found = [called(item, names) for item in (value if isinstance(value, list) else [value])]
        if found and all(found):
            calls += found
            left.append(text[at : start.start()])
            at = end
    if not calls:
        return text, []
    rest = WRAPPERS.sub("", "".join(left) + text[at:]).strip()
    return rest or None, calls


def called(item, names: frozenset[str]) -> dict | None:
    """A call in OpenAI's shape, if `item` is one: {"name", "arguments"} (or "parameters")."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters"))
    if isinstance(arguments, str):
        arguments = arguments_object(arguments)
    if not isinstance(arguments, dict):
        return None
    function = {"name": item["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
