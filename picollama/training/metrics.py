"""What a training run reports: tokens/s, MFU and peak memory. They go to metrics.jsonl, wandb
and a progress bar."""

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

    def say(self, text: str):
        if self.main:
            self.bar.write(text, file=sys.stdout)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
