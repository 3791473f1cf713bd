"""A run sized in minutes. train.max_minutes becomes a step count, decided from the time spent."""

import math
import statistics
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

from picollama.cli import UserError
from picollama.cli.flags import check_type
from picollama.config.training import Config
from picollama.training.resume import read_meta, recorded_max_steps, unusable

PROBE_STEPS = 10  # A cosine budget decides after these steps, within the warmup.
# Later steps ran 13% slower than the probe's, on average over a 5-minute run on a 2-core EPYC VM.
# Its first 20 steps were its fastest. A cosine budget raises its step time by this margin.
DRIFT_MARGIN = 1.08
# The step time is the mean over steps that ended in this last share of the budget, and at least
# MIN_TIMED steps. That is recent enough to follow a change of load. It is long enough to average
# out a shared machine's bursts. On 2 busy cores, steps took 0.25 s and 6 s within one minute.
WINDOW = 0.1
MIN_TIMED = 5
UNDECIDED = sys.maxsize  # A budgeted run's train.max_steps until it decides.
# Once decided, the run looks every LOOK_EVERY steps whether its steps still fit. Where the machine
# slowed, so that they overrun by more than SLACK of the budget, it shortens to what fits. A run
# decided at 70% of 5 minutes ran 1.17x its budget when other work started in its decay.
LOOK_EVERY = 10
SLACK = 0.02


def steps_in_budget(
    seconds_left: float,
    done: int,
    step_s: float,
    eval_s: tuple[float, float],
    save_s: float,
    cfg: Config,
) -> int:
    """The run's length when `done` steps are behind it and `seconds_left` remain of the budget.
    Each further step costs step_s. Every eval.interval steps adds an evaluation, and every
    checkpoint.interval a save. eval_s is (one before the last, the last). The last step adds the
    last evaluation and a save. Never fewer than `done`."""
    interim_s, last_s = eval_s
    per_step = step_s
    for interval, seconds in ((cfg.eval.interval, interim_s), (cfg.checkpoint.interval, save_s)):
        per_step += seconds / interval if interval else 0.0
    return done + max(0, math.floor((seconds_left - last_s - save_s) / per_step))


def evaluation_costs(interim_s: float, last_s: float) -> str:
    """What an evaluation costs, said: '0.4 s an evaluation, 1.4 s the last' where they differ."""
    last = f", {last_s:.1f} s the last" if f"{last_s:.1f}" != f"{interim_s:.1f}" else ""
    return f"{interim_s:.1f} s an evaluation{last}"


def recorded(checkpoint: Path, key: str, kind):
    """The setting `key` (of type `kind`) that `checkpoint` records, None where it records none."""
    value = (read_meta(checkpoint).get("settings") or {}).get(key)
    try:
        return check_type(key, value, kind | None)
    except UserError as e:
        raise unusable(checkpoint, f"meta.json: {e}") from None


def run_length(cfg: Config, start: Path | None, started: float) -> tuple[int, int | None, "Budget"]:
    """train.max_steps and optim.decay_start for this run, and its Budget. The Budget goes on from
    the time that checkpoint `start` records, if any. A train.max_minutes run takes the length
    recorded there, else is UNDECIDED until its budget decides. Any other run takes the cfg's."""
    spent = 0.0 if start is None else recorded(start, "train.spent_s", float) or 0.0
    if not cfg.train.max_minutes:
        return cfg.train.max_steps, cfg.optim.decay_start, Budget(cfg, started, spent)
    if start is None or recorded_max_steps(start) == UNDECIDED:
        return UNDECIDED, None, Budget(cfg, started, spent, decided=False)
    decay_start = recorded(start, "optim.decay_start", int)
    return recorded_max_steps(start), decay_start, Budget(cfg, started, spent)


class Budget:
    """The run's wall time over all its processes, which each checkpoint records. A
    train.max_minutes run also decides its length here.

    The decision never changes a learning rate already behind the run. A cosine run decides after
    its first PROBE_STEPS warmup steps, whose learning rate does not depend on max_steps. A wsd run
    holds lr until the last optim.decay_fraction of the budget's time. Then it decides how many
    steps fit, from recent step, evaluation and save times, and decays from there. Either way, the
    run is the one given that length from the start."""

    def __init__(self, cfg: Config, started: float, spent: float = 0.0, decided: bool = True):
        self.cfg = cfg
        self.started = started - spent  # When the run began, on this process's clock.
        self.decided = decided
        self.mark = started  # When the last step, evaluation or save ended.
        self.laps = 0  # Steps this process has done.
        self.recent = deque()  # (end, seconds) of recent steps
        # A validation batch's cost in steps, since load slows both alike. The batches this rank
        # reads in an evaluation before the last, and in the last. The last save's seconds.
        self.batch_steps = None
        self.reads = (cfg.eval.batches, cfg.eval.batches)
        self.save_s = None
        # A run resumed after its decision looks only once it has timed a save of its own. Its
        # first estimate of one is cruder than the decision's measure, and shortened it.
        self.looks = not decided

    def spent(self) -> float:
        return time.perf_counter() - self.started

    def step_s(self) -> float:
        """The mean time of the recent steps."""
        return sum(seconds for _, seconds in self.recent) / len(self.recent)

    def evaluations(self, interim: int, last: int, ranks: int):
        """Note that an evaluation before the last reads `interim` validation batches and the last
        `last`, shared over `ranks`."""
        self.reads = (math.ceil(interim / ranks), math.ceil(last / ranks))

    @contextmanager
    def timed(self, kind: str, final: bool = True):
        """Time an evaluation or a save, by `kind`, since no step's time includes them. `final`
        marks the last evaluation, which reads every batch."""
        begin = time.perf_counter()
        yield
        self.mark = time.perf_counter()
        if kind == "save":
            self.save_s = self.mark - begin
            self.looks = True
        elif self.recent:
            self.batch_steps = (self.mark - begin) / self.reads[final] / self.step_s()

    def step_done(self, step: int) -> bool:
        """Note that the run has done `step` steps. True if it is to decide its length now, or,
        once decided, to look whether its steps still fit (decide again)."""
        if not self.cfg.train.max_minutes:
            return False
        now = time.perf_counter()
        self.laps += 1
        if self.laps > 2:  # A process's first two steps warm caches and compile.
            self.recent.append((now, now - self.mark))
            window = WINDOW * 60 * self.cfg.train.max_minutes
            while len(self.recent) > MIN_TIMED and self.recent[0][0] < now - window:
                self.recent.popleft()
        self.mark = now
        if self.decided:
            return self.looks and bool(self.recent) and self.laps % LOOK_EVERY == 0
        o = self.cfg.optim
        first = min(PROBE_STEPS, o.warmup_steps) if o.schedule == "cosine" else o.warmup_steps
        return bool(self.recent) and step >= first

    def time_evaluation(self, model, batches: list, dist):
        """Estimate an evaluation's cost from the median validation batch, since the first may
        compile. It holds until the run times one of its own. At least one step is timed."""
        times = []
        with torch.no_grad():
            for x, y, *_ in batches:  # Packed rows carry positions too. The probe skips them.
                begin = time.perf_counter()
                model(x.to(dist.device), y.to(dist.device)).item()
                times.append(time.perf_counter() - begin)
        self.batch_steps = statistics.median(times) / self.step_s()
        self.mark = time.perf_counter()

    def estimate(
        self, step: int, model, dist, margin: bool = True
    ) -> tuple[int, float, float, tuple[float, float]]:
        """The run's length if its recent step time holds, the same on every rank. Also the
        seconds left before the sample, that step time, and an evaluation's seconds (one before
        the last, the last). `margin` adds a cosine run's DRIFT_MARGIN."""
        t = self.cfg.train
        step_s = self.step_s()
        if margin and self.cfg.optim.schedule == "cosine":  # Decided early. Leave a margin.
            step_s *= DRIFT_MARGIN
        save_s = self.save_s
        if save_s is None:  # ~4 fp32 copies: model, two AdamW moments, export.
            save_s = 0.5 + 16 * sum(p.numel() for p in model.parameters()) / 2e8
        interim_s, last_s = (self.batch_steps * reads * step_s for reads in self.reads)
        values = [step_s, interim_s, last_s, save_s, self.spent()]
        if dist.world_size > 1:  # Means over ranks, so every rank decides alike.
            summed = dist.all_reduce_sum(
                torch.tensor(values, dtype=torch.float64, device=dist.device)
            )
            values = (summed / dist.world_size).tolist()
        step_s, interim_s, last_s, save_s, spent = values
        sample_s = 3.0 + 0.01 * t.sample_tokens if t.sample_tokens else 0.0  # generate.py's time.
        left = t.max_minutes * 60 - spent - sample_s
        steps = steps_in_budget(left, step, step_s, (interim_s, last_s), save_s, self.cfg)
        return steps, left, step_s, (interim_s, last_s)

    def decide(
        self, step: int, model, dist, planned: tuple[int, int | None]
    ) -> tuple[int, int | None, str] | None:
        """The run's max_steps, decay_start (None unless wsd) and a line saying how they were
        chosen. None unless it decides at `step`. A decided run's `planned` (max_steps,
        decay_start) change only where the machine slowed (shortened)."""
        steps, left, step_s, (interim_s, last_s) = self.estimate(
            step, model, dist, margin=not self.decided
        )
        self.mark = time.perf_counter()
        if self.decided:
            return self.shortened(step, steps, step_s, planned)
        t, o = self.cfg.train, self.cfg.optim
        wsd = o.schedule == "wsd"
        if wsd and left > o.decay_fraction * t.max_minutes * 60:
            return None
        self.decided = True
        # Wsd takes at least one step of decay, even past the budget.
        max_steps, decay_start = (max(steps, step + 1), step) if wsd else (steps, None)
        decaying = f", decaying from step {step}" if wsd else ""
        keys = "train.max_steps" + (" and optim.decay_start" if wsd else "")
        costs = evaluation_costs(interim_s, last_s)
        line = (
            f"budget {t.max_minutes:g} min, {self.spent():.0f} s spent: {step_s:.3f} s a step "
            f"lately, {costs}, so {max_steps} steps{decaying} ({keys}, recorded for --resume)"
        )
        return max_steps, decay_start, line

    def shortened(
        self, step: int, steps: int, step_s: float, planned: tuple[int, int | None]
    ) -> tuple[int, int | None, str] | None:
        """The steps that fit now, where the planned ones overrun the budget by more than SLACK
        of it. The run never grows, and takes at least one more step. A wsd run decays from
        here at the latest. The learning rates behind the run stay as they were."""
        max_steps, decay_start = planned
        if (max_steps - steps) * step_s <= SLACK * self.cfg.train.max_minutes * 60:
            return None
        shorter = max(steps, step + 1)
        if decay_start is not None:
            decay_start = min(decay_start, step)
        line = (
            f"the machine slowed: {step_s:.3f} s a step lately, so {shorter} steps in place of "
            f"{max_steps} (train.max_steps, recorded for --resume)"
        )
        return shorter, decay_start, line
