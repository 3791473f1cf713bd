"""Sample from a picollama run directory: batched, KV-cached, streaming (`python generate.py extrapolate` runs the
length-extrapolation study of extrapolate.py)."""

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.tokenizer import prompt_start
from model import ROPE_SCALINGS, Transformer
from picollama.checkpoint import load_run
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_compile,
    add_device,
    add_run,
    add_seed,
    positive,
    run_command,
)
from picollama.device import check_compiler, pick_device, pick_dtype
from picollama.inference import (
    QUANTIZATIONS,
    DecodeStep,
    compiled_unless_slower,
    quantize,
    tune_threads,
)
from picollama.lab import extrapolate, study


def decode_steps(model: Transformer, tokens: torch.Tensor, first_pos: int, decode=None):
    """Yield (pos, logits (B, vocab) predicting tokens[:, pos]) for pos = first_pos .. tokens.shape[1]-1.

    The caller writes tokens[:, pos] before asking for the next step. The first step prefills tokens[:, :first_pos]
    into the KV cache (set up by the caller), later ones feed one token through `decode` (default: the model).
    Dynamic NTK past its original context changes every position's rotation at each new length, so there the
    whole prefix is re-run: the logits are exactly those of model(tokens[:, :pos]) at every step.
    """
    decode = model if decode is None else decode
    recompute_after = (
        model.args.original_seq_len if model.args.length_dependent else tokens.shape[1]
    )
    cached = 0  # positions 0..cached-1 hold valid keys and values
    for pos in range(first_pos, tokens.shape[1]):
        if pos > recompute_after:
            cached = 0
        step = decode if pos - cached == 1 else model
        logits = step(tokens[:, cached:pos], start_pos=cached)[:, -1]
        cached = pos
        yield pos, logits


def sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator=None
):
    """One token id per row of logits (B, vocab), on their device: greedy at temperature 0, else top-k/top-p
    sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class Sampling:
    """How generate() chooses new tokens, checked once on creation (its messages name the command-line flags)."""

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


def check_length(args, total: int):
    """ValueError when the model cannot run `total` tokens (its length policy: ModelArgs.length_problem). ALiBi,
    NoPE and sinusoidal positions run past their context (sinusoidal ones untrained there: sample_command warns)."""
    problem = args.length_problem(total)
    if problem:
        methods = "|".join(m for m in ROPE_SCALINGS if m != "none")
        hint = (
            f" or choose a RoPE scaling method (--rope-scaling {methods})"
            if args.needs_scaling(total)
            else ""
        )
        raise ValueError(f"prompt + new tokens: {problem}; generate fewer tokens{hint}")


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    on_token=None,
    step=None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (at most sampling.max_new_tokens; stops after EOS, which is not included).

    Prompts of different lengths share one batch: all rows advance one position per step from the shortest
    prompt's end, a row feeding its own prompt token while still inside its prompt, so greedy output per row is
    the same as alone. on_token(row, token_id) is called as each new token is chosen (for streaming).
    step computes the one-token decode steps (an inference.DecodeStep of the model; default: the model itself).
    vocab_limit: choose only ids below it (a tokenizer with fewer pieces than the model has embeddings cannot
    decode the others).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if any(not 0 <= t < model.args.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in 0..{model.args.vocab_size - 1}")
    lengths = [len(p) for p in prompts]
    new = sampling.max_new_tokens
    check_length(model.args, max(lengths) + new)
    if new == 0:
        return [[] for _ in prompts]
    tokens = torch.zeros(
        len(prompts),
        max(lengths) + new,
        dtype=torch.long,
        device=model.tok_embeddings.weight.device,
    )
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    model.setup_cache(*tokens.shape)
    try:
        fill(model, tokens, lengths, sampling, eos_id, on_token, step, vocab_limit)
    finally:
        model.reset_cache()
    rows = [tokens[row, length : length + new].tolist() for row, length in enumerate(lengths)]
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


def fill(model, tokens, lengths, sampling: Sampling, eos_id, on_token, step, vocab_limit):
    """Write each row's new tokens into `tokens` (B, prompt + new), the prompts already in place (generate())."""
    device = tokens.device
    prompt_len = torch.tensor(lengths, device=device)
    end = prompt_len + sampling.max_new_tokens  # each row's own stop position (exclusive)
    done = torch.zeros(len(lengths), dtype=torch.bool, device=device)
    generator = (
        torch.Generator(device).manual_seed(sampling.seed) if sampling.seed is not None else None
    )
    for pos, logits in decode_steps(model, tokens, min(lengths), step):
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        chosen = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)
        # Every row samples at every position, but a row still inside its prompt keeps its prompt token there:
        # that is what lets prompts of different lengths share one batch.
        new = (pos >= prompt_len) & (pos < end) & ~done
        tokens[:, pos] = torch.where(new, chosen, tokens[:, pos])
        emit = new
        if eos_id is not None:
            done |= new & (chosen == eos_id)
            emit = new & (chosen != eos_id)
        if on_token is None and eos_id is None:
            continue  # nothing to look at on the host, so no sync: the GPU runs ahead
        # One device-to-host copy a step carries everything the host needs: the tokens, which rows emit, and
        # whether every row is done. Separate .item() calls would each stall the GPU.
        finished = (done | (pos + 1 >= end)).all()
        host = torch.cat([chosen, emit.long(), finished.long()[None]]).tolist()
        if on_token is not None:
            for row, token in enumerate(host[: len(lengths)]):
                if host[len(lengths) + row]:
                    on_token(row, token)
        if host[-1]:
            break


# ---------------------------------------------------------------- sampling command


class TextStream:
    """Print a row's text as its tokens arrive: decode the whole sequence, print the new suffix, hold back an
    incomplete UTF-8 character (a trailing U+FFFD) until its next bytes come."""

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer = tokenizer
        self.ids = list(prompt)
        self.printed = 0  # characters of the decoded text written so far
        self.out = out or sys.stdout
        self.flush_new(final=False)

    def add(self, token: int):
        self.ids.append(token)
        self.flush_new(final=False)

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


def read_prompts(args) -> list[str]:
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if args.prompt_file is None:
        return [args.prompt or ""]
    try:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file {args.prompt_file} is not UTF-8 text (byte {e.start}); re-save it"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {args.prompt_file} has no prompts (one per line)")
    return prompts


def check_rope_flags(args):
    """UserError for a --rope-factor that no method uses, or that is not a finite number >= 1."""
    if args.rope_factor is None:
        return
    if args.rope_scaling in (None, "none"):
        methods = "|".join(m for m in ROPE_SCALINGS if m != "none")
        raise UserError(f"--rope-factor needs a scaling method: --rope-scaling {methods}")
    if not (math.isfinite(args.rope_factor) and args.rope_factor >= 1):
        raise UserError(f"--rope-factor must be a finite number >= 1, not {args.rope_factor}")


def load_model(args, device: torch.device) -> tuple[Transformer, object, torch.dtype]:
    """The run's model (quantized and cast as the flags say), its tokenizer, and the activation dtype."""
    from picollama.convert import imported_run  # a .gguf file or a Hugging Face directory

    dtype = pick_dtype(args.dtype, device)
    model, _, tokenizer = load_run(imported_run(args.run), device, torch.float32)
    return quantize(model, args.quantize).to(dtype), tokenizer, dtype


def fit_length(model: Transformer, args, total: int):
    """Give the model the --rope-scaling asked for `total` tokens, then check it can run them (ModelArgs' policy)."""
    if args.rope_scaling is not None:
        try:
            model.args = model.args.stretched(args.rope_scaling, total, args.rope_factor)
        except ValueError as e:  # e.g. a run without RoPE
            raise UserError(f"--rope-scaling: {e}") from None
    check_length(model.args, total)
    if model.args.position == "sinusoidal" and total > model.args.max_seq_len:
        print(
            f"warning: sinusoidal positions past {model.args.max_seq_len} were never trained",
            file=sys.stderr,
        )


def fast_step(model: Transformer, compile: bool, batch: int) -> DecodeStep | None:
    """The fused one-token step for `batch` rows on its fastest thread count (and compiled unless that measures
    slower), or None where the model itself decodes: dynamic NTK re-runs the prefix as it grows, and the fused step
    is LLaMA's."""
    if not model.is_llama() or model.args.length_dependent:
        return None
    step = DecodeStep(model)
    notes = [tune_threads(model, step, batch)]
    if compile:
        step, note = compiled_unless_slower(model, step, batch)
        notes.append(note)
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    return step


def print_samples(
    model, tokenizer, prompts: list[list[int]], sampling: Sampling, step
) -> list[list[int]]:
    """Generate and print: one row streams its text as it comes, several are printed when all are done."""
    stream = TextStream(tokenizer, prompts[0]) if len(prompts) == 1 else None
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    pieces = tokenizer.get_piece_size()
    outputs = generate(
        model,
        prompts,
        sampling,
        eos,
        on_token=(lambda row, token: stream.add(token)) if stream else None,
        step=step,
        vocab_limit=pieces if pieces < model.args.vocab_size else None,
    )
    if stream:
        stream.flush_new(final=True)
        print()
    else:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            print(f"--- sample {i + 1}/{len(prompts)} ---")
            print(tokenizer.decode(prompt + new))
    return outputs


def sample_command(args) -> int:
    """`python generate.py --run DIR [...]`."""
    if args.run is None:
        raise UserError("the following arguments are required: --run (see --help)")
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    check_rope_flags(args)
    texts = read_prompts(args)
    device = pick_device(args.device)
    if args.compile:
        check_compiler()
    model, tokenizer, dtype = load_model(args, device)
    prompts = [encode_prompt(tokenizer, text) for text in texts for _ in range(args.num_samples)]
    if not all(prompts):  # e.g. an imported model whose tokenizer has no BOS to start from
        raise UserError(
            f"{args.run}: its tokenizer has no BOS token to begin an empty prompt; give --prompt"
        )
    fit_length(model, args, max(map(len, prompts)) + sampling.max_new_tokens)
    step = fast_step(model, args.compile, len(prompts))
    start = time.perf_counter()
    outputs = print_samples(model, tokenizer, prompts, sampling, step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new_tokens = sum(map(len, outputs))
    print(
        f"{sum(map(len, prompts))} prompt tokens, {new_tokens} new tokens in {seconds:.2f} s: "
        f"{new_tokens / seconds:.1f} tokens/s ({len(prompts)} rows, {device.type}, {str(dtype)[6:]}"
        f"{', int8 weights' if args.quantize == 'int8' else ''}"
        f"{', rope ' + model.args.rope_scaling if model.args.rope_scaling != 'none' else ''})",
        file=sys.stderr,
    )
    return 0


def parser() -> ArgumentParser:
    """Sampling flags at the top level; the study's commands as subcommands."""
    parser = ArgumentParser(
        prog="python generate.py",
        description="Sample from a run directory; `extrapolate` measures how far its positions stretch.",
    )
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
    add_device(parser)
    add_compile(parser, "the one-token decode step")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="int8: weight-only int8 with per-channel scales (default none; bfloat16 weights: --dtype bfloat16)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    extrapolate.add_arguments(
        commands.add_parser(
            "extrapolate", help="perplexity and retrieval past the training context, per method"
        )
    )
    study.add_arguments(
        commands.add_parser("study", help="the retrieval study: every position encoding, compared")
    )
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "extrapolate":
        return extrapolate.run(args, argv)
    if args.command == "study":
        return study.run(args)
    return sample_command(args)


if __name__ == "__main__":
    sys.exit(run_command(main))
