"""Message content as text. A special token's text written in a message, such as <|im_end|>, is
encoded as plain text, never as that token. Only the template's own special tokens are special.
So a user cannot forge a turn. special_in_content=True (a switch for trusted inputs) keeps the
old way, where every special token's text in the rendering becomes that token."""

import re
from functools import lru_cache, partial

from data.tokenizer import HFTokenizer, prompt_start
from picollama.chat_template import (
    ChatTemplateError,
    control_pieces,
    encode_with_specials,
    render_chat,
)

# Unicode noncharacters, never real text. They wrap a special token's text in a message while the
# template renders, so that its place in the rendering is known.
OPEN, CLOSE = "\ufdd2", "\ufdd3"


@lru_cache(maxsize=8)
def special_pieces(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """(regex, {text: id}) of the special tokens a text may spell. The regex, None for none,
    splits them out longest first. In a tokenizer.json, the added tokens marked special. In a
    sentencepiece model, its control pieces."""
    if not isinstance(tokenizer, HFTokenizer):
        return control_pieces(tokenizer)
    added = tokenizer.backend.get_added_tokens_decoder().items()
    pieces = {token.content: i for i, token in added if token.special and token.content}
    if not pieces:
        return None, pieces
    alternatives = "|".join(map(re.escape, sorted(pieces, key=len, reverse=True)))
    return re.compile(f"({alternatives})"), pieces


@lru_cache(maxsize=8)
def plain_backend(tokenizer: HFTokenizer):
    """A copy of a tokenizer.json's backend that spells special tokens' text as plain text."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend.to_str())
    backend.encode_special_tokens = True
    return backend


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of text with no special token matched. A sentencepiece model never matches its
    control pieces."""
    if not text:
        return []
    if isinstance(tokenizer, HFTokenizer):
        return plain_backend(tokenizer).encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text)


def encode_text(tokenizer, text: str, plain=()) -> list[int]:
    """Token ids of text, its special tokens matched whole, but for those in the `plain`
    (start, end) spans, in order. Those are text. The text between the special tokens matched is
    encoded in one piece, so plain spans merge with the text around them."""
    pattern, pieces = special_pieces(tokenizer)
    if not plain or pattern is None:
        return encode_with_specials(tokenizer, text)
    ids, stretch, at = [], "", 0
    for start, end in [*plain, (len(text), len(text))]:
        for i, part in enumerate(pattern.split(text[at:start])):
            if i % 2:  # Odd parts are the template's special tokens.
                ids += encode_plain(tokenizer, stretch) + [pieces[part]]
                stretch = ""
            else:
                stretch += part
        stretch += text[start:end]
        at = end
    return ids + encode_plain(tokenizer, stretch)


def clipped(plain, start: int, end: int) -> list[tuple[int, int]]:
    """The plain spans within text[start:end], counted from start."""
    spans = ((max(a, start) - start, min(b, end) - start) for a, b in plain)
    return [(a, b) for a, b in spans if a < b]


def encode_content_chat(tokenizer, text: str, plain=()) -> list[int]:
    """encode_chat's ids of a rendered conversation, with the `plain` spans as text."""
    ids = encode_text(tokenizer, text, plain)
    start = prompt_start(tokenizer)
    return ids if ids[:1] == start else start + ids


def chat_ids(
    tokenizer, template: str, messages, special_in_content=False, tools=None
) -> tuple[str, list]:
    """(text, ids): the conversation rendered for an answer and its token ids. Special tokens'
    text in the messages (and tools) is plain text unless special_in_content. tools: the
    template's `tools` (OpenAI's [{"type": "function", "function": {...}}]), or None."""
    text, plain = render_content(template, messages, tokenizer, True, special_in_content, tools)
    return text, encode_content_chat(tokenizer, text, plain)


def render_content(
    template: str,
    messages,
    tokenizer,
    add_generation_prompt=True,
    special_in_content=False,
    tools=None,
) -> tuple[str, list[tuple[int, int]]]:
    """(text, plain): render_chat's text, and the (start, end) of each special token's text that
    a message (or a tool) wrote into it. They are rendered again with each such text marked. A
    template that changes the marked text makes a ChatTemplateError, never a forged token."""
    text = render_chat(template, messages, tokenizer, add_generation_prompt, tools=tools)
    pattern = None if special_in_content else special_pieces(tokenizer)[0]
    if pattern is None or not holds([*messages, tools], pattern):
        return text, []
    marked = [marked_message(message, pattern) for message in messages]
    again = partial(render_chat, template, marked, tokenizer, add_generation_prompt)
    try:
        found, plain = unmarked(again(tools=marked_message(tools, pattern)))
    except ChatTemplateError:
        found, plain = None, []
    if found != text:
        raise ChatTemplateError(
            "a message holds a special token's text (such as <|im_end|>), which is plain text, "
            "and this chat template changes it as it renders, so it cannot be kept as text; "
            "remove it from the message"
        )
    return text, plain


def holds(value, pattern: re.Pattern) -> bool:
    """Whether a message's strings, its role aside, hold a special token's text."""
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(holds(v, pattern) for k, v in value.items() if k != "role")
    return isinstance(value, list | tuple) and any(holds(v, pattern) for v in value)


def marked_message(value, pattern: re.Pattern):
    """A message with each special token's text in its strings, its role aside, marked."""
    if isinstance(value, str):
        return pattern.sub(lambda m: OPEN + m.group(0) + CLOSE, value)
    if isinstance(value, dict):
        return {k: v if k == "role" else marked_message(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [marked_message(v, pattern) for v in value]
    return value


def marked_spans(marked: str, open_mark: str, close_mark: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without its marks, and the (start, end) of each marked part. ValueError for marks
    out of order (nested, or one left open)."""
    parts, spans, start, size = [], [], None, 0
    for part in re.split(f"([{open_mark}{close_mark}])", marked):
        if part in (open_mark, close_mark) and (part == open_mark) != (start is None):
            raise ValueError("marks out of order")
        if part == open_mark:
            start = size
        elif part == close_mark:
            spans.append((start, size))
            start = None
        else:
            parts.append(part)
            size += len(part)
    if start is not None:
        raise ValueError("a mark left open")
    return "".join(parts), spans


def unmarked(marked: str) -> tuple[str | None, list[tuple[int, int]]]:
    """marked_spans with this module's marks. None for marks out of order."""
    try:
        return marked_spans(marked, OPEN, CLOSE)
    except ValueError:
        return None, []
