"""The model a server answers with: requests made into rows of tokens, checked against context.

A chat's tools are rendered here (tools.conversation), and a row whose answer must follow a JSON
schema (response_format, a required tool call) gets its grammar (sampling/grammar.py)."""

import json
import time
from functools import cached_property

from picollama.chat_content import chat_ids
from picollama.chat_template import ChatTemplateError, stop_ids
from picollama.cli import UserError
from picollama.sampling.completion_text import ChoiceText
from picollama.sampling.grammar import (
    Constraint,
    GrammarError,
    TooFewTokens,
    json_grammar,
    vocabulary,
)
from picollama.sampling.memory import check_memory
from picollama.sampling.prompts import encode_prompt
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampling
from picollama.serve.protocol import SEEDS, Ask, bad
from picollama.serve.tools import answer_schema, conversation

DEFAULT_TEXT_TOKENS = 16  # OpenAI's default max_tokens for a (legacy) completion


class ServedModel:
    """A loaded model, its tokenizer and chat template, under the name clients call it by; `free`:
    the bytes of memory beside its weights (None: unknown). `engine` is set by the server.
    special_in_content: special tokens' text in messages becomes those tokens (trusted inputs)."""

    def __init__(self, model, tokenizer, template: str, name: str, free: int | None = None):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.special_in_content = False
        self.name, self.free = name, free
        self.context = model.args.max_seq_len
        self.created = int(time.time())
        eos = tokenizer.eos_id()
        self.text_stops = frozenset({eos} if eos >= 0 else ())
        self.chat_stops = frozenset(stop_ids(tokenizer, template))
        pieces = tokenizer.get_piece_size()
        self.vocab_limit = pieces if pieces < model.args.vocab_size else None
        self.engine = None

    def card(self) -> dict:
        """The model as /v1/models lists it."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "picollama",
            "context_length": self.context,
        }

    @cached_property
    def longest_piece(self) -> int:
        """The most characters one token spells."""
        pieces = range(self.tokenizer.get_piece_size())
        return max(len(self.tokenizer.id_to_piece(i)) for i in pieces)

    def rows(self, ask: Ask) -> tuple[list[Row], list[ChoiceText], int]:
        """(the rows to decode, n a prompt, in the order of the choices' indexes; their texts; the
        prompt tokens), or ApiError: a prompt past the context, max_tokens past what is left of it,
        more memory than the machine has."""
        chat = ask.kind == "chat"
        if chat:
            prompts = [self.chat_prompt(ask.messages, ask)]
        else:
            prompts = [self.text_prompt(p) for p in ask.prompts]
        param = "messages" if chat else "prompt"
        news = [self.new_tokens(len(prompt), ask, param) for prompt in prompts]
        grammar = self.grammar(ask) if chat else None
        rows, texts = [], []
        for prompt, new in zip(prompts, news):
            for _ in range(ask.n):
                seed = None if ask.seed is None else (ask.seed + len(rows)) % SEEDS
                constraint = self.constraint(grammar, new, ask) if grammar else None
                sampling = Sampling(new, ask.temperature, ask.top_k, ask.top_p, seed, constraint)
                stops = self.chat_stops if chat else self.text_stops
                rows.append(Row(prompt, sampling, stops, ask.logprobs))
                texts.append(ChoiceText(self.tokenizer, prompt, ask.stop, strip=chat))
        if not self.fits(rows):
            raise bad(
                "this request needs more memory than the server has left: "
                "ask for fewer max_tokens or choices",
                "max_tokens",
            )
        return rows, texts, sum(map(len, prompts))

    def too_long(self, tokens: int | None, param: str):
        said = "more than that" if tokens is None else f"{tokens:,} tokens"
        return bad(
            f"This model's maximum context length is {self.context:,} tokens; your {param} "
            f"resulted in {said}. Please shorten it.",
            param,
            "context_length_exceeded",
        )

    def check_characters(self, text_length: int, param: str):
        """A text too long to fit even at the longest piece a token: refused before encoding."""
        if text_length > self.context * self.longest_piece:
            raise self.too_long(None, param)

    def chat_prompt(self, messages: list[dict], ask: Ask | None = None) -> list[int]:
        """A chat's prompt: the messages rendered and encoded. Given the request they are from,
        with the tools it offers (tools.conversation)."""
        messages, tools = (messages, None) if ask is None else conversation(ask, self.template)
        texts = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or []))
        self.check_characters(texts, "messages")
        try:
            trusted = self.special_in_content
            return chat_ids(self.tokenizer, self.template, messages, trusted, tools)[1]
        except ChatTemplateError as e:
            raise bad(str(e), "messages") from None

    def grammar(self, ask: Ask) -> str | None:
        """The grammar of the JSON schema the answers follow (tools.answer_schema), or None."""
        schema = answer_schema(ask)
        if schema is None:
            return None
        try:
            vocabulary(self.tokenizer, self.chat_stops)  # a tokenizer llguidance cannot read
            return json_grammar(schema)
        except GrammarError as e:
            raise bad(f"structured output: {e}", self.grammar_param(ask)) from None

    def constraint(self, grammar: str, new: int, ask: Ask) -> Constraint:
        """A row's grammar, ending its answer within `new` tokens, a stop among them."""
        try:
            return Constraint(vocabulary(self.tokenizer, self.chat_stops), grammar, new - 1)
        except TooFewTokens as e:
            raise bad(f"structured output: {e}", ask.max_tokens_param) from None
        except GrammarError as e:
            raise bad(f"structured output: {e}", self.grammar_param(ask)) from None

    @staticmethod
    def grammar_param(ask: Ask) -> str:
        """The field whose schema the answer follows."""
        return "tools" if ask.tool_choice == "required" else "response_format"

    def text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            self.check_characters(len(prompt), "prompt")
            ids = encode_prompt(self.tokenizer, prompt)
            if not ids:
                raise bad(
                    "an empty prompt needs a BOS token, which this tokenizer has not", "prompt"
                )
            return ids
        vocab = self.model.args.vocab_size
        if not all(0 <= i < vocab for i in prompt):
            raise bad(f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
        return prompt

    def new_tokens(self, prompt: int, ask: Ask, param: str) -> int:
        """The most tokens a row of this prompt may add: max_tokens if it fits the context, else
        (not given) the rest of the context for a chat, 16 for a completion."""
        if prompt >= self.context:
            raise self.too_long(prompt, param)
        room = self.context - prompt
        if ask.max_tokens is None:
            return room if ask.kind == "chat" else min(DEFAULT_TEXT_TOKENS, room)
        if ask.max_tokens > room:
            raise bad(
                f"This model's maximum context length is {self.context:,} tokens and the {param} "
                f"take {prompt:,} of them: {ask.max_tokens_param} can be at most {room:,}, not "
                f"{ask.max_tokens:,}",
                ask.max_tokens_param,
                "context_length_exceeded",
            )
        return ask.max_tokens

    def fits(self, rows: list[Row]) -> bool:
        """Whether a batch of these rows fits in memory (memory_budget.check_memory)."""
        shortest = min(len(row.prompt) for row in rows)
        total = max(len(row.prompt) + row.sampling.max_new_tokens for row in rows)
        sampled = any(row.sampling.temperature > 0 for row in rows)
        try:
            check_memory(self.model, len(rows), (shortest, total), sampled, self.free)
        except UserError:
            return False
        return True
