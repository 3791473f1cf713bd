"""A run sized in minutes: train.max_minutes becomes a step count, timed on its first steps."""

import math
import statistics
import sys
import time
from pathlib import Path

import torch

from picollama.checkpoint import recorded_max_steps
from picollama.config import Config

PROBE_STEPS = 10  # a train.max_minutes run times its first steps (within the warmup) to size itself
# Later steps ran slower than the probe's: 13% on average over a 5-minute run on a 2-core EPYC VM
# (its first 20 steps were its fastest). The probe's step time is raised by this margin.
DRIFT_MARGIN = 1.08


def steps_in_budget(
    seconds_left: float, done: int, step_s: float, eval_s: float, save_s: float, cfg: Config
) -> int:
    """The run's length when `done` steps are behind it and `seconds_left` remain of
    train.max_minutes: each further step costs step_s, every eval.interval steps an evaluation
    (eval_s) and every checkpoint.interval a save (save_s), and the last step both. Never fewer
    than `done`."""
    per_step = step_s
    for interval, seconds in ((cfg.eval.interval, eval_s), (cfg.checkpoint.interval, save_s)):
        per_step += seconds / interval if interval else 0.0
    return done + max(0, math.floor((seconds_left - eval_s - save_s) / per_step))


def run_length(cfg: Config, start: Path | None, started: float) -> tuple[int, "BudgetProbe | None"]:
    """train.max_steps for this run, and the probe that sizes it if any. A train.max_minutes run
    resumed from checkpoint `start` takes the step count recorded there; a new one is unbounded
    (sys.maxsize) until its probe has timed its first steps. Any other run: train.max_steps."""
    if not cfg.train.max_minutes:
        return cfg.train.max_steps, None
    if start is not None:
        return recorded_max_steps(start), None
    return sys.maxsize, BudgetProbe(cfg, started)


class BudgetProbe:
    """Sizes a train.max_minutes run from its first steps. These are warmup steps, whose learning
    rate does not depend on max_steps, so the run is the same as one given the chosen max_steps from
    the start."""

    def __init__(self, cfg: Config, started: float):
        self.cfg = cfg
        self.started = started  # when the process began: the budget counts from there
        self.ends = []  # when each probed step ended
        self.steps = min(PROBE_STEPS, cfg.optim.warmup_steps)

    def step_done(self) -> bool:
        """Note a finished step; True once the probe has timed all of its steps."""
        self.ends.append(time.perf_counter())
        return len(self.ends) == self.steps

    def eval_seconds(self, model, batches: list, dist) -> float:
        """One evaluation's seconds, from the fastest validation batch (the first may compile)."""
        times = []
        with torch.no_grad():
            for x, y in batches:
                begin = time.perf_counter()
                model(x.to(dist.device), y.to(dist.device)).item()
                times.append(time.perf_counter() - begin)
        return min(times) * math.ceil(self.cfg.eval.batches / dist.world_size)

    def max_steps(self, model, batches: list, dist) -> tuple[int, str]:
        """The run's length and a line saying how it was chosen (the same on every rank)."""
        t = self.cfg.train
        # the first two steps warm caches up (and compile); the rest give a median step time
        step_s = DRIFT_MARGIN * statistics.median(
            b - a for a, b in zip(self.ends[1:], self.ends[2:])
        )
        eval_s = self.eval_seconds(model, batches, dist)
        # every input averaged over ranks, so that every rank chooses the same step count
        step_s, eval_s, elapsed = (
            dist.mean(torch.tensor(x, device=dist.device))
            for x in (step_s, eval_s, time.perf_counter() - self.started)
        )
        # estimates: a checkpoint writes ~4 copies of the fp32 weights (model, two AdamW moments,
        # the export); the sample is generate.py's start and decode
        save_s = 0.5 + 16 * sum(p.numel() for p in model.parameters()) / 200e6
        sample_s = 3.0 + 0.01 * t.sample_tokens if t.sample_tokens else 0.0
        left = t.max_minutes * 60 - elapsed - sample_s
        steps = steps_in_budget(left, self.steps, step_s, eval_s, save_s, self.cfg)
        return steps, (
            f"budget {t.max_minutes:g} min: {step_s:.3f} s a step over steps 3-{self.steps}, an "
            f"evaluation {eval_s:.1f} s, so {steps} steps (train.max_steps, recorded for --resume)"
        )
