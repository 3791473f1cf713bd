"""Structured output and tools: answers decoded under a JSON schema (sampling/grammar.py) parse
and validate (jsonschema), in both decode loops and through the server (the openai client);
tool calls come back in OpenAI's shape (serve/tools.py)."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import pytest
import torch

from data.tokenizer import HFTokenizer
from model import ModelArgs, Transformer
from picollama.kernels.fused_step import DecodeStep
from picollama.sampling.decode import decode_rows
from picollama.sampling.grammar import (
    Constraint,
    GrammarError,
    TooFewTokens,
    json_grammar,
    mask_of,
    vocabulary,
)
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampling
from picollama.sampling.slots import Slots
from picollama.serve.protocol import Ask
from picollama.serve.tools import answer_schema, calls_in, conversation

jsonschema = pytest.importorskip("jsonschema", reason="the oracle: pip install -e '.[dev]'")
pytest.importorskip("llguidance", reason="structured output: pip install -e '.[serve]'")

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
END = "<|end|>"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [  # small, so that each answer ends within a few dozen tokens
    {"type": "object"},
    {},
    PERSON,
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]},
    {"type": "string", "maxLength": 12},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}, "n": {"type": "null"}},
        "required": ["x", "ok", "n"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "array"}}}},
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "minLength": 3}},
        "required": ["id"],
    },
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2},
    {"$defs": {"p": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/p"}}},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}},
    {"type": "number", "minimum": -5, "maximum": 5},
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1},
]
WEATHER = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    """A byte-level BPE tokenizer.json (as SmolLM2's), trained here on JSON-like text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[END], initial_alphabet=alphabet)
    texts = [
        json.dumps({"name": f"person {i}", "age": i, "tags": ["x"] * (i % 3)}) for i in range(200)
    ]
    backend.train_from_iterator(texts, trainer)
    return HFTokenizer(spec=backend.to_str(), config={"eos_token": END})


@pytest.fixture(scope="module")
def model(one_thread, tokenizer):
    """A random model: left alone, it would never close a JSON answer."""
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=400, max_seq_len=256)
    return Transformer(ModelArgs(**{**args.to_dict(), "multiple_of": 16})).eval()


def constrained_rows(tokenizer, schemas, max_new: int, temperature: float) -> list[Row]:
    """A row a schema, each with its own Constraint, seeded by its index."""
    end = tokenizer.eos_id()
    vocab = vocabulary(tokenizer, frozenset({end}))
    rows = []
    for i, schema in enumerate(schemas):
        constraint = Constraint(vocab, json_grammar(schema), max_new - 1)
        sampling = Sampling(max_new, temperature, seed=i, constraint=constraint)
        rows.append(Row(tokenizer.encode("Answer in JSON:"), sampling, frozenset({end})))
    return rows


def check_answers(tokenizer, schemas, outputs, reasons):
    for schema, tokens, reason in zip(schemas, outputs, reasons):
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), schema)  # raises if not
        assert reason == "stop", (text, reason)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_new", [40, 64])
def test_a_random_model_always_closes_its_json_in_both_decode_loops(
    model, tokenizer, temperature, max_new
):
    """decode_rows (static batches) and Slots (continuous batching) both mask with each row's
    grammar and end every answer valid, with a stop, within max_new tokens."""
    schemas = SCHEMAS[:10]
    reasons = {}
    rows = constrained_rows(tokenizer, schemas, max_new, temperature)
    outputs = decode_rows(model, rows, lambda r, t: False, reasons.__setitem__)
    check_answers(tokenizer, schemas, outputs, [reasons[r] for r in range(len(rows))])
    assert all(len(tokens) < max_new for tokens in outputs)

    rows = constrained_rows(tokenizer, SCHEMAS[10:], max_new, temperature)
    slots, got, ended = Slots(model, DecodeStep(model)), [[] for _ in rows], {}
    for r, (row, tokens) in enumerate(zip(rows, got)):
        slots.join(row, partial(record, tokens), partial(ended.__setitem__, r))
    while slots.slots:
        slots.advance()
    check_answers(tokenizer, SCHEMAS[10:], got, [ended[r] for r in range(len(rows))])


def record(tokens: list[int], token) -> bool:
    """A row's on_token: its token kept, and the row goes on."""
    tokens.append(token.id)
    return False


def test_too_few_tokens_for_a_schema_is_said_before_decoding(tokenizer):
    vocab = vocabulary(tokenizer, frozenset({tokenizer.eos_id()}))
    with pytest.raises(TooFewTokens, match="too few tokens: the shortest answer found takes"):
        Constraint(vocab, json_grammar(PERSON), 3)


# Schemas whose every answer is too long to find, or that llguidance fails on: they came back
# 200, cut short ("length") or empty, not JSON.
ENDLESS = [
    {"type": "string", "minLength": 100_000},
    {"type": "array", "minItems": 10**9, "items": {"type": "integer"}},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {
        "$defs": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
            "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
        },
        "$ref": "#/$defs/A",
    },
]
TOO_MANY_EXPRESSIONS = {"type": "string", "pattern": "^a{1000000}$"}  # compiles, fails on "


def test_a_schema_with_no_answer_found_or_that_llguidance_fails_on_is_refused_at_once(tokenizer):
    vocab = vocabulary(tokenizer, frozenset({tokenizer.eos_id()}))
    for schema in ENDLESS:
        with pytest.raises(GrammarError, match="no answer that follows the schema was found"):
            Constraint(vocab, json_grammar(schema), 29)
    with pytest.raises(GrammarError, match="cannot be compiled: lexer error: too many expr"):
        Constraint(vocab, json_grammar(TOO_MANY_EXPRESSIONS), 29)
    # The greedy way to end spells "aaaa..." for ever; the second search prefers new tokens.
    for pattern, example in [(r"^[a-z]+@[a-z]+\.com$", "a@a.com"), ("^a*b$", "ab")]:
        schema = {"type": "string", "pattern": pattern}
        constraint = Constraint(vocab, json_grammar(schema), 29)
        assert json.loads(tokenizer.decode(constraint.path)) == example
        jsonschema.validate(example, schema)


def test_a_grammar_that_fails_mid_answer_fails_the_request(model, tokenizer):
    """llguidance failing on the way (its lexer's limits, say) ends the row at once, and the
    request answers an error: never a cut or empty answer passed off as done."""
    import asyncio

    from picollama.sampling.completion_text import ChoiceText
    from picollama.serve.engine import Engine, Failed, Finished, Job

    end = tokenizer.eos_id()
    constraint = Constraint(vocabulary(tokenizer, frozenset({end})), json_grammar(PERSON), 39)
    taken = constraint.take

    def take(token: int):  # After the answer's second token the matcher fails.
        taken(token)
        if constraint.left == 37:
            refused = ~mask_of(constraint.matcher, constraint.vocab.size)
            constraint.matcher.consume_token(int(refused.nonzero()[0][0]))

    constraint.take = take
    prompt = tokenizer.encode("Answer in JSON:")
    row = Row(prompt, Sampling(40, 1.0, seed=0, constraint=constraint), frozenset({end}))

    async def decode() -> tuple[list, dict]:
        engine = Engine(model).start()
        job = Job([row], [ChoiceText(tokenizer, prompt, [], strip=True)])
        engine.submit(job)
        events = [await asyncio.wait_for(job.events.get(), 60)]
        while not isinstance(events[-1], Failed | Finished):
            events.append(await asyncio.wait_for(job.events.get(), 60))
        engine.close()
        return events, engine.status()

    events, status = asyncio.run(decode())
    assert isinstance(events[-1], Failed) and events[-1].status == 500, events
    assert events[-1].message.startswith("structured output failed mid-answer: "), events
    assert status["tokens"] == 2 and constraint.error, status  # the token it failed on ended it


def test_tools_render_in_the_template_that_reads_them_else_in_a_system_message():
    reads = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    ask = Ask("chat", None, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    ask.tool_choice = "auto"
    messages, tools = conversation(ask, reads)
    assert tools == TOOLS and messages == ask.messages
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages, tools = conversation(ask, plain)
    assert (
        tools is None
        and messages[0]["role"] == "system"
        and "get_weather" in messages[0]["content"]
    )
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ask.messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
    ]
    messages, _ = conversation(ask, plain)
    assert messages[2]["content"] == '{"name": "get_weather", "arguments": {}}'
    assert messages[3] == {"role": "user", "content": "get_weather returned: 21 C"}


def test_calls_are_read_back_in_openais_shape_whatever_wraps_them():
    names = frozenset({"get_weather"})
    for text in [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "Let me look.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    ]:
        content, calls = calls_in(text, names)
        assert content in (None, "Let me look."), text
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls_in('{"name": "other", "arguments": {}}', names) == (
        '{"name": "other", "arguments": {}}',
        [],
    )


def test_a_required_call_with_response_format_follows_the_call_and_auto_allows_both():
    ask = Ask("chat", None, tools=[WEATHER], schema=PERSON, tool_choice="required")
    assert answer_schema(ask)["properties"]["name"] == {"const": "get_weather"}
    ask = replace(ask, tool_choice="auto")
    assert len(answer_schema(ask)["anyOf"]) == 2
    assert answer_schema(replace(ask, tool_choice="none")) == PERSON


# The server on SmolLM2-135M-Instruct, driven by the openai client.


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not SMOLLM2:
        pytest.skip("set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
    from test_serve import Server

    server = Server(tmp_path_factory.mktemp("structured"), SMOLLM2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(smollm2):
    return smollm2.client("no key needed", timeout=120)


def json_answer(client, schema: dict, seed: int) -> tuple[str, str]:
    format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = client.chat.completions.create(
        model="run",
        messages=[{"role": "user", "content": "Answer with an example in JSON."}],
        response_format=format,
        max_tokens=32,
        temperature=1.0,
        seed=seed,
    )
    return answer.choices[0].message.content, answer.choices[0].finish_reason


def test_json_schema_answers_parse_and_validate_at_temperature_1(client):
    """20 schemas, 8 requests at a time: every answer is valid JSON for its schema, ended by
    the model's end of turn within max_tokens."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(json_answer, [client] * len(SCHEMAS), SCHEMAS, range(20)))
    for schema, (text, reason) in zip(SCHEMAS, answers):
        jsonschema.validate(json.loads(text), schema)
        assert reason == "stop", (schema, text)


def test_json_object_streams_and_parses(client):
    stream = client.chat.completions.create(
        model="run",
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=1.0,
        seed=1,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_required_call_comes_back_in_openais_shape(client, choice):
    """SmolLM2's template has no tools: they go in a system message, and the call is decoded
    under its schema, so the arguments validate."""
    answer = client.chat.completions.create(
        model="run",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=48,
        temperature=1.0,
        seed=5,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])


def test_a_streamed_call_comes_in_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="run",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert deltas and {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_history_of_calls_and_results_is_answered(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model="run", messages=history, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


ODD = {"type": "nonsense"}  # a schema llguidance refuses
BAD = [  # (body beside the messages, the param its error names)
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, None),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, None),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "max_tokens": 1}, "max_tokens"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ODD}}},
        "response_format",
    ),
    *[
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
            | {"max_tokens": 30},
            "response_format",
        )
        for s in [*ENDLESS, TOO_MANY_EXPRESSIONS]
    ],
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": ODD}}]}
        | {"tool_choice": "required"},
        "tools",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
        "max_tokens",
    ),
]


def test_bad_formats_and_tools_are_400s_that_name_their_field(smollm2):
    for extra, param in BAD:
        body = {"messages": ASK_WEATHER, "max_tokens": 4, **extra}
        response = smollm2.post("/v1/chat/completions", json.dumps(body).encode(), key=None)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert param is None or error["param"] == param, (extra, error)
    history = [{"role": "tool", "content": "21", "tool_call_id": "x"}, *ASK_WEATHER]
    response = smollm2.post(
        "/v1/chat/completions", json.dumps({"messages": history}).encode(), key=None
    )
    assert response.json()["error"]["param"] == "messages[0].role"
