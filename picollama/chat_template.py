"""Chat templates: a conversation rendered with the model's own Jinja template, as transformers
does, in a sandbox that also bounds a rendering's time and size. Also its encoding, the tokens
that end a reply, and the trial a template must pass before a server or chat uses it."""

import json
import math
import re
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from data.tokenizer import TOKENIZER_CONFIG, HFTokenizer, prompt_start, special_token
from picollama.cli import UserError
from picollama.cli.outputs import atomic_output
from picollama.cli.user_files import read_small_text

# The template of a run that has none, such as one trained here. It is plain text that any
# tokenizer can spell. Each turn starts with its role (System, User, Assistant) and a colon. The
# tokenizer's EOS ends an assistant turn. The generation prompt ends at "Assistant:" with no space.
# A reply's first token carries its space (" Hello"), as in the turns SFT trains on. encode_chat
# adds the BOS, where the tokenizer has one.
DEFAULT_TEMPLATE = """\
{% for message in messages %}
{% if message['role'] in ('system', 'developer') %}
System: {{ message['content'] }}
{% elif message['role'] == 'user' %}
User: {{ message['content'] }}
{% elif message['role'] == 'assistant' %}
Assistant: {{ message['content'] }}{{ eos_token }}
{%- else %}
{{ raise_exception("the default chat template has no role '" ~ message['role'] ~ "'") }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{%- endif %}"""

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES). A template sees those set.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The oldest jinja2 without known sandbox escapes. Templates in GGUF files are untrusted code.
SAFE_JINJA = (3, 1, 6)
# The assistant's words in a probe conversation. stop_ids renders it to find what ends a turn.
PROBE = "picollama-probe-7f3a"
# What one rendering may take. A conversation of 8 MB renders in milliseconds. A template that
# loops for ever, or builds text without end, is stopped with a ChatTemplateError.
RENDER_SECONDS = 5.0
LONGEST_VALUE = 1 << 26  # the most characters or items a value a template makes may hold
OVERSIZED = f"it made a value of over {LONGEST_VALUE:,} characters or items"
# Conversations a template is tried on before a server or a chat uses it (check_renders). One
# must render. A template may refuse a system message (Gemma's) or want turns to alternate.
TRIALS = (("system", "user", "assistant", "user"), ("user", "assistant", "user"), ("user",))


class ChatTemplateError(UserError):
    """A chat template that cannot be read or compiled, or that refuses or fails on a conversation.
    One line names the cause, as an `error:` line or an HTTP 400."""


class _Refusal(jinja2.TemplateError):
    """What a template's raise_exception(message) raises."""


class _Overrun(jinja2.TemplateError):
    """A rendering past RENDER_SECONDS, or a value past LONGEST_VALUE."""


BUDGET = threading.local()  # Its deadline: when the rendering on this thread must end.


@contextmanager
def render_budget():
    """The renderings inside end within RENDER_SECONDS, or sooner where an outer budget ends."""
    outer = getattr(BUDGET, "deadline", math.inf)
    BUDGET.deadline = min(outer, time.monotonic() + RENDER_SECONDS)
    try:
        yield
    finally:
        BUDGET.deadline = outer


def load_chat_template(run_dir, override=None) -> str:
    """The chat template for a run. That is the file `override` (--chat-template FILE) if given,
    else the run's own, else DEFAULT_TEMPLATE. ChatTemplateError names a bad file."""
    if override is not None:
        try:
            template = read_small_text(override, "--chat-template")
        except UserError as e:
            raise ChatTemplateError(str(e)) from None
        check_reads_messages(template, f"--chat-template {override}")
        return template
    found = run_chat_template(run_dir)
    return DEFAULT_TEMPLATE if found is None else found


def check_reads_messages(template: str, where: str):
    """ChatTemplateError for a template that never reads `messages`. Every prompt would be the
    same text, such as a file given by mistake."""
    compiled(template)  # Its syntax error first.
    names = meta.find_undeclared_variables(environment().parse(template))
    if "messages" not in names:
        raise ChatTemplateError(f"{where} never reads `messages`, so it is not a chat template")


def run_chat_template(run_dir) -> str | None:
    """The run directory's own template from tokenizer_config.json, or None. It is a string, or
    the "default" one of transformers' list of {"name", "template"}."""
    path = Path(run_dir) / TOKENIZER_CONFIG
    found = read_tokenizer_config(path).get("chat_template")
    if found is None or isinstance(found, str):
        return found
    if isinstance(found, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in found
    ):
        found = {t["name"]: t.get("template") for t in found}
    if not isinstance(found, dict):
        raise ChatTemplateError(f"{path}: chat_template is {type(found).__name__}, not a template")
    if not isinstance(found.get("default"), str):
        names = ", ".join(sorted(map(str, found))) or "none"
        raise ChatTemplateError(
            f"{path}: no template named 'default' among its chat templates "
            f"({names}); pass one with --chat-template FILE"
        )
    return found["default"]


def read_tokenizer_config(path: Path) -> dict:
    """A tokenizer_config.json's object, or {} where there is no such file. ChatTemplateError if
    it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} is not a JSON object")
    return config


def write_default_template(run_dir, template: str = DEFAULT_TEMPLATE) -> bool:
    """Give a run directory with no chat template this `template`, and say whether it wrote.
    It goes atomically into tokenizer_config.json, kept or made."""
    path = Path(run_dir) / TOKENIZER_CONFIG
    if not Path(run_dir).is_dir():
        raise ChatTemplateError(f"{run_dir} is not a run directory")
    config = read_tokenizer_config(path)
    if config.get("chat_template") is not None:
        return False
    compiled(template)  # Never write a template that does not compile.
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps({**config, "chat_template": template}, indent=2) + "\n")
    return True


class _Generation(Extension):
    """transformers' {% generation %}…{% endgeneration %}, its assistant-token mask. Renders the
    body alone."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message):
    raise _Refusal(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson, plain json.dumps. Jinja's own escapes <, >, & and ' for HTML."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def checked(value):
    """value, once the rendering's time is checked and value's size: a text, list or mapping of
    at most LONGEST_VALUE characters or items."""
    if time.monotonic() > getattr(BUDGET, "deadline", math.inf):
        raise _Overrun(f"it ran over {RENDER_SECONDS:g} s")
    if isinstance(value, str | list | tuple | dict) and len(value) > LONGEST_VALUE:
        raise _Overrun(OVERSIZED)
    return value


def ticking(iterable):
    """A loop's items, the rendering's time checked at each (the filter every loop gets)."""
    for item in iterable:
        yield checked(item)


def bounded(function):
    """A filter whose result and time are checked (`checked`)."""

    @wraps(function)  # Keeps jinja's pass_context marks.
    def call(*args, **kwargs):
        return checked(function(*args, **kwargs))

    return call


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with bounds on time and size. Every call, attribute, item, +, *, **,
    filter and loop step checks the rendering's deadline and the size of what it makes (a text
    times a number is checked before it is made). Constant folding is off, so a template's
    constants are made when it renders, under these checks."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_ticking", [], [], None, None, lineno=loop.lineno)
        return tree

    def call(self, context, obj, /, *args, **kwargs):
        return checked(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        return checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return checked(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        sized = [x for x in (left, right) if isinstance(x, str | list | tuple)]
        times = [x for x in (left, right) if isinstance(x, int)]
        if operator == "*" and len(sized) == len(times) == 1:
            if len(sized[0]) * times[0] > LONGEST_VALUE:
                raise _Overrun(OVERSIZED)
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * abs(left).bit_length() > LONGEST_VALUE:
                raise _Overrun(f"it made a number of over {LONGEST_VALUE:,} bits")
        return checked(super().call_binop(context, operator, left, right))


@lru_cache(maxsize=1)
def environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment of transformers' apply_chat_template. Its sandbox hides attributes
    starting with _ and freezes the values a template gets. It has trim_blocks and lstrip_blocks,
    loop controls, {% generation %}, and the helpers templates call. Its renderings are bounded
    in time and size (_Sandbox)."""
    version = tuple(int(n) for n in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < SAFE_JINJA:
        raise ChatTemplateError(
            f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox escapes), not "
            f"{jinja2.__version__}: pip install -U jinja2"
        )
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, loopcontrols],
        optimized=False,
    )
    env.filters["tojson"] = tojson
    env.filters.update({name: bounded(f) for name, f in env.filters.items()}, _ticking=ticking)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


@lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    """A template compiled once. ChatTemplateError names the line of a syntax error."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template is text, not {type(template).__name__}")
    try:
        return environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template is not valid Jinja: line {e.lineno}: {e}"
        ) from None


def special_tokens(tokenizer) -> dict[str, str]:
    """The special tokens a template sees by name, such as bos_token. A tokenizer.json's come from
    tokenizer_config.json, as transformers reads them. A sentencepiece model's are its pieces."""
    if isinstance(tokenizer, HFTokenizer):
        found = {key: special_token(tokenizer.config, key) for key in SPECIAL_TOKEN_KEYS}
        return {key: str(token) for key, token in found.items() if token is not None}
    ids = dict(bos_token=tokenizer.bos_id(), eos_token=tokenizer.eos_id())
    ids |= dict(unk_token=tokenizer.unk_id(), pad_token=tokenizer.pad_id())
    return {key: tokenizer.id_to_piece(i) for key, i in ids.items() if i >= 0}


def render_chat(template: str, messages, tokenizer=None, add_generation_prompt=True, **extra):
    """The text of OpenAI-shaped messages ([{"role", "content"}, ...]) rendered by `template`.
    It matches transformers' apply_chat_template(tokenize=False). Keys whose value is None are
    dropped. The template gets the tokenizer's special tokens, tools and documents (None unless
    `extra` gives them), and `extra`, its own variables. ChatTemplateError says why it fails."""
    conversation = checked_messages(messages)
    names = {"tools": None, "documents": None}
    names |= {**(special_tokens(tokenizer) if tokenizer is not None else {}), **extra}
    program = compiled(template)
    try:
        with render_budget():
            return program.render(
                messages=conversation, add_generation_prompt=add_generation_prompt, **names
            )
    except _Refusal as e:
        raise ChatTemplateError(f"the chat template refuses this conversation: {e}") from None
    except _Overrun as e:
        raise ChatTemplateError(f"the chat template was stopped: {e}") from None
    except jinja2.TemplateError as e:  # Undefined names and sandbox refusals.
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except (RecursionError, MemoryError) as e:  # A macro calling itself, a value past memory.
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}") from None


def check_renders(template: str, where: str, tokenizer=None):
    """ChatTemplateError naming `where` unless the template renders one of TRIALS, ready for
    the reply. A server or chat checks this at start, so a template that fails on every
    conversation is said once, not blamed on each client."""
    failures = []
    with render_budget():  # One budget for all the trials.
        for roles in TRIALS:
            messages = [{"role": role, "content": f"a {role} message"} for role in roles]
            try:
                render_chat(template, messages, tokenizer)
                return
            except ChatTemplateError as e:
                failures.append(f"{', '.join(roles)}: {e}")
    raise ChatTemplateError(f"{where} cannot render a conversation ({failures[0]})")


def checked_messages(messages) -> list[dict]:
    """Copies of the messages as the template sees them: keys whose value is None dropped,
    reasoning under transformers' names. ChatTemplateError unless a non-empty list of objects
    with roles."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError("a conversation is a non-empty list of messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} is not an object with a string role")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        conversation.append(message)
    return conversation


# Names a message's reasoning comes under. Most templates read the first. gpt-oss's reads
# "thinking".
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def encode_chat(tokenizer, text: str) -> list[int]:
    """The token ids of a rendered conversation, as apply_chat_template(tokenize=True) makes them.
    Special tokens written in the text, such as BOS, EOS or <|im_end|>, become those tokens. BOS
    comes first where the tokenizer adds one, but never twice."""
    ids = encode_with_specials(tokenizer, text)
    start = prompt_start(tokenizer)
    return ids if ids[:1] == start else start + ids


def encode_with_specials(tokenizer, text: str) -> list[int]:
    """Token ids of text, with its special tokens matched whole. A tokenizer.json matches its own
    added tokens. A sentencepiece model would spell control pieces (<s>, </s>) letter by letter.
    So they are split out first, and each stretch between is encoded alone, as llama.cpp does."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(text)
    pattern, pieces = control_pieces(tokenizer)
    if pattern is None:
        return tokenizer.encode(text)
    ids = []
    for i, part in enumerate(pattern.split(text)):  # Odd parts are the control pieces.
        ids += [pieces[part]] if i % 2 else tokenizer.encode(part) if part else []
    return ids


@lru_cache(maxsize=8)
def control_pieces(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """(regex, {piece: id}) of a sentencepiece model's control pieces. The regex, None for none,
    splits them out longest first."""
    pieces = {
        tokenizer.id_to_piece(i): i
        for i in range(tokenizer.get_piece_size())
        if tokenizer.is_control(i) and tokenizer.id_to_piece(i)
    }
    if not pieces:
        return None, pieces
    alternatives = "|".join(map(re.escape, sorted(pieces, key=len, reverse=True)))
    return re.compile(f"({alternatives})"), pieces


def stop_ids(tokenizer, template: str) -> set[int]:
    """The token ids that end a reply: EOS, and the template's end of turn where that is one
    special token, such as ChatML's <|im_end|>. It is the first token after a rendered assistant
    message, spaces skipped."""
    stops = {tokenizer.eos_id()} if tokenizer.eos_id() >= 0 else set()
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
    try:
        text = render_chat(template, turn, tokenizer, add_generation_prompt=False)
    except ChatTemplateError:  # A template that wants other turns: EOS alone.
        return stops
    if PROBE not in text:
        return stops
    after = text.rsplit(PROBE, 1)[1].lstrip()
    first = encode_with_specials(tokenizer, after)[:1]
    return stops | {i for i in first if is_special(tokenizer, i)}


def is_special(tokenizer, i: int) -> bool:
    """Whether token i is special. In a tokenizer.json, it is an added token marked special. In a
    sentencepiece model, a control or user-defined piece, matched whole."""
    if isinstance(tokenizer, HFTokenizer):
        added = tokenizer.backend.get_added_tokens_decoder().get(i)
        return added is not None and added.special
    return tokenizer.is_control(i) or i in user_defined_ids(tokenizer)


@lru_cache(maxsize=8)
def user_defined_ids(tokenizer) -> frozenset[int]:
    """The ids of a sentencepiece model's user-defined pieces (its Python API cannot say)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto.FromString(tokenizer.serialized_model_proto())
    kind = pb.ModelProto.SentencePiece.USER_DEFINED
    return frozenset(i for i, piece in enumerate(proto.pieces) if piece.type == kind)
