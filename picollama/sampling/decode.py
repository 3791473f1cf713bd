"""Batched, KV-cached decoding: prefill -> decode_one_token -> decode_n_tokens -> generate."""

import math
from dataclasses import dataclass

import torch

from model import Transformer
from picollama.cli import UserError
from picollama.cli.flags import check_seed
from picollama.components.length import (
    ROPE_SCALINGS,
    length_dependent,
    length_problem,
    needs_scaling,
)
from picollama.sampling.caches import SinkCache, Sinks, setup_cache

SCALING_METHODS = "|".join(m for m in ROPE_SCALINGS if m != "none")  # for messages


@dataclass(frozen=True)
class Sampling:
    """How generate() chooses new tokens, checked on creation (its messages name the flags)."""

    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: torch's global generator

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UserError(f"--max-new-tokens must be >= 0, not {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k must be >= 1, not {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], not {self.top_p}")
        check_seed(self.seed)


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator=None
):
    """One token id per row of logits (B, vocab), on their device: greedy at temperature 0, else
    top-k/top-p sampling; greedy too where a tiny temperature overflows logits / temperature."""
    if temperature == 0:
        return logits.argmax(-1)
    greedy = logits.argmax(-1)
    logits = logits.float() / temperature
    # inf, or NaN (a temperature that is 0 in float32), which softmax cannot take: the limit of a
    # temperature going to 0 is greedy. No branch: the check stays on the device.
    overflow = ~logits.amax(-1).isfinite()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.where(overflow[:, None], 1.0, logits.softmax(-1))
    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(overflow, greedy, chosen)


def prefill(model: Transformer, tokens: torch.Tensor, pos: int) -> torch.Tensor:
    """Logits (B, vocab) predicting tokens[:, pos], running tokens[:, :pos] into the KV cache: the
    head on the last position alone (on every position it was a fifth of SmolLM2's prefill)."""
    return model.head(model.features(tokens[:, :pos], start_pos=0)[:, -1])


def decode_one_token(decode, tokens: torch.Tensor, pos: int):
    """Logits (B, vocab) predicting tokens[:, pos] from the one token before it (the KV cache holds
    the others)."""
    return decode(tokens[:, pos - 1 : pos], start_pos=pos - 1)[:, -1]


def decode_steps(model: Transformer, tokens: torch.Tensor, first_pos: int, decode=None):
    """Yield (pos, logits (B, vocab) predicting tokens[:, pos]) for pos = first_pos .. T-1.

    The caller writes tokens[:, pos] before asking for the next step. The first step prefills
    tokens[:, :first_pos] into the KV cache (set up by the caller), later ones feed one token
    through `decode` (default: the model). Dynamic NTK past its original context changes every
    position's rotation at each new length, so there the whole prefix is re-run: the logits are
    exactly those of model(tokens[:, :pos]) at every step.
    """
    decode = model if decode is None else decode
    recompute_after = (
        model.args.original_seq_len if length_dependent(model.args) else tokens.shape[1]
    )
    cached = 0  # positions 0..cached-1 hold valid keys and values
    for pos in range(first_pos, tokens.shape[1]):
        if pos > recompute_after:
            cached = 0
        if cached == pos - 1:
            logits = decode_one_token(decode, tokens, pos)
        else:
            logits = prefill(model, tokens, pos)
        cached = pos
        yield pos, logits


def hand_over(chosen, emit, finished, on_token) -> bool:
    """Call on_token(row, token) for the rows that emit; whether every row is finished.

    One device-to-host copy carries everything the host needs: the tokens, which rows emit, and
    whether all are done. Separate .item() calls would each stall the GPU.
    """
    rows = len(chosen)
    host = torch.cat([chosen, emit.long(), finished.long()[None]]).tolist()
    if on_token is not None:
        for row, token in enumerate(host[:rows]):
            if host[rows + row]:
                on_token(row, token)
    return bool(host[-1])


def decode_n_tokens(steps, tokens, lengths, sampling: Sampling, eos_id, on_token, vocab_limit):
    """Write each row's new tokens into `tokens` (B, prompt + new), the prompts already there, from
    `steps` (decode_steps or SinkCache.steps over tokens from the shortest prompt's end)."""
    device = tokens.device
    prompt_len = torch.tensor(lengths, device=device)
    end = prompt_len + sampling.max_new_tokens  # each row's own stop position (exclusive)
    done = torch.zeros(len(lengths), dtype=torch.bool, device=device)
    generator = (
        torch.Generator(device).manual_seed(sampling.seed) if sampling.seed is not None else None
    )
    for pos, logits in steps:
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        chosen = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)
        # Every row samples at every position, but a row still inside its prompt keeps its prompt
        # token there: that is what lets prompts of different lengths share one batch.
        new = (pos >= prompt_len) & (pos < end) & ~done
        tokens[:, pos] = torch.where(new, chosen, tokens[:, pos])
        emit = new
        if eos_id is not None:
            done |= new & (chosen == eos_id)
            emit = new & (chosen != eos_id)
        if on_token is None and eos_id is None:
            continue  # nothing to look at on the host, so no sync: the GPU runs ahead
        if hand_over(chosen, emit, (done | (pos + 1 >= end)).all(), on_token):
            break


def check_length(args, total: int, window: int | None = None):
    """ValueError when the model cannot run `total` tokens, or with attention sinks the positions
    of its `window`-token cache where fewer (config.length_problem). ALiBi, NoPE and sinusoidal
    positions run past their context (sinusoidal ones untrained there: a warning)."""
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
    """The (B, longest prompt + new) token ids that sampling with attention sinks reads, held as the
    prompts and the newest RING positions only: the steps read a prompt or the token just chosen,
    so memory stays bounded by the window and the prompts whatever the length. Indexed as the
    tensor it stands for: tokens[:, pos], tokens[:, a:b] within the prompts or one position."""

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
    """(B, longest prompt + new) token ids on the model's device, each prompt at its row's start;
    window: the KV cache's length with attention sinks (what check_length checks), with which
    the ids are a TokenRing, as bounded."""
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


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    on_token=None,
    step=None,
    vocab_limit: int | None = None,
    sinks: Sinks | None = None,
    keep: bool = True,
) -> list[list[int]]:
    """New tokens for each prompt (at most sampling.max_new_tokens; stops after EOS, not included).

    Prompts of different lengths share one batch: all rows advance one position per step from the
    shortest prompt's end, a row feeding its own prompt token while still inside its prompt, so
    greedy output per row is the same as alone. on_token(row, token_id) is called as each new token
    is chosen (for streaming). step computes the one-token decode steps (a decode_step.DecodeStep of
    the model; default: the model itself). vocab_limit: choose only ids below it (a tokenizer with
    fewer pieces than the model has embeddings cannot decode the others). sinks: a KV cache of
    bounded size (Sinks), else one for every token; with it the token ids are bounded too
    (TokenRing). keep=False: the new tokens go to on_token only and the rows returned are empty,
    so that with sinks nothing grows with max_new_tokens.
    """
    new = sampling.max_new_tokens
    cache = None if sinks is None else SinkCache(model, sinks)
    tokens = prompt_tokens(model, prompts, new, None if cache is None else cache.window)
    if new == 0:
        return [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    if cache is None:
        setup_cache(model, *tokens.shape, getattr(step, "kv_dtype", None))
        steps = decode_steps(model, tokens, min(lengths), step)
    else:
        setup_cache(model, len(prompts), cache.window, getattr(step, "kv_dtype", None))
        steps = cache.steps(tokens, min(lengths), step)
    kept = [[] for _ in prompts] if keep and cache is not None else None
    try:
        told = on_token if kept is None else kept_and_told(kept, on_token)
        decode_n_tokens(steps, tokens, lengths, sampling, eos_id, told, vocab_limit)
    finally:
        model.reset_cache()
    if not keep:
        return [[] for _ in prompts]
    if kept is not None:
        return kept
    rows = [tokens[row, length : length + new].tolist() for row, length in enumerate(lengths)]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


def kept_and_told(kept: list[list[int]], on_token):
    """An on_token that appends each row's new token to kept[row], then calls on_token (if any):
    with sinks the rows returned are gathered as they come (the TokenRing forgets them)."""

    def told(row: int, token: int):
        kept[row].append(token)
        if on_token is not None:
            on_token(row, token)

    return told
