"""The one static decode loop: decode_rows, for generate.py's batches and the server's.

A batch of Rows starts at the shortest prompt's end and moves one position a step. A row still
inside its prompt feeds its own prompt token, so rows of any lengths share one batch. Every row
chooses with the one Sampler (sampler.py) and takes its token by the one hand-over (rows.py).
generate() is a thin wrapper: a Row a prompt, then decode_rows.

Continuous batching (slots.Slots) has its own step source, since each row sits at its own
position. It uses the same Sampler and the same hand-over, and the serve engine drives it.

Names: a `decode` is the callable that runs one token through the model. A `step` is the fused
DecodeStep (fused_step.py), or None for the model's own forward. decode_steps and SinkCache.steps
are step sources: they yield the logits of one position at a time. `hand_over` gives chosen
tokens to their rows, and nothing else. The loop knows nothing about HTTP or text.
"""

from dataclasses import dataclass, replace
from functools import partial

import torch

from model import Transformer
from picollama.cli.flags import SEEDS
from picollama.components.length import length_dependent, length_problem, needs_scaling
from picollama.components.registry import ROPE_SCALINGS
from picollama.kernels.caches import SinkCache, Sinks, setup_cache
from picollama.kernels.prefill import cpu_prefill_attention
from picollama.sampling.prefixes import PrefixStore, keep_rows, reusable, reuse_rows
from picollama.sampling.rows import Row, RowState, hand_over
from picollama.sampling.sampler import Sampler, Sampling

SCALING_METHODS = "|".join(m for m in ROPE_SCALINGS if m != "none")  # for messages


@dataclass(frozen=True)
class DecodeOptions:
    """How a batch decodes, whatever its rows ask.

    step: the fused DecodeStep, or None for the model's forward. vocab_limit: choose only ids
    below it, since a tokenizer with fewer pieces cannot spell the others. sinks: a KV cache of
    bounded size (Sinks). keep=False: tokens go to on_token alone and none are kept, so with sinks
    nothing grows with max_new_tokens. prefixes: kept prefixes (prefixes.py) the prompts start
    from, and where each row's tokens are kept at the end. Not with sinks.
    """

    step: object = None
    vocab_limit: int | None = None
    sinks: Sinks | None = None
    keep: bool = True
    prefixes: PrefixStore | None = None


def prefill(model: Transformer, tokens: torch.Tensor, pos: int, start: int = 0) -> torch.Tensor:
    """Logits (B, vocab) predicting tokens[:, pos], with tokens[:, start:pos] run into the KV
    cache. Its positions before `start` hold a kept prefix (prefixes.py).

    The head runs on the last position alone. On every position it was a fifth of SmolLM2's
    prefill. On a CPU, attention runs through prefill_attention.cpp (kernels/prefill.py).
    """
    with cpu_prefill_attention(model):
        return model.head(model.features(tokens[:, start:pos], start_pos=start)[:, -1])


def decode_one_token(decode, tokens: torch.Tensor, pos: int):
    """Logits (B, vocab) predicting tokens[:, pos] from the one token before it.

    The KV cache holds the others.
    """
    return decode(tokens[:, pos - 1 : pos], start_pos=pos - 1)[:, -1]


def decode_steps(
    model: Transformer, tokens: torch.Tensor, first_pos: int, decode=None, cached: int = 0
):
    """Yield (pos, logits (B, vocab) predicting tokens[:, pos]) for pos = first_pos .. T-1.

    The caller writes tokens[:, pos] before it asks for the next step. The first step prefills
    tokens[:, cached:first_pos] into the KV cache, which the caller set up, its first `cached`
    positions from kept prefixes (prefixes.reuse_rows). Later ones feed one token through
    `decode` (default: the model). Dynamic NTK past its original context turns every
    position at each new length. So there the whole prefix runs again, and the logits are exactly
    those of model(tokens[:, :pos]) at every step.
    """
    decode = model if decode is None else decode
    recompute_after = (
        model.args.original_seq_len if length_dependent(model.args) else tokens.shape[1]
    )
    # positions 0..cached-1 hold valid keys and values
    for pos in range(first_pos, tokens.shape[1]):
        if pos > recompute_after:
            cached = 0
        if cached == pos - 1:
            logits = decode_one_token(decode, tokens, pos)
        else:
            logits = prefill(model, tokens, pos, cached)
        cached = pos
        yield pos, logits


def check_length(args, total: int, window: int | None = None):
    """ValueError when the model cannot run `total` tokens.

    With attention sinks only the `window` positions of its cache count, where fewer. ALiBi, NoPE
    and sinusoidal positions run past their context. Sinusoidal ones are untrained there, which
    generate.py warns about.
    """
    length = total if window is None else min(total, window)
    problem = length_problem(args, length)
    if problem:
        hint = (
            f" or choose a RoPE scaling method (--rope-scaling {SCALING_METHODS})"
            if needs_scaling(args, length)
            else ""
        )
        what, fix = ("prompt + new tokens", "generate fewer tokens")
        if length < total:
            what, fix = ("the KV cache (--window)", "give a smaller --window")
        raise ValueError(f"{what}: {problem}; {fix}{hint}")


class TokenRing:
    """The (B, longest prompt + new) token ids that sampling with attention sinks reads.

    It holds the prompts and the newest RING positions only. The steps read a prompt or the token
    just chosen, so memory stays bounded by the window and the prompts at any length. It is
    indexed as the tensor it stands for: tokens[:, pos], or tokens[:, a:b] within the prompts or
    one position.
    """

    RING = 2  # the position being chosen and the one before it

    def __init__(self, prompts: torch.Tensor, total: int):
        self.head = prompts.shape[1]
        self.ids = torch.cat([prompts, prompts.new_zeros(len(prompts), self.RING)], 1)
        self.shape = (len(prompts), total)
        self.device = prompts.device

    def slot(self, pos: int) -> int:
        return pos if pos < self.head else self.head + (pos - self.head) % self.RING

    def __getitem__(self, key):
        rows, cols = key
        if not isinstance(cols, slice):
            return self.ids[rows, self.slot(cols)]
        if cols.stop > self.head:  # past the prompts: one position at a time
            assert cols.stop - cols.start == 1, "TokenRing reads one new position at a time"
            cols = slice(self.slot(cols.start), self.slot(cols.start) + 1)
        return self.ids[rows, cols]

    def __setitem__(self, key, value):
        rows, pos = key
        self.ids[rows, self.slot(pos)] = value


def prompt_tokens(
    model: Transformer, prompts: list[list[int]], new: int, window: int | None = None
) -> torch.Tensor | TokenRing:
    """(B, longest prompt + new) token ids on the model's device, each prompt at its row's start.

    window: the KV cache's length with attention sinks, which check_length checks. With it the
    ids are a TokenRing, so they stay bounded too.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if any(not 0 <= t < model.args.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in 0..{model.args.vocab_size - 1}")
    longest = max(map(len, prompts))
    check_length(model.args, longest + new, window)
    device = model.tok_embeddings.weight.device
    width = longest + new if window is None else longest
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    return tokens if window is None else TokenRing(tokens, longest + new)


class Batch:
    """decode_rows' rows as they go: where each starts and ends, and which have ended.

    on_token(row, Token) hears each row's tokens (rows.hand_over). on_done(row, reason) hears
    once why each row ended.
    """

    def __init__(self, rows: list[Row], on_token, on_done, keep: bool):
        self.on_done = on_done
        self.states = [
            RowState(row, None if on_token is None else partial(on_token, r), [] if keep else None)
            for r, row in enumerate(rows)
        ]
        self.lengths = [len(row.prompt) for row in rows]
        self.ends = [n + row.sampling.max_new_tokens for n, row in zip(self.lengths, rows)]
        self.done = [False] * len(rows)
        for r, (length, end) in enumerate(zip(self.lengths, self.ends)):
            if end == length:  # max_new_tokens 0
                self.finish(r, "length")

    def choosing(self, pos: int) -> list[bool]:
        """Which rows choose the token at pos: those past their prompt and not done."""
        return [
            not done and length <= pos < end
            for done, length, end in zip(self.done, self.lengths, self.ends)
        ]

    def take(self, logits: torch.Tensor, chosen: torch.Tensor, choosing: list[bool]):
        """The choosing rows take their tokens. The rows that end are finished."""
        ended = hand_over(self.states, logits, chosen, choosing)
        for r, reason in ended.items():
            self.finish(r, reason)

    def read(self, tokens: torch.Tensor):
        """Each row's new tokens, read from the ids at the end: nobody watched them go by."""
        for r, state in enumerate(self.states):
            if state.tokens is not None:
                state.tokens = tokens[r, self.lengths[r] : self.ends[r]].tolist()

    def spans(self, cached: int) -> list[int]:
        """How many of each row's first positions are worth keeping, of the `cached` the cache
        holds: its prompt, its answer and the stop id that ended it. A row that ended was fed
        more, which no prompt will start with."""
        rows = zip(self.states, self.done, self.lengths, self.ends)
        return [
            min(cached, end, length + state.count + 1 if done else end)
            for state, done, length, end in rows
        ]

    def finish(self, row: int, reason: str):
        self.done[row] = True
        if self.on_done is not None:
            self.on_done(row, reason)

    @property
    def outputs(self) -> list[list[int]]:
        return [state.tokens or [] for state in self.states]


def watched(rows: list[Row], on_token, on_done, ring_kept: bool) -> bool:
    """Whether the host must see each token as it comes.

    It must for a listener, a stop id, logprobs, or tokens kept from a TokenRing (ring_kept),
    which forgets them. Otherwise there is nothing to look at. Then nothing waits for the host,
    and a GPU runs ahead.
    """
    listened = on_token is not None or on_done is not None
    asked = any(row.stop_ids or row.logprobs is not None for row in rows)
    return listened or asked or ring_kept


def steps_of(model: Transformer, tokens, first_pos: int, step, cache: SinkCache | None, kept=None):
    """The (pos, logits) steps over tokens: decode_steps, or the sink cache's steps.

    It sets up the KV cache they fill, from the prefixes `kept` (a PrefixStore) holds. The caller
    resets it.
    """
    kv_dtype = getattr(step, "kv_dtype", None)
    if cache is None:
        setup_cache(model, *tokens.shape, kv_dtype)
        cached = reuse_rows(kept, model, tokens, first_pos)
        return decode_steps(model, tokens, first_pos, step, cached)
    setup_cache(model, tokens.shape[0], cache.window, kv_dtype)
    return cache.steps(tokens, first_pos, step)


@torch.inference_mode()
def decode_rows(
    model: Transformer, rows: list[Row], on_token=None, on_done=None, options=DecodeOptions()
) -> list[list[int]]:
    """Each row's new tokens, decoded in one batch. A stop id ends a row and is not included.

    on_token(row, Token) hears each token as it is chosen. A true return ends that row (a stop
    string found, a client gone). on_done(row, reason) hears once why each row ended: "stop" (a
    stop id), "length" (its max_new_tokens) or "halted" (on_token said so). The batch ends when
    every row has. With options.keep False the rows returned are empty. With options.prefixes
    the prompts start from the prefixes kept there, and each row's tokens are kept there after.
    """
    batch = Batch(rows, on_token, on_done, options.keep)
    cache = None if options.sinks is None else SinkCache(model, options.sinks)
    window = None if cache is None else cache.window
    width = max(batch.ends, default=0) - max(batch.lengths, default=0)  # past the longest prompt
    tokens = prompt_tokens(model, [row.prompt for row in rows], width, window)
    if all(batch.done):
        return batch.outputs
    seen = watched(rows, on_token, on_done, options.keep and cache is not None)
    sampler = Sampler([row.sampling for row in rows], tokens.device)
    starts = torch.tensor(batch.lengths, device=tokens.device)
    ends = torch.tensor(batch.ends, device=tokens.device)
    kept = options.prefixes if reusable(model.args, options.sinks) else None
    cached = 0  # the positions the cache holds, whatever ends the loop
    try:
        for pos, logits in steps_of(model, tokens, min(batch.lengths), options.step, cache, kept):
            cached = pos
            if options.vocab_limit is not None:
                logits[:, options.vocab_limit :] = float("-inf")
            choosing = batch.choosing(pos)
            chosen = sampler(logits, choosing)
            # A row still in its prompt keeps its prompt token. Worked out on the device: no wait.
            inside = (starts <= pos) & (pos < ends)
            tokens[:, pos] = torch.where(inside, chosen, tokens[:, pos])
            if seen:
                batch.take(logits, chosen, choosing)
                if all(batch.done):
                    break
    finally:
        try:
            if kept is not None and cached:
                keep_rows(kept, model, tokens, batch.spans(cached))
        finally:
            model.reset_cache()
    if not seen:
        batch.read(tokens)
    return batch.outputs


def row_sampling(sampling: Sampling, row: int) -> Sampling:
    """Row `row`'s Sampling in a batch: seeded seed + row, as the server seeds a request's rows.

    Each row then draws from its own generator, so it samples as it would alone.
    """
    if sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + row) % SEEDS)


def generate(
    model: Transformer,
    prompts: list[list[int]],
    sampling: Sampling,
    eos_id: int | None = None,
    on_token=None,
    options: DecodeOptions = DecodeOptions(),
) -> list[list[int]]:
    """New tokens for each prompt: decode_rows over a Row a prompt.

    Each row gets at most sampling.max_new_tokens and stops at EOS, which is not included. Row r
    is seeded seed + r (row_sampling). on_token(row, token_id) hears each new token, for
    streaming. It may raise to stop, but its return value ends nothing.
    """
    stops = frozenset() if eos_id is None else frozenset({eos_id})
    rows = [Row(prompt, row_sampling(sampling, r), stops) for r, prompt in enumerate(prompts)]
    told = None if on_token is None else partial(told_ids, on_token)
    return decode_rows(model, rows, told, options=options)


def told_ids(on_token, row: int, token) -> bool:
    """decode_rows' on_token for generate's: the token's id alone, and the row goes on."""
    on_token(row, token.id)
    return False
