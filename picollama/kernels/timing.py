"""Time decode steps against each other to choose the fastest on this machine.

It picks the compiled step or the eager one (compiled_unless_slower). It picks one thread or
torch's count (tune_threads). Speed depends on the machine, so we measure rather than guess."""

import copy
import statistics
import time

import torch

from model import Transformer
from picollama.kernels.caches import setup_cache
from picollama.kernels.decode_ops import cpu_isa
from picollama.kernels.fused_step import DecodeStep

# What step_seconds may spend timing, beyond its warm-up. Small models get blocks of 16 calls,
# since a batch-1 step of 8M parameters takes ~2 ms. A 135M model gets blocks of 2, at 15-30 ms a
# step. With 5 rounds of 16 it waited 4.4 s before its first token, then took 0.4 s for 20.
TIMING_SECONDS = 0.5


@torch.inference_mode()
def step_seconds(
    model: Transformer,
    steps: dict,
    batch: int = 1,
    calls: int = 16,
    repeats: int = 5,
    budget: float = TIMING_SECONDS,
) -> dict:
    """Median seconds of one decode step of `batch` rows, for each of `steps` ({name: step}).

    The steps are timed interleaved, after one warm-up call each, in which a compiled step
    compiles. They share a cache set up here and reset after. There are up to `repeats` rounds.
    The first makes one call of each step. The others make up to `calls` calls, as many as the
    first says fit in `budget` seconds. No round starts once the rounds took `budget`. On a busy
    CPU a step can take 20x longer on two threads than on one, and then one round decides."""
    kv_dtype = getattr(next(iter(steps.values())), "kv_dtype", None)
    setup_cache(model, batch, calls + 1, kv_dtype)
    device = model.tok_embeddings.weight.device
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = {name: [] for name in steps}
    try:
        for step in steps.values():
            step(token, start_pos=0)
        block = 1
        spent = 0.0
        for _ in range(repeats):
            for name, step in steps.items():
                times[name].append(per_call_seconds(step, token, block))
                spent += times[name][-1] * block
            if spent >= budget:
                break
            if block == 1:
                first_round = sum(t[0] for t in times.values())
                block = max(1, min(calls, int(budget / (repeats * first_round))))
    finally:
        model.reset_cache()
    return {name: statistics.median(t) for name, t in times.items()}


def per_call_seconds(step, token: torch.Tensor, calls: int) -> float:
    """Seconds per call of `calls` decode steps at positions 0..calls-1, the device synced."""
    start = time.perf_counter()
    for pos in range(calls):
        step(token, start_pos=pos)
    if token.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def pick_step(model: Transformer, eager: DecodeStep, compiled: DecodeStep, batch: int = 1) -> tuple:
    """(step, note): the compiled step, unless a short timing finds it slower here.

    step_seconds times both at `batch` rows. If the compiled step is slower, return the eager one
    with a one-line note. Otherwise the note is None."""
    seconds = step_seconds(model, {"eager": eager, "compiled": compiled}, batch)
    if seconds["compiled"] <= seconds["eager"]:
        return compiled, None
    times = f"{seconds['compiled'] * 1e3:.2f} vs {seconds['eager'] * 1e3:.2f} ms a token"
    return eager, (
        f"--compile: the compiled decode step ran slower than eager here ({times}, {cpu_isa()} "
        "CPU): decoding eager"
    )


def compiled_unless_slower(
    model: Transformer, step: DecodeStep, batch: int = 1
) -> tuple[DecodeStep, str | None]:
    """pick_step between `step` (eager) and a compiled step on the same threads.

    They are timed at the batch size that will decode, which the compiled one is built for. The
    model's layers then share the chosen step's weights, and the other's copy is freed."""
    compiled = DecodeStep(model, step.threads, compiled=True, kv_dtype=step.kv_dtype)
    chosen, note = pick_step(model, step, compiled, batch)
    chosen.share_weights()
    return chosen, note


def tune_threads(model: Transformer, step: DecodeStep, batch: int = 1) -> str | None:
    """Set step.threads to 1 where a short timing at `batch` rows finds one thread faster.

    A batch-1 step is ~100 small kernels. On a busy 2-core CPU every parallel region waits for a
    descheduled thread. Returns a one-line note when it switches, else None."""
    threads = torch.get_num_threads()
    if threads == 1 or model.tok_embeddings.weight.device.type != "cpu":
        return None
    one = copy.copy(step)
    one.threads = 1
    seconds = step_seconds(model, {"all": step, "one": one}, batch)
    if seconds["one"] >= seconds["all"]:
        return None
    step.threads = 1
    one_ms, all_ms = seconds["one"] * 1e3, seconds["all"] * 1e3
    return f"decoding on 1 thread: {one_ms:.2f} ms a token against {all_ms:.2f} on {threads} here"
