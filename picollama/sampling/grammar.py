"""Grammar-constrained rows: an answer that must be JSON following a schema, token by token.

llguidance (the library llama.cpp and vLLM use) compiles a JSON schema into a matcher. After each
token it says which tokens may come next. A Constraint is one row's matcher. The one Sampler
(sampler.py) masks the row's logits with it and vets each token chosen. The hand-over (rows.py)
feeds it the token taken. It also keeps the answer able to end within the row's max_new_tokens:
no token is taken that leaves no way to close the JSON in the tokens left (`closing`). It needs a
Hugging Face tokenizer.json. Nothing here runs the model or knows about HTTP.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from data.tokenizer import HFTokenizer

# Whitespace between JSON's tokens: bounded, so a model cannot fill its answer with it.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
# The longest way to end an answer that is looked for (tokens). A token after which none is found
# within it is not taken, so the search stays short however many tokens are left.
LONGEST_CLOSE = 512
# Tokens that are whole short values, in the order the shortest way to close tries them.
SHORT_VALUES = (b'""', b"0", b"{}", b"[]", b"null", b"true", b"false")


class GrammarError(ValueError):
    """A schema llguidance cannot compile, or a tokenizer it cannot read. The message says
    which."""


class TooFewTokens(GrammarError):
    """The shortest answer found takes more tokens than a row may add."""


def json_grammar(schema: dict) -> str:
    """llguidance's grammar for JSON that follows `schema` ({}: any JSON value)."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_pattern": WHITESPACE}
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the schema cannot be compiled: {e}") from None


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A tokenizer as llguidance reads it: its LLTokenizer, the ids that end an answer (stops),
    each token's bytes, the id of each byte string that is one token (`ids`), and `order`: the
    ids `closing` tries when nothing closes, best first (closing_rank)."""

    tokenizer: object
    stops: tuple[int, ...]
    pieces: tuple[bytes, ...]
    ids: dict[bytes, int]
    order: np.ndarray

    @property
    def size(self) -> int:
        return self.tokenizer.vocab_size


@lru_cache(maxsize=4)
def vocabulary(tokenizer, stops: frozenset[int]) -> Vocabulary:
    """The Vocabulary of a tokenizer.json whose answers end at `stops`. Made once: it reads
    every token. GrammarError for a sentencepiece model or no stop."""
    from llguidance import LLTokenizer

    if not isinstance(tokenizer, HFTokenizer):
        raise GrammarError(
            "structured output needs a Hugging Face tokenizer.json, and this run has a "
            "sentencepiece model"
        )
    if not stops:
        raise GrammarError("structured output needs a token that ends an answer, and there is none")
    size = tokenizer.get_piece_size()
    guide = LLTokenizer(tokenizer.backend.to_str(), n_vocab=size, eos_token=sorted(stops))
    pieces = tuple(guide.decode_bytes([i]) for i in range(size))
    plain = [i for i in range(size) if not guide.is_special_token(i) and pieces[i].strip()]
    ids = {}
    for i in plain:
        ids.setdefault(pieces[i], i)
    order = np.array([i for _, i in sorted((closing_rank(pieces[i]), i) for i in plain)])
    return Vocabulary(guide, tuple(sorted(stops)), pieces, ids, order)


def closing_rank(piece: bytes) -> tuple:
    """Where a token comes in the order `closing` tries tokens that close nothing: whole short
    values first ("" 0 {} [] null ...), then those opening fewer strings, objects and arrays,
    holding less whitespace, shorter. Special tokens and whitespace alone are never tried."""
    if piece in SHORT_VALUES:
        return (0, SHORT_VALUES.index(piece))
    opens = sum(piece.count(c) for c in b'"{[')
    spaces = sum(piece.count(c) for c in b" \n\r\t")
    return (1, opens, spaces, len(piece))


class Nesting:
    """Where a JSON text's prefix stands: inside a string or not, and the objects and arrays it
    left open. `closes` is what would close them all, such as '"}]'."""

    def __init__(self, open_marks: bytes = b"", in_string: bool = False, escaped: bool = False):
        self.open_marks, self.in_string, self.escaped = open_marks, in_string, escaped

    def copy(self) -> "Nesting":
        return Nesting(self.open_marks, self.in_string, self.escaped)

    def feed(self, text: bytes):
        for byte in text:
            mark = bytes([byte])
            if self.in_string:
                self.in_string = self.escaped or mark != b'"'
                self.escaped = not self.escaped and mark == b"\\"
            elif mark == b'"':
                self.in_string = True
            elif mark in (b"{", b"["):
                self.open_marks += mark
            elif mark in (b"}", b"]"):
                self.open_marks = self.open_marks[:-1]

    @property
    def closes(self) -> bytes:
        ends = bytes(reversed(self.open_marks)).replace(b"{", b"}").replace(b"[", b"]")
        return (b'"' if self.in_string else b"") + ends


def mask_of(matcher, size: int) -> np.ndarray:
    """The tokens the matcher allows next, as booleans over the vocabulary."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:size].astype(bool)


def next_closer(matcher, vocab: Vocabulary, nesting: Nesting, used=frozenset()) -> int | None:
    """The token `closing` takes next. It is the first the grammar forces. Else it is the longest
    allowed that starts closing what is open (`"}` before `"`). Else it is the first allowed in
    vocab.order, one not `used` where there is one. None if none is allowed."""
    forced = matcher.compute_ff_tokens()
    if forced:
        return forced[0]
    allowed = mask_of(matcher, vocab.size)
    closes = nesting.closes
    for end in range(len(closes), 0, -1):
        token = vocab.ids.get(closes[:end])
        if token is not None and allowed[token]:
            return token
    ordered = allowed[vocab.order]
    if used:
        fresh = ordered & ~np.isin(vocab.order, list(used))
        ordered = fresh if fresh.any() else ordered
    first = int(ordered.argmax())
    return int(vocab.order[first]) if ordered[first] else None


def closing(
    matcher, vocab: Vocabulary, nesting: Nesting, limit: int, failures: list | None = None
) -> list[int] | None:
    """A short way to end the answer from the matcher's state: the tokens up to where the
    grammar accepts (a stop may come), chosen greedily by next_closer. Where that finds none
    within `limit` tokens, it is tried again preferring tokens not yet taken: `^a*b$` spells
    "a", "a", ... the first time and "a", "b" the second. None if neither finds one, and then
    `failures` gets what llguidance said if it failed on the way. The matcher and nesting are
    copied, never moved."""
    if matcher.is_accepting():
        return []
    for novel in (False, True):
        copy, ends, path = matcher.deep_copy(), nesting.copy(), []
        while not copy.is_accepting():
            used = frozenset(path) if novel else frozenset()
            token = next_closer(copy, vocab, ends, used) if len(path) < limit else None
            if token is None or not copy.consume_token(token):
                if failures is not None and copy.is_error():
                    failures.append(first_line(copy.get_error()))
                break
            ends.feed(vocab.pieces[token])
            path.append(token)
        else:
            return path
    return None


def first_line(error: str) -> str:
    """llguidance's error message without the parser state it dumps after it."""
    return error.strip().splitlines()[0] if error.strip() else "an unknown error"


class Constraint:
    """One row's grammar as it decodes: what it may take next, and the tokens left to end in.

    budget: the tokens the answer may take. A stop comes after them, so a row of max_new_tokens
    gets max_new_tokens - 1. The Sampler calls allowed(), fits() and closer(). The hand-over
    calls take(). GrammarError if the grammar is bad, its first mask and way to end included
    (llguidance compiled `"pattern": "^a{1000000}$"` and failed on its first token), or if no way
    to end is found within LONGEST_CLOSE tokens (a minLength of 100,000, a schema that requires
    itself). TooFewTokens if the shortest answer found is longer
    than the budget. Where an unvetted token leaves no way to end found, the mask still holds
    but the end is not guarded: `guarded` is False. Should the matcher fail mid-answer, `error`
    says why and only a stop is allowed: the row ends, and its caller must report the error.
    """

    def __init__(self, vocab: Vocabulary, grammar: str, budget: int):
        from llguidance import LLMatcher

        self.vocab, self.left, self.nesting = vocab, budget, Nesting()
        self.matcher = LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if not self.matcher.is_error():
            mask_of(self.matcher, vocab.size)  # Where some of llguidance's limits first show.
        if self.error:
            raise GrammarError(f"the schema cannot be compiled: {self.error}")
        failures = []
        self.path = closing(self.matcher, vocab, self.nesting, LONGEST_CLOSE, failures)
        self.guarded = True
        if self.path is None and failures:
            raise GrammarError(f"the schema cannot be compiled: {failures[0]}")
        if self.path is None:
            raise GrammarError(
                f"no answer that follows the schema was found within {LONGEST_CLOSE} tokens"
            )
        if len(self.path) > budget:
            raise TooFewTokens(
                f"too few tokens: the shortest answer found takes {len(self.path) + 1} (its end "
                f"included), and {budget + 1} are allowed"
            )
        self.tried: dict[int, list[int]] = {}  # tokens fits() passed: their ways to end

    @property
    def error(self) -> str | None:
        """Why the matcher failed (its first line), or None while it has not."""
        return first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def allowed(self) -> torch.Tensor:
        """A boolean per token of the vocabulary: those that may come next. Once the matcher
        has failed, the stops alone."""
        if self.error or (self.guarded and self.left == 0):
            allowed = np.zeros(self.vocab.size, dtype=bool)
            allowed[list(self.vocab.stops)] = self.matcher.is_accepting() or bool(self.error)
        else:
            allowed = mask_of(self.matcher, self.vocab.size)
        return torch.from_numpy(allowed)

    def fits(self, token: int) -> bool:
        """Whether the answer can still end in the tokens left once `token` is taken."""
        if token in self.vocab.stops:
            return self.matcher.is_accepting() or bool(self.error)
        if self.error:
            return False
        if not self.guarded:
            return True
        if self.left < 1:
            return False
        if self.path and token == self.path[0]:
            path = self.path[1:]
        else:
            copy, nesting = self.matcher.deep_copy(), self.nesting.copy()
            nesting.feed(self.vocab.pieces[token])
            taken = copy.consume_token(token)
            limit = min(self.left - 1, LONGEST_CLOSE)
            path = closing(copy, self.vocab, nesting, limit) if taken else None
        if path is not None:
            self.tried[token] = path
        return path is not None

    def closer(self) -> int:
        """A token that fits where the end is guarded: the next on the way to end, or a stop."""
        return self.path[0] if self.path and not self.error else self.vocab.stops[0]

    def take(self, token: int):
        """The row took `token`: the matcher moves on, and one token fewer is left."""
        if token in self.vocab.stops:
            return
        path = self.tried.get(token)
        if path is None and self.path and token == self.path[0]:
            path = self.path[1:]
        self.matcher.consume_token(token)
        self.nesting.feed(self.vocab.pieces[token])
        self.left -= 1
        self.tried = {}
        if path is None and self.guarded:  # not vetted: find the way to end again
            path = closing(self.matcher, self.vocab, self.nesting, min(self.left, LONGEST_CLOSE))
            self.guarded = path is not None
        self.path = path
