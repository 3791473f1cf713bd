"""Sample from a run directory: batched, KV-cached, streaming; and the one door to the lab."""

import importlib
import math
import os
import stat
import sys
import time
from dataclasses import dataclass

import torch

from data.tokenizer import prompt_start
from model import ROPE_SCALINGS, Transformer, apply_rotary, rope_frequencies
from picollama.checkpoint import load_run
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_compile,
    add_device,
    add_run,
    add_seed,
    check_seed,
    file_kind,
    positive,
    run_command,
    utf8_argument,
)
from picollama.config import length_problem, needs_scaling
from picollama.device import check_compiler, memory_bytes, pick_device, pick_dtype
from picollama.inference import (
    QUANTIZATIONS,
    DecodeStep,
    compiled_unless_slower,
    quantize,
    tune_threads,
)

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


@dataclass(frozen=True)
class Sinks:
    """Bounded-memory sampling with attention sinks (StreamingLLM, Xiao et al. 2023): a KV cache of
    `window` tokens (None: the model's context) keeping each row's first `sink_tokens` and the most
    recent others. It bounds memory and keeps the text fluent past the context; it does not extend
    the usable context: what leaves the cache is forgotten. Checked on creation (its messages name
    the flags)."""

    sink_tokens: int = 4
    window: int | None = None  # the cache's size in tokens, sinks included

    def __post_init__(self):
        if self.sink_tokens < 0:
            raise UserError(f"--sink-tokens must be >= 0, not {self.sink_tokens}")
        if self.window is not None and self.window <= self.sink_tokens:
            raise UserError(
                f"--window must be larger than --sink-tokens ({self.sink_tokens}), leaving room "
                f"for recent tokens; not {self.window}"
            )

    def window_of(self, args) -> int:
        """The cache's size for a model of `args`: the window given, else its context."""
        window = self.window or args.max_seq_len
        if window <= self.sink_tokens:
            raise UserError(
                f"--sink-tokens {self.sink_tokens} fills the model's context of {window} tokens: "
                "lower it, or give a larger --window"
            )
        return window


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
    """Logits (B, vocab) predicting tokens[:, pos], running tokens[:, :pos] into the KV cache."""
    return model(tokens[:, :pos], start_pos=0)[:, -1]


def decode_one_token(decode, tokens: torch.Tensor, pos: int, slot: int | None = None):
    """Logits (B, vocab) predicting tokens[:, pos] from the one token before it (the KV cache holds
    the others), that token at cache slot `slot` (default pos - 1)."""
    slot = pos - 1 if slot is None else slot
    return decode(tokens[:, pos - 1 : pos], start_pos=slot)[:, -1]


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
        model.args.original_seq_len if model.args.length_dependent else tokens.shape[1]
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


def check_sinks(args):
    """UserError for a model whose cached keys and values cannot move to new positions."""
    if args.position in ("sinusoidal", "learned"):
        raise UserError(
            f"--sink-tokens: {args.position} positions are added to the token embeddings, so "
            "cached tokens cannot move to new positions (RoPE, ALiBi and NoPE models can)"
        )
    if args.position == "fox":
        raise UserError(
            "--sink-tokens: FoX caches each key's running sum of forget gates, which the sink "
            "cache does not move (RoPE, ALiBi and NoPE models can)"
        )
    if args.length_dependent:
        raise UserError(
            "--sink-tokens: dynamic NTK turns every cached key as the sequence grows; choose "
            "another --rope-scaling (the cache never holds more than --window tokens)"
        )


class SinkCache:
    """The model's KV cache under Sinks, changed in place (a DecodeStep, compiled or not, reads the
    same tensors). Slots 0..fill-1 hold tokens, the sequence's first sink_tokens in front; full, it
    drops the `evict` oldest others and moves the rest down. Positions are the slots (StreamingLLM's
    choice), so a RoPE key moved down `evict` slots is turned back by `evict` positions; ALiBi's
    bias and NoPE read no stored position."""

    def __init__(self, model: Transformer, sinks: Sinks):
        check_sinks(model.args)
        self.model, self.sinks = model, sinks.sink_tokens
        self.window = sinks.window_of(model.args)
        # a quarter of the recent part at a time: a move costs O(window) per layer, so it happens
        # 4 times per window of new tokens, not at every token
        self.evict = max(1, (self.window - self.sinks) // 4)
        self.fill = 0
        self.turn = None  # the rotation by -evict positions, for RoPE
        if model.args.uses_rope:
            inv_freq, _ = rope_frequencies(model.args, self.window)
            angles = -self.evict * inv_freq.to(model.tok_embeddings.weight.device)
            # unit length: the cached keys carry YaRN's attention scale already
            self.turn = torch.polar(torch.ones_like(angles), angles)

    def make_room(self):
        """Where the cache is full, drop the `evict` tokens after the sinks and move the rest down
        (keys turned back by as many positions: rotations compose)."""
        if self.fill < self.window:
            return
        start, end = self.sinks + self.evict, self.fill
        for layer in self.model.layers:
            attention = layer.attention
            cache = attention.cache
            kept = cache.k[:, :, start:end]
            rotated = self.turn is not None and attention.rotary  # not a nope_every layer
            # copies: the slots read and written overlap
            kept = apply_rotary(kept, self.turn) if rotated else kept.clone()
            cache.k[:, :, self.sinks : end - self.evict] = kept
            cache.v[:, :, self.sinks : end - self.evict] = cache.v[:, :, start:end].clone()
        self.fill -= self.evict

    def prefill(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """prefill() into this cache: tokens[:, :pos] in chunks up to the cache's end, evicting
        between them, which leaves what feeding them one at a time would."""
        fed = 0
        while fed < pos:
            self.make_room()
            chunk = min(pos - fed, self.window - self.fill)
            logits = self.model(tokens[:, fed : fed + chunk], start_pos=self.fill)[:, -1]
            self.fill += chunk
            fed += chunk
        return logits

    def steps(self, tokens: torch.Tensor, first_pos: int, decode=None):
        """decode_steps through this cache (set up by the caller, `window` long): each token goes
        to the next free slot, at that slot's position."""
        decode = self.model if decode is None else decode
        yield first_pos, self.prefill(tokens, first_pos)
        for pos in range(first_pos + 1, tokens.shape[1]):
            self.make_room()
            logits = decode_one_token(decode, tokens, pos, slot=self.fill)
            self.fill += 1
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


def prompt_tokens(
    model: Transformer, prompts: list[list[int]], new: int, window: int | None = None
) -> torch.Tensor:
    """(B, longest prompt + new) token ids on the model's device, each prompt at its row's start;
    window: the KV cache's length with attention sinks (what check_length checks)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if any(not 0 <= t < model.args.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in 0..{model.args.vocab_size - 1}")
    longest = max(map(len, prompts))
    check_length(model.args, longest + new, window)
    device = model.tok_embeddings.weight.device
    tokens = torch.zeros(len(prompts), longest + new, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    return tokens


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
) -> list[list[int]]:
    """New tokens for each prompt (at most sampling.max_new_tokens; stops after EOS, not included).

    Prompts of different lengths share one batch: all rows advance one position per step from the
    shortest prompt's end, a row feeding its own prompt token while still inside its prompt, so
    greedy output per row is the same as alone. on_token(row, token_id) is called as each new token
    is chosen (for streaming). step computes the one-token decode steps (an inference.DecodeStep of
    the model; default: the model itself). vocab_limit: choose only ids below it (a tokenizer with
    fewer pieces than the model has embeddings cannot decode the others). sinks: a KV cache of
    bounded size (Sinks), else one for every token.
    """
    new = sampling.max_new_tokens
    cache = None if sinks is None else SinkCache(model, sinks)
    tokens = prompt_tokens(model, prompts, new, None if cache is None else cache.window)
    if new == 0:
        return [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    if cache is None:
        model.setup_cache(*tokens.shape, dtype=getattr(step, "kv_dtype", None))
        steps = decode_steps(model, tokens, min(lengths), step)
    else:
        model.setup_cache(len(prompts), cache.window, dtype=getattr(step, "kv_dtype", None))
        steps = cache.steps(tokens, min(lengths), step)
    try:
        decode_n_tokens(steps, tokens, lengths, sampling, eos_id, on_token, vocab_limit)
    finally:
        model.reset_cache()
    rows = [tokens[row, length : length + new].tolist() for row, length in enumerate(lengths)]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


# ---------------------------------------------------------------- sampling command


class TextStream:
    """Print a row's text as its tokens arrive: decode the whole sequence, print the new suffix, and
    hold back an incomplete UTF-8 character (a trailing U+FFFD) until its next bytes come."""

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer = tokenizer
        self.ids = list(prompt)
        self.printed = 0  # characters of the decoded text written so far
        self.out = out or sys.stdout
        self.flush_new(final=False)

    def add(self, token: int):
        self.ids.append(token)
        self.flush_new(final=False)

    def on_token(self, row: int, token: int):
        """generate()'s on_token for a batch of this one row."""
        self.add(token)

    def flush_new(self, final: bool):
        text = self.tokenizer.decode(self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """BOS (where the tokenizer adds one) and the text's ids; an empty prompt is BOS, if any."""
    ids = prompt_start(tokenizer) + tokenizer.encode(text)
    return ids or ([tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else [])


def check_prompt_flags(args):
    """UserError for --prompt with --prompt-file, or a --prompt-file that is not a regular file."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        prompt_file_size(args.prompt_file)


def prompt_file_size(path) -> int:
    """The size of --prompt-file; UserError unless it is a regular file, which is never opened (a
    device such as /dev/zero, a FIFO or a socket could be read forever, or block)."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise UserError(f"--prompt-file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else file_kind(path) or "not a file"
        raise UserError(f"--prompt-file {path} is {kind}, not a regular file of prompts")
    return info.st_size


def read_prompts(args, max_bytes: int | None) -> list[str]:
    """[--prompt], or --prompt-file's non-blank lines; UserError for text that is not UTF-8, and for
    a file over max_bytes (None: no limit), refused before it is read."""
    if args.prompt_file is None:
        return [utf8_argument(args.prompt or "", "--prompt")]
    path = args.prompt_file
    size = prompt_file_size(path)
    try:
        with open(path, "rb") as file:  # no further than the limit: the file may be growing
            data = file.read(-1 if max_bytes is None else max_bytes + 1)
    except OSError as e:
        raise UserError(f"--prompt-file {path}: {e.strerror or e}") from None
    held = max(size, len(data))
    if max_bytes is not None and held > max_bytes:
        raise UserError(
            f"--prompt-file {path} holds {held:,} bytes: more prompt text than this model could "
            f"take in this machine's memory (at most {max_bytes:,} bytes)"
        )
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file {path} is not UTF-8 text (byte {e.start}); re-save it"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {path} has no prompts (one per line)")
    return prompts


# ---------------------------------------------------------------- what fits in memory


def bytes_per_token(model: Transformer) -> int:
    """What each token of a batch holds while it is sampled: its keys and values in every layer,
    and its id."""
    args = model.args
    size = model.tok_embeddings.weight.element_size()  # the activations' (and the cache's) dtype
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * size + 8


def free_bytes(model: Transformer, memory: int | None) -> int | None:
    """The memory left beside the model's weights."""
    if memory is None:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return memory - sum(t.numel() * t.element_size() for t in tensors)


def prompt_file_limit(model: Transformer, tokenizer, free: int | None) -> int | None:
    """The most bytes of prompts whose tokens' KV cache could fit in `free` bytes, each token
    spelling at most the tokenizer's longest piece."""
    if free is None:
        return None
    pieces = range(tokenizer.get_piece_size())
    longest = max(len(tokenizer.id_to_piece(i).encode()) for i in pieces)
    return max(free, 0) // bytes_per_token(model) * longest


def check_memory(model: Transformer, rows: int, lengths: tuple[int, int], sampled: bool, free):
    """UserError, before anything is allocated, when `rows` rows of prompts (shortest, longest +
    new tokens) = `lengths` cannot fit in `free` bytes: at least their KV cache and token ids, the
    first step's logits over the shortest prompt (alive while the second step's are made), and
    where `sampled` (a temperature above 0) the float32 logits and probabilities of a step."""
    if free is None:
        return
    shortest, total = lengths
    size = model.tok_embeddings.weight.element_size()
    logits = rows * model.args.vocab_size * ((shortest + 1) * size + (8 if sampled else 0))
    needed = rows * total * bytes_per_token(model) + logits
    if needed > free:
        raise UserError(
            f"{rows:,} rows of up to {total:,} tokens need at least {gib(needed)} for their KV "
            f"cache and logits, but {gib(free)} of memory is left beside the weights: lower "
            "--num-samples or --max-new-tokens, or give fewer prompts"
        )


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_rope_flags(args):
    """UserError for a --rope-factor that no method uses, or that is not a finite number >= 1."""
    if args.rope_factor is None:
        return
    if args.rope_scaling in (None, "none"):
        raise UserError(f"--rope-factor needs a scaling method: --rope-scaling {SCALING_METHODS}")
    if not (math.isfinite(args.rope_factor) and args.rope_factor >= 1):
        raise UserError(f"--rope-factor must be a finite number >= 1, not {args.rope_factor}")


def load_model(args, device: torch.device) -> tuple[Transformer, object, torch.dtype]:
    """The run's model (quantized and cast as the flags say), its tokenizer and activation dtype."""
    from picollama.convert import imported_run  # a .gguf file or a Hugging Face directory

    dtype = pick_dtype(args.dtype, device)
    model, _, tokenizer = load_run(imported_run(args.run), device, torch.float32)
    return quantize(model, args.quantize).to(dtype), tokenizer, dtype


def fit_length(model: Transformer, args, total: int, sinks: Sinks | None = None):
    """Give the model the --rope-scaling asked for `total` tokens (with sinks, for the positions
    its cache reaches), then check it can run them."""
    window = None if sinks is None else sinks.window_of(model.args)
    length = total if window is None else min(total, window)
    if args.rope_scaling is not None:
        try:
            model.args = model.args.stretched(args.rope_scaling, length, args.rope_factor)
        except ValueError as e:  # e.g. a run without RoPE
            raise UserError(f"--rope-scaling: {e}") from None
    if sinks is not None:
        check_sinks(model.args)
    check_length(model.args, total, window)
    if model.args.position == "sinusoidal" and total > model.args.max_seq_len:
        print(
            f"warning: sinusoidal positions past {model.args.max_seq_len} were never trained",
            file=sys.stderr,
        )


KV_CACHES = {"same": None, "bfloat16": torch.bfloat16, "int8": torch.int8}  # --kv-cache


def fast_step(model: Transformer, compile: bool, batch: int, kv_dtype=None) -> DecodeStep | None:
    """The fused one-token step for `batch` rows on its fastest thread count (compiled unless that
    measures slower), on a KV cache of kv_dtype (None: the activations'), or None where the model
    itself decodes: dynamic NTK re-runs the prefix as it grows, and the fused step is LLaMA's."""
    if not model.is_llama() or model.args.length_dependent:
        return None
    step = DecodeStep(model, kv_dtype=kv_dtype)
    notes = [tune_threads(model, step, batch)]
    if compile:
        step, note = compiled_unless_slower(model, step, batch)
        notes.append(note)
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    return step


def print_samples(
    model, tokenizer, prompts: list[list[int]], sampling: Sampling, step, sinks=None
) -> list[list[int]]:
    """Generate and print: one row streams its text as it comes, several are printed at the end."""
    stream = TextStream(tokenizer, prompts[0]) if len(prompts) == 1 else None
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    pieces = tokenizer.get_piece_size()
    outputs = generate(
        model,
        prompts,
        sampling,
        eos,
        on_token=stream.on_token if stream else None,
        step=step,
        vocab_limit=pieces if pieces < model.args.vocab_size else None,
        sinks=sinks,
    )
    if stream:
        stream.flush_new(final=True)
        print()
    else:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            print(f"--- sample {i + 1}/{len(prompts)} ---")
            print(tokenizer.decode(prompt + new))
    return outputs


def summary(args, model, prompts, outputs, seconds: float, device, dtype) -> str:
    """The closing line: tokens, speed, and what ran them."""
    new_tokens = sum(map(len, outputs))
    weights = ", int8 weights" if args.quantize == "int8" else ""
    rope = model.args.rope_scaling
    rope = f", rope {rope}" if rope != "none" else ""
    return (
        f"{sum(map(len, prompts))} prompt tokens, {new_tokens} new tokens in {seconds:.2f} s: "
        f"{new_tokens / seconds:.1f} tokens/s ({len(prompts)} rows, {device.type}, "
        f"{str(dtype)[6:]}{weights}{rope})"
    )


def batch_prompts(
    args, model: Transformer, tokenizer, sampling: Sampling, device, sinks: Sinks | None = None
) -> list[list[int]]:
    """Each prompt's token ids, args.num_samples times, once the model is fitted to the longest
    (fit_length) and the batch is known to fit in memory (with sinks: a cache of its window)."""
    free = free_bytes(model, memory_bytes(device))
    texts = read_prompts(args, prompt_file_limit(model, tokenizer, free))
    encoded = [encode_prompt(tokenizer, text) for text in texts]
    if not all(encoded):  # e.g. an imported model whose tokenizer has no BOS to start from
        raise UserError(
            f"{args.run}: its tokenizer has no BOS token to begin an empty prompt; give --prompt"
        )
    total = max(map(len, encoded)) + sampling.max_new_tokens
    fit_length(model, args, total, sinks)
    cached = total if sinks is None else min(total, sinks.window_of(model.args))
    rows = len(encoded) * args.num_samples
    shortest = min(min(map(len, encoded)), cached)
    check_memory(model, rows, (shortest, cached), sampling.temperature > 0, free)
    return [prompt for prompt in encoded for _ in range(args.num_samples)]


def sinks_of(args) -> Sinks | None:
    """The Sinks that --sink-tokens and --window ask for (either turns them on), else None."""
    if args.sink_tokens is None and args.window is None:
        return None
    sink_tokens = Sinks.sink_tokens if args.sink_tokens is None else args.sink_tokens
    return Sinks(sink_tokens, args.window)


def sample_command(args) -> int:
    """`python generate.py --run DIR [...]`."""
    if args.run is None:
        raise UserError("the following arguments are required: --run (see --help)")
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    sinks = sinks_of(args)
    if sinks and args.kv_cache == "int8":
        raise UserError("--sink-tokens moves cached keys, which an int8 --kv-cache cannot turn")
    check_rope_flags(args)
    check_prompt_flags(args)
    device = pick_device(args.device)
    if args.compile:
        check_compiler()
    model, tokenizer, dtype = load_model(args, device)
    prompts = batch_prompts(args, model, tokenizer, sampling, device, sinks)
    step = fast_step(model, args.compile, len(prompts), KV_CACHES[args.kv_cache])
    start = time.perf_counter()
    outputs = print_samples(model, tokenizer, prompts, sampling, step, sinks)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(summary(args, model, prompts, outputs, seconds, device, dtype), file=sys.stderr)
    return 0


# ---------------------------------------------------------------- command line; the lab's door

# The study's commands live in picollama.lab, which the core never imports: this is its one door,
# opened only when one of them is chosen, so that sampling never loads the lab.
LAB_COMMANDS = {
    "extrapolate": "perplexity and retrieval past the training context, per method",
    "study": "the retrieval study: every position encoding, compared",
}


def lab(command: str):
    """The lab module behind a LAB_COMMANDS command (picollama.lab.<command>), imported now."""
    return importlib.import_module(f"picollama.lab.{command}")


class LabCommand(ArgumentParser):
    """A subcommand whose flags (add_arguments) and work (run) are its lab module's, imported only
    when this subcommand is parsed."""

    def __init__(self, *args, command: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command
        self.has_flags = False

    def parse_known_args(self, args=None, namespace=None):
        if not self.has_flags:
            lab(self.command).add_arguments(self)
            self.has_flags = True
        return super().parse_known_args(args, namespace)


def add_sampling_flags(parser: ArgumentParser):
    """The flags of `python generate.py --run DIR [...]`."""
    add_run(parser, required=False)  # required for sampling only: sample_command checks
    parser.add_argument("--prompt", help="the text to continue (default: empty, i.e. only BOS)")
    parser.add_argument(
        "--prompt-file", help="a UTF-8 file with one prompt per line (blank lines skipped)"
    )
    parser.add_argument(
        "--num-samples", type=positive(), default=1, help="samples per prompt (default 1)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=Sampling.max_new_tokens, help="default 200"
    )
    parser.add_argument(
        "--temperature", type=float, default=Sampling.temperature, help="0 = greedy (default 0.8)"
    )
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    parser.add_argument(
        "--top-p", type=float, help="nucleus sampling: the smallest set holding this probability"
    )
    add_seed(parser, "for reproducible samples", default=None)
    parser.add_argument(
        "--rope-scaling",
        choices=ROPE_SCALINGS,
        help="RoPE scaling for going past the training context: " + ", ".join(ROPE_SCALINGS),
    )
    parser.add_argument(
        "--rope-factor",
        type=float,
        help="its factor, >= 1 (default: just enough for prompt + new tokens; 1 for dynamic)",
    )
    add_sink_flags(parser)
    add_device(parser)
    add_compile(parser, "the one-token decode step")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="int8: weight-only int8 with per-channel scales; int4 (CPU): 4-bit in groups of 32 "
        "(default none; bfloat16 weights: --dtype bfloat16)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=tuple(KV_CACHES),
        default="same",
        help="the KV cache's dtype for LLaMA models: same (as the activations, default), bfloat16 "
        "or int8 (a scale a token and head): less to read a step at long lengths",
    )


def add_sink_flags(parser: ArgumentParser):
    """--sink-tokens and --window: sampling in bounded memory (Sinks)."""
    parser.add_argument(
        "--sink-tokens",
        type=int,
        metavar="N",
        help="attention sinks (StreamingLLM), for any length in bounded memory: the KV cache keeps "
        "each row's first N tokens (default 4) and the most recent ones, dropping the oldest "
        "quarter of those when full. The text stays fluent past the context, but what is dropped "
        "is forgotten: this does not extend the usable context. RoPE, ALiBi and NoPE models",
    )
    parser.add_argument(
        "--window",
        type=int,
        metavar="W",
        help="turns on attention sinks (--sink-tokens): the KV cache's size in tokens, sinks "
        "included (default: the model's context)",
    )


def parser() -> ArgumentParser:
    """Sampling flags at the top level; the lab's commands as subcommands."""
    parser = ArgumentParser(
        prog="python generate.py",
        description="Sample from a run directory; "
        "`extrapolate` measures how far its positions stretch.",
    )
    add_sampling_flags(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=LabCommand)
    for command, what in LAB_COMMANDS.items():
        commands.add_parser(command, help=what, command=command)
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "extrapolate":
        return lab("extrapolate").run(args, argv)
    if args.command == "study":
        return lab("study").run(args)
    return sample_command(args)


if __name__ == "__main__":
    sys.exit(run_command(main))
