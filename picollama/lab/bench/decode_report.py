"""The decode benchmark's results: token agreement, read-bound shares, ratios, tables and JSON.

This module only reports. decode.py does the timing."""

import dataclasses

import torch

from model import ModelArgs
from picollama.cli import UserError
from picollama.kernels.decode_ops import cpu_isa
from picollama.lab.bench import common

FP32_DECODERS = ("ours_fused_eager", "ours_compiled")  # Prefixes of our fp32 fused steps.


@dataclasses.dataclass
class Measured:
    """What main measures, step by step."""

    seconds: dict  # Method -> median seconds of the whole greedy run.
    samples: dict  # Our method -> the seconds of each of its greedy runs.
    outputs: dict  # Method -> its greedy tokens.
    steps: dict  # Timed decoder -> {position: median seconds of one decode step}.
    bounds: dict  # From decode_bounds().
    compile_seconds: dict  # Compiled decoder -> seconds of its warm-up, which compiles.
    why_not: str | None = None  # Why llama.cpp was skipped.


def best(seconds: dict, prefixes: tuple) -> str:
    """The fastest method whose name starts with one of `prefixes`."""
    return min((name for name in seconds if name.startswith(prefixes)), key=seconds.get)


def agreement(measured: Measured, n: int, dtype) -> dict[str, int]:
    """How many greedy tokens of each method agree with the plain model step's; UserError if an
    fp32 one differs."""
    reference = measured.outputs["ours_model_step"]
    agree = {
        name: sum(a == b for a, b in zip(reference, t, strict=False))
        for name, t in measured.outputs.items()
    }
    exact = ["ours_no_cache", "ours_fused_eager", "ours_compiled"]  # All fp32, so same tokens.
    if dtype == torch.float32 and any(agree[name] != n for name in exact if name in agree):
        raise UserError(f"fp32 decoders disagree with the plain model's greedy tokens: {agree}")
    return agree


def bytes_per_weight(method: str) -> float:
    """What a method reads a weight: 4 bytes fp32, 2 bf16, 1 int8 (+ its row scales, ignored), 34/32
    for q8_0 (a 2-byte scale a block of 32), 20/32 for q4_1 and our int4 (a 2-byte scale and minimum
    a block of 32; the output layer's 8 bits, in both, left out)."""
    if "q8_0" in method:
        return 34 / 32
    if "q4_1" in method or "int4" in method:
        return 20 / 32
    if "int8" in method:
        return 1.0
    return 2.0 if "bf16" in method.removesuffix("_kv_bf16") else 4.0


def bound_share(method: str, seconds_per_token: float, bounds: dict) -> float:
    """The share of the streaming-read bound a method reaches: the time its weights take to read at
    the measured streaming rate, over its time a token."""
    weight_bytes = bounds["weight_bytes"] / 4 * bytes_per_weight(method)  # From fp32 bytes.
    return weight_bytes / bounds["stream_read_bytes_per_s"] / seconds_per_token


def ratios_of(measured: Measured, n: int, positions: list[int]) -> dict[str, float]:
    """The headline ratios: our fastest fp32 and int8 decoders against HF, the read bound and
    llama.cpp; the plain step against no cache; each timed step's growth from the first position to
    the last."""
    seconds, steps, bounds = measured.seconds, measured.steps, measured.bounds
    first, last = positions[0], positions[-1]
    best_fp32, best_int8 = best(seconds, FP32_DECODERS), best(seconds, ("ours_int8",))
    return {
        f"{best_fp32}_over_hf": seconds["hf_generate"] / seconds[best_fp32],
        f"{best_int8}_over_hf": seconds["hf_generate"] / seconds[best_int8],
        f"{best_fp32}_over_stream_bound": bounds["stream_read_bound_seconds"]
        * n
        / seconds[best_fp32],
        "model_step_over_no_cache": seconds["ours_no_cache"] / seconds["ours_model_step"],
        **{f"{name}_step_{last}_over_{first}": s[last] / s[first] for name, s in steps.items()},
        **{
            f"{best_fp32}_over_{k}": seconds[k] / seconds[best_fp32]
            for k in ("llama_cpp_f32",)
            if k in seconds
        },
        **{
            f"{best_int8}_over_{k}": seconds[k] / seconds[best_int8]
            for k in ("llama_cpp_q8_0",)
            if k in seconds
        },
        **{
            f"{ours}_over_{k}": seconds[k] / seconds[ours]
            for ours, k in (
                ("ours_bf16_compiled", "llama_cpp_bf16"),
                ("ours_int4_compiled", "llama_cpp_q4_1"),
            )
            if k in seconds and ours in seconds
        },
    }


def report(cli, margs: ModelArgs, measured: Measured, agree: dict, ratios: dict):
    """Print the runs, the steps by position, the bounds and the ratios."""
    seconds = measured.seconds
    steps = measured.steps
    bounds = measured.bounds
    n = cli.new_tokens
    print(
        f"batch 1, {cli.prompt_len}-token prompt, {n} greedy new tokens, {margs.dim}-dim "
        f"{margs.n_layers}-layer model, context raised to {margs.max_seq_len}, {cpu_isa()} CPU"
        + (f"; llama.cpp skipped: {measured.why_not}" if measured.why_not else "")
    )
    rows = [
        [
            name,
            n / s,
            s,
            seconds["hf_generate"] / s,
            f"{bound_share(name, s / n, measured.bounds):.0%}",
            agree[name],
        ]
        for name, s in seconds.items()
    ]
    common.print_table(
        ["method", "tok/s", "seconds", "vs HF", "of read bound", "same tokens"], rows
    )
    positions = cli.positions
    first, last = positions[0], positions[-1]
    common.print_table(
        ["decode step (ms)", *(f"position {p}" for p in positions), f"{last} / {first}"],
        [[name, *(s[p] * 1e3 for p in positions), s[last] / s[first]] for name, s in steps.items()],
    )
    common.print_table(
        ["bound (fp32 weights)", "ms"],
        [
            ["bare matrix-vector products", bounds["matvec_seconds"] * 1e3],
            ["weights at the streaming-read rate", bounds["stream_read_bound_seconds"] * 1e3],
        ],
    )
    rates = " and ".join(f"{rate / 1e9:.1f}" for rate in bounds["stream_read_rates"])
    print(
        f"{bounds['weight_bytes'] / 1e6:.1f} MB of fp32 weights per token: read at "
        f"{bounds['matvec_bytes_per_s'] / 1e9:.1f} GB/s by the matrix-vector products, "
        f"{bounds['stream_read_bytes_per_s'] / 1e9:.1f} GB/s by a plain streaming read (the faster "
        f"of {rates}, before and after)"
        + "".join(f"; {name} compiled in {s:.1f} s" for name, s in measured.compile_seconds.items())
    )
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


def write(cli, margs: ModelArgs, dtype, measured: Measured, agree: dict, ratios: dict):
    n = cli.new_tokens
    common.write_results(
        cli,
        {
            "config": str(cli.run) if cli.run else cli.config,
            "cpu_isa": cpu_isa(),
            "model_args": margs.to_dict(),
            "prompt_len": cli.prompt_len,
            "new_tokens": n,
            "dtype": str(dtype).removeprefix("torch."),
            "methods": {
                name: {
                    "seconds": s,
                    "tokens_per_second": n / s,
                    "share_of_stream_read_bound": bound_share(name, s / n, measured.bounds),
                    "runs_seconds": measured.samples.get(name),
                }
                for name, s in measured.seconds.items()
            },
            "compile_seconds": measured.compile_seconds,
            "llama_cpp_skipped": measured.why_not,
            "greedy_tokens_agreeing_with_ours_model_step": agree,
            "step_seconds_by_position": {
                name: {str(p): t for p, t in s.items()} for name, s in measured.steps.items()
            },
            "bounds": measured.bounds,
            "ratios": ratios,
        },
    )
