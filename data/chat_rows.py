"""One conversation as token ids, with a loss mask over its replies. The mask is checked against
the whole text's tokens."""

import re
from bisect import bisect_left, bisect_right
from functools import lru_cache
from itertools import accumulate

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension

from data.tokenizer import HFTokenizer, prompt_start
from picollama.chat_content import (
    clipped,
    encode_content_chat,
    encode_text,
    marked_spans,
    render_content,
)
from picollama.chat_template import (
    ChatTemplateError,
    checked_messages,
    control_pieces,
    encode_with_specials,
    environment,
    render_chat,
    special_tokens,
    stop_ids,
)

# Unicode noncharacters, never real text. They wrap a {% generation %} block's output in rendering.
OPEN, CLOSE = "\ufdd0", "\ufdd1"
GENERATION_TAG = re.compile(r"{%[-+]?\s*generation\s*[-+]?%}")


def conversation_ids(
    tokenizer, template: str, messages, special_in_content=False
) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation of OpenAI-shaped messages. ids are encode_chat's for its
    rendering by `template`. mask is 1 on each token the loss trains, the replies but those marked
    "train": false. ChatTemplateError says why not. Special tokens' text in a message is plain
    text, unless special_in_content (chat_content)."""
    _, ids, mask = encoded_conversation(tokenizer, template, messages, special_in_content)
    return ids, mask


def encoded_conversation(
    tokenizer, template: str, messages, special_in_content=False, keep=None
) -> tuple[str, list[int], list[int]]:
    """(text, ids, mask): the rendered conversation and conversation_ids' answer, cut to its first
    `keep` tokens where that is given (the text to what they spell, kept_text).

    A template's {% generation %} blocks mark the replies where it has them, as transformers'
    return_assistant_tokens_mask reads them. Else replies are found by prefixes (reply_spans). A
    reply runs up to its end-of-turn token. The tokens are those of the whole text (masked_ids).
    The first `keep` tokens and their mask are those of the whole conversation. Replies past them
    are not looked for, so the work on a conversation of many turns grows with `keep`."""
    if not isinstance(messages, list | tuple):
        checked_messages(messages)  # Raises its error.
    trained = [trains(message) for message in messages]
    shown = [drop_train(message) for message in messages]
    _, plain = render_content(template, shown, tokenizer, False, special_in_content)
    if GENERATION_TAG.search(template):
        text, spans = generation_spans(tokenizer, template, shown, trained)
        ends, whole = frozenset(), None
    else:
        text = render_chat(template, shown, tokenizer, add_generation_prompt=False)
        whole = encode_content_chat(tokenizer, text, plain)
        long = keep is not None and len(whole) > keep
        cut = Cut(tokenizer, text, whole, keep, plain) if long else None
        spans = reply_spans(tokenizer, template, shown, trained, text, cut)
        ends = turn_ends(tokenizer, template)
    ids, mask = masked_ids(tokenizer, text, spans, ends, plain, whole)
    if keep is None or len(ids) <= keep:
        return text, ids, mask
    return kept_text(tokenizer, text, keep), ids[:keep], mask[:keep]


def kept_text(tokenizer, text: str, keep: int) -> str:
    """The text the first `keep` tokens spell, by the tokenizer's character offsets (the whole
    text where it gives none). Its bytes are the dataset's bytes of a conversation cut there."""
    found = offset_ids(tokenizer, text)
    return text if found is None or len(found[1]) < keep else text[: found[1][keep - 1][1]]


def trains(message) -> bool:
    """Whether the loss trains a message: an assistant's, unless it says "train": false."""
    is_reply = isinstance(message, dict) and message.get("role") == "assistant"
    return is_reply and message.get("train") is not False


def drop_train(message):
    """A message as the template sees it: without its "train" flag."""
    if not isinstance(message, dict):
        return message
    return {key: value for key, value in message.items() if key != "train"}


class Cut:
    """Where reply_spans stops: at the first reply with no token among the first `keep` of the
    whole conversation's tokens (`whole`). Each later one has none either."""

    def __init__(self, tokenizer, text: str, whole: list, keep: int, plain=()):
        self.tokenizer, self.text, self.keep, self.plain = tokenizer, text, keep, plain
        # Past the last character of the first `keep` tokens, by the tokenizer's offsets, where
        # it gives them for these tokens. A reply starting there overlaps none of them.
        found = None if plain else offset_ids(tokenizer, text)
        self.at = max(end for _, end in found[1][:keep]) if found and found[0] == whole else None

    def passed(self, spans: list, start: int) -> bool:
        """Whether a reply starting at character `start` has no token among the first `keep`.
        Without offsets, text[:start] must hold `keep` tokens as piecewise_ids encodes it (cut at
        the spans' edges, BOS first): its tokens are then the whole's. A token holds a byte of
        text at least, and a character 4 bytes at most, so text short of that is not encoded. A
        normalization that grows the text would only make it stop later. Encoding the text again
        at each reply costs what rendering it does."""
        if self.at is not None:
            return start >= self.at
        if 4 * start + 2 * len(spans) + 2 < self.keep:
            return False
        plain = clipped(self.plain, 0, start)
        ids, _ = piecewise_ids(self.tokenizer, self.text[:start], spans, frozenset(), plain)
        return len(ids) >= self.keep


def reply_spans(
    tokenizer, template: str, messages: list, trained: list[bool], text: str, cut=None
) -> list:
    """The (start, end) characters of each trained reply in `text`, the whole conversation
    rendered. Take assistant message k. The messages before it, rendered with the generation
    prompt, must start the rendering through k. That must start the whole. The difference is the
    reply. Else a ChatTemplateError says "not prefix-stable". Replies from the `cut` on are left
    out, and so are the checks of their prefixes."""
    spans = []
    for k in (i for i, train in enumerate(trained) if train):
        if k == 0:
            raise ChatTemplateError(
                'messages[0] is a reply, which nothing prompts; mark it "train": false'
            )
        prompt = render_chat(template, messages[:k], tokenizer, add_generation_prompt=True)
        if cut is not None and cut.passed(spans, len(prompt)):
            break
        upto = render_chat(template, messages[: k + 1], tokenizer, add_generation_prompt=False)
        stable = upto.startswith(prompt) and text.startswith(upto)
        if not stable or spans and len(prompt) < spans[-1][1]:
            raise ChatTemplateError(
                f"template not prefix-stable: the messages before messages[{k}], rendered with "
                "the generation prompt, do not start the conversation rendered through that reply "
                "(or that does not start the whole), so the reply cannot be told apart; mark "
                "replies with {% generation %} tags in the template (tokenizer_config.json)"
            )
        spans.append((len(prompt), len(upto)))
    return spans


def generation_spans(tokenizer, template: str, messages: list, trained: list[bool]) -> tuple:
    """(text, spans): the conversation rendered, and the (start, end) characters of each
    {% generation %} block's output. Replies marked "train": false are left out. Blocks match the
    assistant messages in order, so there must then be one each."""
    text = render_chat(template, messages, tokenizer, add_generation_prompt=False)  # Or its error.
    marked = marked_template(template).render(
        messages=checked_messages(messages),
        tools=None,
        documents=None,
        add_generation_prompt=False,
        **special_tokens(tokenizer),
    )
    plain, spans = block_spans(marked)
    if plain != text:
        raise ChatTemplateError("the template's {% generation %} blocks change what it writes")
    replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if all(trained[i] for i in replies):
        return text, spans
    if len(spans) != len(replies):
        raise ChatTemplateError(
            f'"train": false needs one {{% generation %}} block per reply; the template renders '
            f"{len(spans)} for {len(replies)} replies"
        )
    return text, [span for span, i in zip(spans, replies) if trained[i]]


def block_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without the {% generation %} marks, and the (start, end) of each marked part."""
    try:
        return marked_spans(marked, OPEN, CLOSE)
    except ValueError:
        raise ChatTemplateError(
            "{% generation %} blocks nest, or a message holds U+FDD0 or U+FDD1"
        ) from None


class _Marked(Extension):
    """{% generation %}…{% endgeneration %}: the body's output between OPEN and CLOSE."""

    tags = {"generation"}
    priority = 200  # After chat_template's _Generation, so this takes over its tag.

    def parse(self, parser):
        """The block's body, as a call of _mark."""
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(line)

    def _mark(self, caller):
        """The body's output, marked."""
        return OPEN + caller() + CLOSE


@lru_cache(maxsize=4)
def marked_template(template: str) -> jinja2.Template:
    """The template compiled in chat_template's environment, with its generation blocks marked.
    It compiles, since render_chat compiled it first."""
    return environment().overlay(extensions=[_Marked]).from_string(template)


@lru_cache(maxsize=8)
def turn_ends(tokenizer, template: str) -> frozenset[int]:
    """The tokens that end a reply (chat_template.stop_ids: EOS, ChatML's <|im_end|>, …)."""
    return frozenset(stop_ids(tokenizer, template))


def masked_ids(
    tokenizer, text: str, spans: list, ends: frozenset, plain=(), whole=None
) -> tuple[list, list]:
    """(ids, mask): the tokens encode_chat gives the text, and a mask of 1 on a span's tokens up
    to its last token in `ends`, if any. What follows a turn's end, such as ChatML's newline, is
    never generated. The text is encoded piece by piece, cut at span edges, where that gives the
    whole's tokens. A reply's tokens are then those a model writes after its prompt. Else the mask
    covers the whole's tokens that overlap a span (overlap_mask), as transformers does.
    ChatTemplateError when the tokenizer gives no offsets. The `plain` spans are text. `whole`:
    the text's tokens where the caller has them already."""
    whole = whole or encode_content_chat(tokenizer, text, plain)
    ids, mask = piecewise_ids(tokenizer, text, spans, ends, plain)
    if ids == whole:
        return ids, mask
    found = None if plain else offset_ids(tokenizer, text)
    if found is None or found[0] != whole:
        raise ChatTemplateError(
            f"the tokenizer merges across a reply's edge ({merged_edge(tokenizer, text, spans)}) "
            "and gives no character offsets: a reply spelled alone is not its tokens inside the "
            "conversation, so they cannot be told apart (a reply that starts with spaces or "
            "newlines often does this)"
        )
    return whole, overlap_mask(whole, found[1], spans, ends)


def piecewise_ids(tokenizer, text: str, spans: list, ends: frozenset, plain=()) -> tuple:
    """(ids, mask) of the text encoded piece by piece, cut at each span's edges. BOS comes first
    where the tokenizer adds one. mask is 1 on a span's tokens up to its last token in `ends`."""
    ids, mask, cut = [], [], 0
    for start, end in spans:
        context = encode_text(tokenizer, text[cut:start], clipped(plain, cut, start))
        reply = encode_text(tokenizer, text[start:end], clipped(plain, start, end))
        last = max((i + 1 for i, token in enumerate(reply) if token in ends), default=len(reply))
        ids += context + reply
        mask += [0] * len(context) + [1] * last + [0] * (len(reply) - last)
        cut = end
    rest = encode_text(tokenizer, text[cut:], clipped(plain, cut, len(text)))
    ids, mask = ids + rest, mask + [0] * len(rest)
    start = prompt_start(tokenizer)
    if start and ids[:1] != start:
        ids, mask = start + ids, [0] + mask
    return ids, mask


def overlap_mask(ids: list, offsets: list, spans: list, ends: frozenset) -> list[int]:
    """Mask 1 on each token whose characters overlap a span, as transformers'
    return_assistant_tokens_mask marks them. Spans and offsets are both in order. A span's tokens
    after its last token in `ends` get 0."""
    owners, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        owners.append(k if k < len(spans) and end > spans[k][0] else -1)
    last_end = {owner: i for i, owner in enumerate(owners) if owner >= 0 and ids[i] in ends}
    return [int(o >= 0 and i <= last_end.get(o, i)) for i, o in enumerate(owners)]


def offset_ids(tokenizer, text: str) -> tuple[list, list] | None:
    """(ids, offsets): the tokens encode_chat gives the text, each with its (start, end)
    characters. An added BOS gets (0, 0). None for a tokenizer that cannot say."""
    from sentencepiece import SentencePieceProcessor

    if isinstance(tokenizer, HFTokenizer):  # Added tokens too, at their text's offsets.
        encoding = tokenizer.backend.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, [tuple(offset) for offset in encoding.offsets]
    elif isinstance(tokenizer, SentencePieceProcessor):
        ids, offsets = sentencepiece_offsets(tokenizer, text)
    else:
        return None
    start = prompt_start(tokenizer)
    if ids[:1] == start:
        return ids, offsets
    return start + ids, [(0, 0)] * len(start) + offsets


def sentencepiece_offsets(tokenizer, text: str) -> tuple[list, list]:
    """encode_with_specials' ids of the text and their character offsets. Control pieces are split
    out, each over its own characters. The parts between are encoded apart, offsets shifted."""
    pattern, pieces = control_pieces(tokenizer)
    ids, offsets, at = [], [], 0
    for i, part in enumerate(pattern.split(text) if pattern else [text]):
        if i % 2:  # A control piece.
            ids.append(pieces[part])
            offsets.append((at, at + len(part)))
        elif part:
            for token, start, end in part_offsets(tokenizer, part):
                ids.append(token)
                offsets.append((at + start, at + end))
        at += len(part)
    return ids, offsets


def part_offsets(tokenizer, text: str) -> list[tuple[int, int, int]]:
    """(id, start, end) in characters of each token sentencepiece encodes the text into. Its byte
    counts are mapped to characters. A dummy prefix is (0, 0). A character's fallback bytes but
    its last are empty."""
    from sentencepiece.sentencepiece_pb2 import SentencePieceText

    found = SentencePieceText.FromString(tokenizer.encode(text, out_type="serialized_proto"))
    starts = list(accumulate((len(c.encode()) for c in text), initial=0))  # Each char's first byte.
    return [
        (piece.id, bisect_right(starts, piece.begin) - 1, bisect_left(starts, piece.end))
        for piece in found.pieces
    ]


def merged_edge(tokenizer, text: str, spans: list) -> str:
    """The text around the first reply edge whose two sides, encoded apart, are not the whole's
    tokens: 'before' | 'after'."""
    whole = encode_with_specials(tokenizer, text)
    for edge in sorted({edge for span in spans for edge in span}):
        apart = encode_with_specials(tokenizer, text[:edge]) + encode_with_specials(
            tokenizer, text[edge:]
        )
        if apart != whole:
            return f"{text[max(edge - 16, 0) : edge]!r} | {text[edge : edge + 16]!r}"
    return "where the tokenizer adds a space before each text"
