"""Sample from a run directory: batched, KV-cached, streaming; and the one door to the lab."""

import importlib
import math
import sys
import time

import torch

from model import Transformer
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import ArgumentParser, add_compile, add_device, add_run, add_seed, positive
from picollama.components.length import stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.device import check_compiler, memory_bytes, pick_device
from picollama.kernels.caches import (
    KV_CACHES,
    Sinks,
    add_kv_cache_flag,
    check_sink_cache,
    check_sinks,
)
from picollama.kernels.load import fast_step, load_to_sample
from picollama.kernels.quantize import QUANTIZATIONS
from picollama.sampling.chat import add_chat_flags, chat_command, check_chat_flags
from picollama.sampling.decode import SCALING_METHODS, check_length
from picollama.sampling.memory import check_memory, free_bytes, prompt_file_limit
from picollama.sampling.prompts import (
    check_prompt_flags,
    encode_prompt,
    print_samples,
    read_prompts,
)
from picollama.sampling.sampler import Sampling

# ---------------------------------------------------------------- the sampling command


def check_rope_flags(args):
    """UserError for a --rope-factor that no method uses, or that is not a finite number >= 1."""
    if args.rope_factor is None:
        return
    if args.rope_scaling in (None, "none"):
        raise UserError(f"--rope-factor needs a scaling method: --rope-scaling {SCALING_METHODS}")
    if not (math.isfinite(args.rope_factor) and args.rope_factor >= 1):
        raise UserError(f"--rope-factor must be a finite number >= 1, not {args.rope_factor}")


def fit_length(model: Transformer, args, total: int, sinks: Sinks | None = None):
    """Give the model the --rope-scaling asked for `total` tokens (with sinks, for the positions
    its cache reaches), then check it can run them."""
    window = None if sinks is None else sinks.window_of(model.args)
    length = total if window is None else min(total, window)
    if args.rope_scaling is not None:
        try:
            model.args = stretched(model.args, args.rope_scaling, length, args.rope_factor)
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


def summary(args, model, prompts, outputs: list[int], seconds: float, device, dtype) -> str:
    """The closing line: tokens (`outputs`: each row's new tokens' count), speed, and what ran
    them."""
    new_tokens = sum(outputs)
    weights = f", {args.quantize} weights" if args.quantize != "none" else ""
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
    window = None if sinks is None else sinks.window_of(model.args)
    rows = len(encoded) * args.num_samples
    shortest = min(map(len, encoded))
    sampled, longest = sampling.temperature > 0, max(map(len, encoded))
    # print_samples streams one row, keeping none of it; several are kept to be printed at the end
    check_memory(model, rows, (shortest, total), sampled, free, window, longest, kept=rows > 1)
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
    if sinks:
        check_sink_cache(args.kv_cache)
    check_rope_flags(args)
    check_prompt_flags(args)
    device = pick_device(args.device)
    if args.compile:
        check_compiler()
    model, tokenizer, dtype = load_to_sample(args, device)
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
    add_chat_flags(parser)
    add_device(parser)
    add_compile(parser, "the one-token decode step")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="auto",
        help="weights: int8 with per-channel scales; int4 (CPU): 4-bit in groups of 32; q8_0, "
        "q4_0, q4_1 (CPU): llama.cpp's block formats; f32, bf16 (CPU): float weights through our "
        "kernels; none: float (default auto: a GGUF file's own format, else none)",
    )
    add_kv_cache_flag(parser)


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
    if args.chat:
        return chat_command(args)
    check_chat_flags(args)
    return sample_command(args)


if __name__ == "__main__":
    sys.exit(run_command(main))
