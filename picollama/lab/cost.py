"""What an extrapolation will cost, known before it starts.

An evaluation that cannot fit in memory, or would run past --max-minutes, is refused up front.
That beats failing hours in."""

import statistics
import time
from dataclasses import dataclass

import torch

from model import Transformer
from picollama.cli import UserError
from picollama.components.length import stretched, uses_rope
from picollama.components.registry import WINDOWED
from picollama.device import memory_bytes
from picollama.lab.interruptible import interruptible
from picollama.training.metrics import flops_per_token

BLOCK_TOKENS = 8192  # Tokens in one forward (rows × length) when rows are short.
HEAD_CHUNK = 2048  # Positions whose logits are made at once when scoring a sequence.
# Calibration doubles the length until a forward takes this long. That is long enough to time
# the model rather than Python and the allocator. Timing a fixed 1e10-FLOP forward instead once
# swung an estimate from 31 min to 20 h, and it was still 5x short.
CALIBRATION_SECONDS = 0.25
CALIBRATION_TOKENS = 512  # The first length timed.
CALIBRATION_TIMES = 3  # Times the last length is timed. We take the median.


@dataclass
class Forwards:
    """`count` forwards of `rows` rows of `length` tokens each."""

    rows: int
    length: int
    count: int


def block_rows(length: int, rows: int) -> int:
    """How many of `rows` rows of `length` tokens one forward takes.

    About BLOCK_TOKENS tokens, which bounds the activations."""
    return min(rows, max(1, BLOCK_TOKENS // length))


def forward_flops(model: Transformer, rows: int, length: int) -> float:
    """FLOPs of one forward, a third of training's (metrics.flops_per_token)."""
    return rows * length * flops_per_token(model, length) / 3


def forward_bytes(model: Transformer, rows: int, length: int) -> tuple[int, int]:
    """Peak memory of one forward beside the weights, and the part of it that grows as length²."""
    args = model.args
    size = next(model.parameters()).element_size()
    tokens = rows * length
    # Logits of HEAD_CHUNK positions a row, their float32 copy and the log-softmax.
    logits = rows * min(length, HEAD_CHUNK) * args.vocab_size * (size + 8)
    activations = tokens * (4 * args.dim + 3 * args.hidden_dim) * size
    square = 0
    if args.position == "alibi":
        # ALiBi's bias is a (heads, L, L) float32 mask, plus temporaries. It rules out flash
        # attention, so every row's scores and their softmax are held in memory.
        square = length**2 * args.n_heads * (3 * 4 + 2 * rows * size)
    return logits + activations + square, square


def gigabytes(count: float) -> str:
    return f"{count / 1e9:,.1f} GB" if count >= 1e8 else f"{count / 1e6:,.0f} MB"


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def check_memory(loaded: list, work: list, data_bytes: int, device, rows_flags: str):
    """UserError when the work needs more memory than the device has.

    We add the weights, the rows (`data_bytes`) and the largest forward of `work`. `work` is a
    list of Forwards per run."""
    weights = sum(p.numel() * p.element_size() for model, _ in loaded for p in model.parameters())
    largest, square, where = 0, 0, None
    for (model, run), forwards in zip(loaded, work):
        for f in forwards:
            need, grows = forward_bytes(model, f.rows, f.length)
            if need > largest:
                largest, square, where = need, grows, (f, run["name"])
    total = weights + largest + (data_bytes if device.type != "cuda" else 0)
    memory = memory_bytes(device)
    if memory is None or total <= memory:
        return
    f, name = where
    parts = f"the weights {gigabytes(weights)}, the rows {gigabytes(data_bytes)}, a forward of "
    parts += f"{f.rows:,} × {f.length:,} tokens of {name} {gigabytes(largest)}"
    if square > largest / 2:
        parts += f", mostly ALiBi's {f.length:,} × {f.length:,} attention bias per head"
    fix = "shorter --lengths" if largest >= data_bytes else f"fewer {rows_flags}"
    raise UserError(
        f"this evaluation needs about {gigabytes(total)} of memory ({parts}), more than the "
        f"{gigabytes(memory)} of {device.type}; use {fix}"
    )


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def model_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """A forward as the retrieval track runs one, in a worker thread so Ctrl-C works."""
    return interruptible(model, tokens)


def timed(model: Transformer, length: int, device, forward, times: int = 1) -> float:
    """Median seconds of `times` one-row evaluations of `length` tokens.

    Each calls forward(model, tokens), as the evaluation does, scoring included."""
    tokens = torch.zeros(1, length, dtype=torch.long, device=device)
    samples = []
    with torch.inference_mode():
        for _ in range(times):
            start = time.perf_counter()
            forward(model, tokens)
            synchronize(device)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def calibration(model: Transformer, longest: int, device, forward) -> tuple[int, float, float]:
    """(length, its seconds, the first's seconds) of one-row forwards of doubling length.

    Lengths start at CALIBRATION_TOKENS, or `longest` if shorter. They stop at the first that
    takes CALIBRATION_SECONDS, or at `longest`. That length's time is the median of
    CALIBRATION_TIMES runs, since the shorter ones warmed up. The first, shortest and coldest
    forward gives a floor. It is what any forward costs beside its FLOPs (Python, the allocator)."""
    length = min(longest, CALIBRATION_TOKENS)
    first = seconds = timed(model, length, device, forward)
    while length < longest and seconds < CALIBRATION_SECONDS:
        length = min(longest, 2 * length)
        seconds = timed(model, length, device, forward)
    return length, timed(model, length, device, forward, CALIBRATION_TIMES), first


def method_kind(method: str) -> str:
    """Methods whose forwards cost alike share a kind.

    Each WINDOWED method is its own kind. It runs two branches in chunks, 7-18x slower a FLOP.
    The rest are "plain". Log-n attention after a name ("rerope-logn") costs as the name does."""
    method = method.split("-")[0]
    return method if method in WINDOWED else "plain"


def run_seconds(model: Transformer, methods: list[str], forwards: list, device, forward) -> float:
    """The seconds `forwards` take, split equally over the methods in `methods`.

    Each method kind is calibrated, with the model stretched for the longest length. A forward
    costs the first length's time (the cost beside the FLOPs). Add its FLOPs at the rate of the
    length timed last, whose time holds that cost too. So the estimate errs long, never short,
    and the guard holds."""
    longest = max(f.length for f in forwards)
    base, total = model.args, 0.0
    kinds = {method_kind(method): method for method in methods}
    try:
        for kind, method in kinds.items():
            model.args = stretched(base, method, longest) if uses_rope(base) else base
            length, seconds, least = calibration(model, longest, device, forward)
            rate = forward_flops(model, 1, length) / max(seconds, 1e-9)
            share = sum(method_kind(m) == kind for m in methods) / len(methods)
            for f in forwards:
                total += share * f.count * (least + forward_flops(model, f.rows, f.length) / rate)
    finally:
        model.args = base
    return total


def check_cost(
    loaded: list, work: list, data_bytes: int, options, device, rows_flags: str, forward=None
):
    """UserError, before any evaluation, when `work` cannot fit or would run too long.

    `work` is a list of Forwards per run of `loaded`, with rows of `data_bytes`. check_memory
    checks that it fits. run_seconds times forward(model, tokens) for each model and method here,
    scoring included. The default forward is model_logits. The total must stay within
    options.max_minutes. `rows_flags` names the flags that set the rows."""
    check_memory(loaded, work, data_bytes, device, rows_flags)
    seconds, flops = 0.0, 0.0
    for (model, run), forwards in zip(loaded, work):
        if forwards:
            seconds += run_seconds(model, run["methods"], forwards, device, forward or model_logits)
            flops += sum(f.count * forward_flops(model, f.rows, f.length) for f in forwards)
    if seconds > 60 * options.max_minutes:
        forwards = sum(f.count for run in work for f in run)
        raise UserError(
            f"this evaluation would take about {duration(seconds)} ({forwards:,} forwards, "
            f"{flops:.1e} FLOPs at the speed measured on {device.type}), over --max-minutes "
            f"{options.max_minutes}; use fewer {rows_flags}, shorter --lengths or fewer --methods, "
            "or raise --max-minutes"
        )
