"""What a training run reports: tokens/s, MFU and peak memory. They go to metrics.jsonl, wandb
and a progress bar. Also what the validation loss decides (train.early_stop), and how long an
epochs-sized run will take."""

import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from picollama.cli import UserError
from picollama.config.training import Config

WANDB_LOCAL = ("offline", "disabled", "dryrun")  # WANDB_MODEs that need no login
NO_WANDB_KEY = (
    "wandb.enabled: no W&B API key is configured; log in with `wandb login`, set "
    "WANDB_API_KEY, or set WANDB_MODE=offline to keep the run's logs here"
)


def check_wandb(cfg: Config):
    """UserError, before any work, when wandb.enabled cannot log. Else wandb.init fails later with
    a traceback. Either wandb is missing, or no API key is set and WANDB_MODE is not offline."""
    if not cfg.wandb.enabled:
        return
    try:
        import wandb
    except ImportError:
        raise UserError(
            "wandb.enabled needs the wandb package (pip install wandb); or set wandb.enabled=false"
        ) from None
    if os.environ.get("WANDB_MODE") in WANDB_LOCAL or os.environ.get("WANDB_API_KEY"):
        return
    if not wandb.login(prompt=False, verify=False):  # The key `wandb login` put in ~/.netrc.
        raise UserError(NO_WANDB_KEY)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus attention's 12·layers·dim·seq_len."""
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6 * matmul_params + 12 * model.args.n_layers * model.args.dim * seq_len


class Throughput:
    """Tokens/s and MFU over training time alone: the clock stops to evaluate and checkpoint."""

    def __init__(
        self, tokens_per_step: int, flops_per_token: float, peak: float | None, device: torch.device
    ):
        """peak: the FLOP/s of all devices together, None if unknown."""
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.device = device
        self.restart(time.perf_counter())

    def restart(self, now: float):
        """Begin a new measurement at `now`: no steps counted, no training time."""
        self.steps = 0
        self.seconds = 0.0
        self.since = now  # When the clock last started.

    @contextmanager
    def paused(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # The steps' queued GPU work is training time.
        self.seconds += time.perf_counter() - self.since
        yield
        self.since = time.perf_counter()

    def rates(self) -> dict:
        """tokens_per_s (and mfu when the peak is known) of the steps since the last call."""
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * self.steps / (self.seconds + now - self.since)
        self.restart(now)
        mfu = {"mfu": self.flops_per_token * tokens_per_s / self.peak} if self.peak else {}
        return {"tokens_per_s": tokens_per_s, **mfu}


def logged_step(line: str) -> float:
    """The step of a metrics.jsonl line. Inf for a line cut short by a crash."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class RunLog:
    """What rank 0 reports: metrics.jsonl, wandb, a progress bar. A resume drops redone steps."""

    def __init__(self, cfg: Config, run_dir: Path, step: int, total: int | None, main: bool):
        """total: the run's steps, None while a train.max_minutes probe has not sized it yet."""
        self.main = main
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self.start = time.perf_counter()
        self.pace = None  # A Pace, which says how long the run will take.
        self.held_out = EarlyStop(cfg.train.early_stop, self)  # What the validations decide.
        self.bar = tqdm(
            total=total, initial=step, desc="training", unit="step", disable=not main or None
        )
        if not main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text().splitlines() if step and self.path.is_file() else []
        self.path.write_text("".join(line + "\n" for line in lines if logged_step(line) <= step))
        if cfg.wandb.enabled:
            import wandb

            try:
                self.wandb = wandb.init(
                    project=cfg.wandb.project,
                    name=cfg.wandb.run_name or run_dir.name,
                    config=cfg.to_dict(),
                )
            except wandb.errors.Error as e:  # The server refuses the key check_wandb found.
                raise UserError(f"wandb.enabled: wandb cannot log this run: {e}") from None

    def record(self, entry: dict):
        """Append entry to metrics.jsonl and wandb, with elapsed_s. That is wall seconds since
        training began, evaluations and checkpoints included. It is a validation curve's x axis."""
        entry = {**entry, "elapsed_s": round(time.perf_counter() - self.start, 3)}
        if self.main:
            # JSON has no NaN or infinity, so those are written as null.
            finite = {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in entry.items()
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(finite, allow_nan=False) + "\n")
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def sized(self, step: int, max_steps: int, line: str):
        """Say and record the step count a train.max_minutes probe chose."""
        self.bar.total = max_steps
        self.bar.refresh()
        self.say(line)
        self.record({"step": step, "max_steps": max_steps})

    def stepped(self, step: int):
        """Note that `step` is done, on the bar and to the Pace."""
        self.bar.update()
        if self.pace is not None and (line := self.pace.lap(step)):
            self.say(line)

    def say(self, text: str):
        if self.main:
            self.bar.write(text, file=sys.stdout)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def duration(seconds: float) -> str:
    """Seconds said as a person reads a wait: '40 s', '2.5 min', '25 min', '1.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 600:
        return f"{seconds / 60:.1f} min"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# The steps timed, counted from the run's start: the first step is left out where the run is
# longer, as it sets up AdamW's state and bf16 copies, or compiles. In a SmolLM2-135M fine-tune on
# 2 shared cores it took 10.1 s, the next three 3.3 s. Then a later stretch, said where its pace
# differs from theirs by a fifth or more, as load on a shared machine comes and goes.
FIRST_TIMED = (2, 3)
LATER_TIMED = (4, 8)


class Pace:
    """How long a run of known length will take, said after FIRST_TIMED's steps at their pace
    (after the first step, at its pace, where the run is no longer), and again after LATER_TIMED's
    where theirs differs. An evaluation counts as the forward passes it makes: a third of a step's
    time per row (a step's backward pass costs about two forward ones). Saves are left out."""

    def __init__(self, sized: str, cfg: Config, step: int, eval_rows: int):
        """sized says the length ('3 epochs of ...: 45 steps of 8 rows'). The run is at `step`.
        An evaluation reads eval_rows rows."""
        self.sized, self.cfg, self.start, self.eval_rows = sized, cfg, step, eval_rows
        longer = cfg.train.max_steps - step > FIRST_TIMED[1]
        self.windows = [FIRST_TIMED, LATER_TIMED] if longer else [(1, 1)]
        self.marks = {1: time.perf_counter()}  # When each window's first step began.
        self.step_s = None  # The first window's pace.

    def left_s(self, step: int, step_s: float) -> float:
        """The seconds left after `step` at step_s a step, evaluations included."""
        last, interval = self.cfg.train.max_steps, self.cfg.eval.interval
        evaluations = last // interval - step // interval if interval else 0
        evaluations += not interval or last % interval != 0  # The last one.
        eval_s = step_s * self.eval_rows / (3 * self.cfg.train.batch_size)
        return (last - step) * step_s + evaluations * eval_s

    def lap(self, step: int) -> str | None:
        """The line to say now that `step` is done, if any."""
        done, now = step - self.start, time.perf_counter()
        for first, _ in self.windows:
            if done == first - 1:
                self.marks[first] = now
        ended = [(first, last) for first, last in self.windows if last == done]
        if not ended:
            return None
        first, last = ended[0]
        step_s = (now - self.marks[first]) / (last - first + 1)
        steps = f"step {self.start + 1}'s" if last == 1 else f"steps {self.start + first}-{step}'s"
        if self.step_s is None:
            self.step_s = step_s
            whole = self.left_s(self.start, step_s)
            resumed = f" ({self.cfg.train.max_steps - self.start:,} from step {self.start})"
            return (
                f"{self.sized}{resumed if self.start else ''}, about {duration(whole)} at {steps} "
                f"pace ({step_s:.2f} s a step; evaluations counted, saves not)"
            )
        if abs(step_s - self.step_s) < self.step_s / 5:
            return None
        left = self.cfg.train.max_steps - step
        return f"{left:,} steps left, about {duration(self.left_s(step, step_s))} at {steps} pace"


class EarlyStop:
    """train.early_stop: the run stops once the validation loss has not improved on its best for
    that many evaluations in a row. It saves at each evaluation that improves on the best, and
    only then (check_config refuses interval saves), so the run directory holds the best weights.
    With 0 it changes nothing. The decisions are alike on every rank, as the loss is their mean."""

    def __init__(self, patience: int, log: RunLog):
        self.patience, self.log = patience, log
        self.best, self.best_step = math.inf, None
        self.saved = False  # Whether the best weights are in the run directory.
        self.since = 0  # Evaluations since the best.
        self.stopped = False

    def note(self, step: int, loss: float, saved: bool) -> bool:
        """Note the validation loss at `step`, whose weights are `saved` or to be saved if it is
        the best. Whether it improves on the best."""
        if loss < self.best:
            self.best, self.best_step, self.saved, self.since = loss, step, saved, 0
            return True
        self.since += 1
        return False

    def saves(self, step: int, loss: float, last: int, due: bool) -> bool:
        """Whether to save at `step`, just evaluated at `loss`. `due` is whether a save is due
        without early stopping. A stop, or the last step, not improving, is said, and sets
        self.stopped."""
        if not self.patience:
            return due
        if self.note(step, loss, saved=True):
            return True
        if self.since < self.patience and step < last:
            return False
        self.stopped = True
        best = f"step {self.best_step}'s {self.best:.4f}"
        if not self.saved:
            raise UserError(
                f"step {step}: the validation loss has not improved on {best} (the model as "
                f"given) in {self.since} evaluation(s): nothing was saved; try a lower optim.lr"
            )
        stopping = f"in {self.since} evaluations (train.early_stop {self.patience}): stopping"
        said = stopping if self.since >= self.patience else "by the last step"
        self.log.record({"step": step, "kept_step": self.best_step, "kept_val_loss": self.best})
        self.log.say(
            f"step {step}: the validation loss has not improved on {best} {said}; the run keeps "
            f"step {self.best_step}'s weights, saved then"
        )
        return False
