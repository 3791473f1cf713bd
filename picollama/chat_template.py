"""Chat templates: a conversation rendered with the model's own Jinja template, as transformers
does. Also its encoding, and the tokens that end a reply."""

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import meta
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


class ChatTemplateError(UserError):
    """A chat template that cannot be read or compiled, or that refuses or fails on a conversation.
    One line names the cause, as an `error:` line or an HTTP 400."""


class _Refusal(jinja2.TemplateError):
    """What a template's raise_exception(message) raises."""


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


@lru_cache(maxsize=1)
def environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment of transformers' apply_chat_template. Its sandbox hides attributes
    starting with _ and freezes the values a template gets. It has trim_blocks and lstrip_blocks,
    loop controls, {% generation %}, and the helpers templates call."""
    version = tuple(int(n) for n in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < SAFE_JINJA:
        raise ChatTemplateError(
            f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox escapes), not "
            f"{jinja2.__version__}: pip install -U jinja2"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
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
    dropped. The template gets the tokenizer's special tokens, tools and documents as None, and
    `extra`, its own variables. ChatTemplateError says why it fails."""
    conversation = checked_messages(messages)
    names = {**(special_tokens(tokenizer) if tokenizer is not None else {}), **extra}
    program = compiled(template)
    try:
        return program.render(
            messages=conversation,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **names,
        )
    except _Refusal as e:
        raise ChatTemplateError(f"the chat template refuses this conversation: {e}") from None
    except jinja2.TemplateError as e:  # Undefined names and sandbox refusals.
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


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
