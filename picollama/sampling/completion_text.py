"""A completion's text as its tokens arrive.

Tokens are decoded incrementally. Text that may begin a stop string is held back, and a stop
string is cut off. This module only turns tokens into text. It never samples."""

import re
from dataclasses import dataclass

from data.tokenizer import HFTokenizer
from picollama.sampling.rows import Token

# Prompt tokens decoded before the first new one, so a reply's leading space survives.
CONTEXT_TOKENS = 4
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_text(tokenizer, i: int) -> str:
    """The text of token i on its own, with its leading space kept.

    A sentencepiece ▁ becomes a space. A byte piece like <0x0A> becomes that byte, or U+FFFD
    where it is part of a character."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.id_to_piece(i)
    piece = tokenizer.id_to_piece(i)
    byte = BYTE_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte[1], 16)]).decode("utf-8", "replace")
    return "" if tokenizer.is_control(i) else piece.replace("\u2581", " ")


class Detokenizer:
    """New text as each token comes, the vLLM/TGI way.

    The ids from a prefix offset are decoded twice, without and with what is new. The
    difference is sent. A character whose bytes are still coming (a trailing U+FFFD) waits.
    `context` is the prompt's ids. Its last few are decoded first, which keeps a space a
    tokenizer drops at the start of a text."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] decode to text already sent.
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self.new_text(final=False)

    def new_text(self, final: bool) -> str:
        sent = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(sent) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent) :]

    def flush(self) -> str:
        """What is held at the end. A character whose bytes never all came is left out, so a
        text cut inside a character ends before it (its U+FFFDs dropped)."""
        return self.new_text(final=True).rstrip("\ufffd")


@dataclass
class Entry:
    """One token in a choice's logprobs.

    It holds the text it added, its log-probability and the likeliest alternatives
    [(text, logprob)]. The entries' texts join into the choice's text."""

    text: str
    logprob: float
    top: list[tuple[str, float]]
    start: int  # Where its text starts in the choice's text.

    @property
    def end(self) -> int:
        return self.start + len(self.text)


class ChoiceText:
    """One choice's text. Tokens go in, and (text safe to send, its logprob entries) come out.

    Text that could start a stop string is held back until it cannot. A stop string ends the
    choice (self.stopped) and is cut off with everything after it. With `strip`, the reply's
    leading whitespace is dropped. A chat reply's first token carries the space after
    "Assistant:"."""

    def __init__(self, tokenizer, context: list[int], stops=(), strip: bool = False):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer, context)
        self.stops = [s for s in stops if s]
        self.strip = strip
        self.text = ""  # Everything decoded and kept so far.
        self.sent = 0  # Characters of it sent.
        self.entries: list[Entry] = []  # Logprob entries not yet sent.
        self.stopped = False
        self.tokens = 0  # Tokens added.

    def add(self, token: Token) -> tuple[str, list[Entry]]:
        self.tokens += 1
        new = self.accept(self.detokenizer.add(token.id))
        if token.logprob is not None:
            top = [(token_text(self.tokenizer, i), lp) for i, lp in token.top]
            self.entries.append(Entry(new, token.logprob, top, len(self.text) - len(new)))
        return self.release()

    def finish(self) -> tuple[str, list[Entry]]:
        """The rest, at the end of the choice. Held text is sent, as no stop string followed."""
        if not self.stopped:
            tail = self.accept(self.detokenizer.flush())
            if self.entries and tail:
                self.entries[-1].text += tail
        return self.release(final=True)

    def accept(self, new: str) -> str:
        if self.strip and not self.text:
            new = new.lstrip()
        self.text += new
        return new

    def release(self, final: bool = False) -> tuple[str, list[Entry]]:
        """The text from self.sent to where it is safe, and the entries whose text ends there."""
        end = len(self.text)
        if not self.stopped:
            found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
            if found:
                end, self.stopped = min(found), True
                self.text = self.text[:end]
                # A token that ran into the stop string keeps what came before it.
                self.entries = [e for e in self.entries if e.start < end]
                for entry in self.entries:
                    entry.text = entry.text[: end - entry.start]
            elif not final:
                end -= held_back(self.text, self.stops)
        ready = 0
        while ready < len(self.entries) and self.entries[ready].end <= end:
            ready += 1
        if ready == len(self.entries) and ready and not self.entries[-1].text and not final:
            # The newest token's text may still come, as the detokenizer holds a character's
            # bytes. Its entry waits, so that finish() can give it the rest of its text.
            ready -= 1
        entries, self.entries = self.entries[:ready], self.entries[ready:]
        text, self.sent = self.text[self.sent : end], max(self.sent, end)
        return text, entries


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of text could begin a stop string, and so must wait."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
