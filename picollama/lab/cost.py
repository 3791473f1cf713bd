"""What an extrapolation will cost, known before it starts: refuse one that cannot fit or finish."""

import math
import time
from dataclasses import dataclass

import torch

from model import Transformer
from picollama.cli import UserError
from picollama.device import memory_bytes
from picollama.metrics import flops_per_token

BLOCK_TOKENS = 8192  # the tokens of one forward (rows × length) where rows are shorter
HEAD_CHUNK = 2048  # the positions whose logits are made at once when scoring a sequence
CALIBRATION_FLOPS = 1e10  # the forward timed for the rate: a fraction of a second on a CPU
# ... and at least this many tokens long: a 135M model's 1e10 FLOPs are ~30 tokens, a forward
# that times Python's overhead, not the model (it once estimated 66 h for a 1 h evaluation)
CALIBRATION_TOKENS = 512


@dataclass
class Forwards:
    """`count` forwards of `rows` rows of `length` tokens each."""

    rows: int
    length: int
    count: int


def block_rows(length: int, rows: int) -> int:
    """How many of `rows` rows `length` tokens long one forward takes: about BLOCK_TOKENS tokens,
    which bounds the activations."""
    return min(rows, max(1, BLOCK_TOKENS // length))


def forward_flops(model: Transformer, rows: int, length: int) -> float:
    """FLOPs of one forward: a third of training's (metrics.flops_per_token)."""
    return rows * length * flops_per_token(model, length) / 3


def forward_bytes(model: Transformer, rows: int, length: int) -> tuple[int, int]:
    """Peak memory of one forward beside the weights, and the part of it that grows as length²."""
    args = model.args
    size = next(model.parameters()).element_size()
    tokens = rows * length
    # the logits of HEAD_CHUNK positions a row, their float32 copy and the log-softmax
    logits = rows * min(length, HEAD_CHUNK) * args.vocab_size * (size + 8)
    activations = tokens * (4 * args.dim + 3 * args.hidden_dim) * size
    square = 0
    if args.position == "alibi":
        # ALiBi's bias is a (heads, L, L) float32 mask (and its temporaries), which sends attention
        # down the path that holds every row's scores and their softmax: no flash attention
        square = length**2 * args.n_heads * (3 * 4 + 2 * rows * size)
    return logits + activations + square, square


def gigabytes(count: float) -> str:
    return f"{count / 1e9:,.1f} GB" if count >= 1e8 else f"{count / 1e6:,.0f} MB"


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def check_memory(loaded: list, work: list, data_bytes: int, device, rows_flags: str):
    """UserError when the weights, the rows (`data_bytes`) and the largest forward of `work` (a
    list of Forwards per run) need more memory than the device has."""
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


def measured_rate(model: Transformer, longest: int, device) -> float:
    """The FLOP/s of `model` on `device`: the faster of two timed forwards (the first also warms
    up) of about CALIBRATION_FLOPS and at least CALIBRATION_TOKENS tokens, in rows as long as
    `longest` where one such row costs less (attention's share of the FLOPs, and its speed, grow
    with the length)."""
    per_token = flops_per_token(model, longest) / 3
    length = min(longest, max(CALIBRATION_TOKENS, int(CALIBRATION_FLOPS / per_token)))
    rows = block_rows(length, max(1, int(CALIBRATION_FLOPS / (per_token * length))))
    tokens = torch.zeros(rows, length, dtype=torch.long, device=device)
    seconds = math.inf
    with torch.inference_mode():
        for _ in range(2):
            start = time.perf_counter()
            model(tokens)
            synchronize(device)
            seconds = min(seconds, time.perf_counter() - start)
    return forward_flops(model, rows, length) / max(seconds, 1e-9)


def check_cost(loaded: list, work: list, data_bytes: int, options, device, rows_flags: str):
    """UserError, before any evaluation, when `work` (a list of Forwards per run of `loaded`) with
    its rows (`data_bytes`) cannot fit in memory (check_memory), or would take longer than
    options.max_minutes at the rate each model runs at here; `rows_flags` name the flags that set
    the rows."""
    check_memory(loaded, work, data_bytes, device, rows_flags)
    seconds, flops = 0.0, 0.0
    for (model, _), forwards in zip(loaded, work):
        run_flops = sum(f.count * forward_flops(model, f.rows, f.length) for f in forwards)
        if run_flops:
            longest = max(f.length for f in forwards)
            seconds += run_flops / measured_rate(model, longest, device)
            flops += run_flops
    if seconds > 60 * options.max_minutes:
        forwards = sum(f.count for run in work for f in run)
        raise UserError(
            f"this evaluation would take about {duration(seconds)} ({forwards:,} forwards, "
            f"{flops:.1e} FLOPs at the rate measured on {device.type}), over --max-minutes "
            f"{options.max_minutes}; use fewer {rows_flags}, shorter --lengths or fewer --methods, "
            "or raise --max-minutes"
        )
