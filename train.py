"""Train picollama, in one process or under torchrun with FSDP2.

Usage: python train.py [--config F.toml] [--section.key=value ...] [--resume]."""

# ruff: noqa: E402 (the re-exec below comes before torch's import)
import math
import os
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from picollama.training.huge_pages import malloc_huge_pages

if __name__ == "__main__":
    malloc_huge_pages()

import torch

from data.tokenizer import tokenizer_file
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.command import Interrupted, run_command
from picollama.cli.outputs import exclusive
from picollama.components.variants import given_up
from picollama.config.checks import check_config
from picollama.config.training import Config, parse_cli
from picollama.device import CoreShare, Dist, check_compiler, keep_freed_memory, peak_flops
from picollama.training.budget import Budget, run_length
from picollama.training.checks import check_memory, check_out_dir, check_packing, init_from_weights
from picollama.training.cpu_attention import cpu_training_attention
from picollama.training.dataset import (
    VALIDATION_FORMATS,
    DataSource,
    check_dataset,
    data_source,
    epoch_length,
    next_rows,
    spread,
)
from picollama.training.metrics import (
    Pace,
    RunLog,
    Throughput,
    check_wandb,
    flops_per_token,
    memory_gb,
)
from picollama.training.optim import decay_start, lr_at, set_weight_decay, weight_decay_at
from picollama.training.resume import check_tokenizer, checkpoints, resume_point, steps_left
from picollama.training.state import load_checkpoint, save_checkpoint, stopped
from picollama.training.step import build_model, seed_everything, train_step
from picollama.training.weight_average import WeightAverage, averaged

# ---------------------------------------------------------------- the run


def due(step: int, interval: int, last: int) -> bool:
    """Whether a thing done every `interval` steps (0: never) and at the last is due at `step`."""
    return step == last or (interval > 0 and step % interval == 0)


def log_step(log: RunLog, step: int, lr: float, losses: dict, grad_norm, clock: Throughput, dist):
    """Record the step's losses (mean over ranks), learning rate, gradient norm, speed, memory."""
    entry = {
        "step": step,
        **{name: dist.mean(value) for name, value in losses.items()},
        "lr": lr,
        "grad_norm": grad_norm.item(),
        **clock.rates(),
        "mem_gb": memory_gb(dist.device),
    }
    log.record(entry)
    tokens_per_s = f"{entry['tokens_per_s']:,.0f}"
    log.bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=tokens_per_s, lr=f"{lr:.2e}")


def validate(
    model, data: DataSource, log: RunLog, step: int, run_dir: Path, interim: int = 0
) -> float:
    """Evaluate in eval mode, so without dropout, then record and say the metrics, and return the
    loss. It reads `interim` batches spread over the split, or all with 0. A loss not finite stops
    it."""
    batches = spread(data.val_batches, interim)
    model.eval()
    try:
        result = data.validate(model, batches)
    finally:
        model.train()
    part = len(batches) < len(data.val_batches)
    log.record({"step": step, **result, **({"val_batches": len(batches)} if part else {})})
    if not math.isfinite(result["val_loss"]):
        raise stopped(f"the validation loss is {result['val_loss']} at step {step}", run_dir)
    parts = [f.format(result[k]) for k, f in VALIDATION_FORMATS.items() if k in result]
    read = f" ({len(batches)} of {len(data.val_batches)} batches)" if part else ""
    log.say(f"step {step}: val loss{read} {result['val_loss']:.4f}, " + ", ".join(parts))
    return result["val_loss"]


def save(
    model,
    optimizer,
    data: DataSource,
    cfg: Config,
    dist: Dist,
    log: RunLog,
    step: int,
    budget,
    average: WeightAverage | None,
):
    """Save the resumable checkpoint and the model export, with the run's settings and tokenizer.
    A train.max_minutes run also saves the wall seconds `budget` has spent, over all processes.
    A resumed budget goes on from there."""
    run_dir = Path(cfg.train.out_dir)
    # The model export adds the model's own settings.
    settings = {k: v for k, v in cfg.to_dict().items() if k != "model"}
    if cfg.train.max_minutes:
        settings["train"]["spent_s"] = round(budget.spent(), 3)
    keep = cfg.checkpoint.keep
    save_checkpoint(
        run_dir, step, model, optimizer, data.loader, dist, settings, data.tokenizer, keep, average
    )
    log.say(f"step {step}: saved checkpoint {checkpoints(run_dir)[-1]}")


def with_length(cfg: Config, max_steps: int, decay_start: int | None) -> Config:
    """cfg, running for max_steps steps, a wsd schedule decaying from decay_start."""
    train, optim = (
        replace(cfg.train, max_steps=max_steps),
        replace(cfg.optim, decay_start=decay_start),
    )
    return replace(cfg, train=train, optim=optim)


def train(cfg: Config, resume: bool, dist: Dist, started: float):
    """Train cfg from scratch or from train.out_dir's latest checkpoint: log, evaluate and save."""
    run_dir = Path(cfg.train.out_dir)
    # Settle the config that runs. The model is as train.init_from leaves it, which resume_point
    # checks. The length is what a train.max_minutes budget allows.
    init, model_args = init_from_weights(cfg)
    cfg = replace(cfg, model=model_args)
    start = resume_point(run_dir, cfg.model, resume, cfg.to_dict())
    max_steps, decay_start, budget = run_length(cfg, start, started)
    cfg = with_length(cfg, max_steps, decay_start)
    data = data_source(cfg, dist)
    if cfg.train.epochs:  # The data's size decides the length.
        max_steps, warmup, sized = epoch_length(cfg, data.loader)
        cfg = with_length(
            replace(cfg, optim=replace(cfg.optim, warmup_steps=warmup)), max_steps, None
        )
        if start is not None:
            steps_left(start, max_steps, f"{sized} in all", "train.epochs")
    interim = len(spread(data.val_batches, cfg.eval.interim_batches))
    budget.evaluations(interim, len(data.val_batches), dist.world_size)
    if start is not None and data.tokenizer is not None:
        check_tokenizer(start, data.tokenizer)
    seed_everything(cfg.train.seed)
    # A resumed run loads its checkpoint instead.
    model, optimizer, sizes = build_model(cfg, dist, None if start else init)
    fine_tune = init is not None and start is None
    del init  # Copied into the model. Free its memory for training.
    average = WeightAverage(model, cfg.train.weight_average) if cfg.train.weight_average else None
    if start is not None:
        step = load_checkpoint(start, model, optimizer, data.loader, dist, average)
    else:
        step = 0
    log = RunLog(cfg, run_dir, step, cfg.train.max_steps if budget.decided else None, dist.main)
    resuming = f"; resuming at step {step}" if start else ""
    # The first step waits for the compiler. Say so, or the run looks stuck.
    compiling = "; compiling its first step (~30 s the first time)" if cfg.train.compile else ""
    log.say(f"model: {sizes}; {data.line}; device {dist.device}{compiling}{resuming}")
    if note := given_up(cfg.model):
        log.say(note)
    if fine_tune or (start and cfg.train.early_stop):  # Measure where it starts from.
        with budget.timed("eval", final=True), averaged(average):
            loss = validate(model, data, log, step, run_dir)
        log.held_out.note(step, loss, saved=not fine_tune)
    if cfg.train.epochs:
        log.pace = Pace(sized, cfg, step, sum(len(batch[0]) for batch in data.val_batches))
    with cpu_training_attention(dist.device):
        run_steps(cfg, model, optimizer, data, log, dist, step, budget, average)
    log.close()


def decide_length(
    cfg: Config, budget: Budget, step: int, model, data: DataSource, log: RunLog, dist: Dist, clock
) -> Config:
    """cfg with the train.max_steps and optim.decay_start that the budget decides at `step`, if it
    does. Every rank gets the same."""
    if budget.batch_steps is None:
        with clock.paused():  # Timing an evaluation is not training time.
            budget.time_evaluation(model, data.val_batches[:3], dist)
    decision = budget.decide(step, model, dist, (cfg.train.max_steps, cfg.optim.decay_start))
    if decision is None:
        return cfg
    max_steps, decay_start, line = decision
    log.sized(step, max_steps, line)
    return with_length(cfg, max_steps, decay_start)


def run_steps(
    cfg: Config,
    model,
    optimizer,
    data: DataSource,
    log: RunLog,
    dist: Dist,
    step: int,
    budget,
    average: WeightAverage | None,
):
    """Train from `step` to train.max_steps or an early stop, logging, evaluating and saving when
    due. Until `budget` has decided train.max_steps, it may do so at any step."""
    t = cfg.train  # Settings that stay. train.max_steps may change.
    run_dir = Path(t.out_dir)
    peak = peak_flops(dist.device, t.peak_tflops)
    peak = peak * dist.world_size if peak else None
    tokens = t.batch_size * t.seq_len
    clock = Throughput(tokens, flops_per_token(model, t.seq_len), peak, dist.device)
    # Every rank draws the same global batch and keeps its own rows. So the data never depends on
    # the number of ranks.
    share = t.batch_size // dist.world_size
    rows = slice(dist.rank * share, (dist.rank + 1) * share)
    cores = CoreShare(dist.device)
    while step < cfg.train.max_steps and not log.held_out.stopped:
        if note := cores.check():
            log.say(note)
        lr = lr_at(step, cfg)
        set_weight_decay(optimizer, weight_decay_at(step, cfg))
        x, y, inputs, targets = next_rows(data.loader, cfg, rows, dist.device)
        losses, grad_norm, applied = train_step(
            model, optimizer, x, y, lr, cfg, dist, inputs, targets
        )
        if not applied:
            # A NaN or infinity. Every rank skipped the update. Stop, naming the last checkpoint.
            loss = dist.mean(losses["loss"])
            problem = f"the loss is {loss} (gradient norm {grad_norm.item()}) at step {step + 1}"
            raise stopped(f"{problem}; training stopped before applying that update", run_dir)
        step += 1
        clock.steps += 1
        log.stepped(step)
        if average is not None:
            average.update(step, decay_start(cfg) if cfg.optim.schedule == "wsd" else 0)
        if budget.step_done(step):
            cfg = decide_length(cfg, budget, step, model, data, log, dist, clock)
        last = cfg.train.max_steps
        if due(step, t.log_interval, last):
            log_step(log, step, lr, losses, grad_norm, clock, dist)
        evaluating = due(step, cfg.eval.interval, last)
        saving = due(step, cfg.checkpoint.interval, last)
        if evaluating or saving:
            with clock.paused():  # Tokens/s and MFU count training time alone.
                if evaluating:
                    interim = 0 if step == last else cfg.eval.interim_batches
                    with budget.timed("eval", final=not interim), averaged(average):
                        loss = validate(model, data, log, step, run_dir, interim)
                    saving = log.held_out.saves(step, loss, last, saving)
                if saving:  # The weights, and the average as the exported model.
                    with budget.timed("save"):
                        save(model, optimizer, data, cfg, dist, log, step, budget, average)


# ---------------------------------------------------------------- the command


def print_sample(cfg: Config, device: torch.device):
    """Print a sample from the saved run. generate.py makes it in its own process, since no script
    imports another."""
    t = cfg.train
    flags = f"--run {t.out_dir} --max-new-tokens {t.sample_tokens} --top-k 200 --seed {t.seed}"
    prompt = ["--prompt", t.sample_prompt] if t.sample_prompt else []
    generate = [sys.executable, str(REPO_ROOT / "generate.py")]
    command = [*generate, *flags.split(), "--device", device.type, *prompt]
    print("---- sample ----", flush=True)
    try:
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted while sampling; the run is complete in {t.out_dir}"
        ) from None
    print("----------------")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if result.returncode:
        status = f"exit status {result.returncode}"
        problem = errors[-1].removeprefix("error: ") if errors else status
        raise UserError(
            f"generate.py could not sample from {t.out_dir} ({problem}); the run is complete"
        )
    print(result.stderr, end="", file=sys.stderr)


def interruption(run_dir: Path) -> str:
    """What an interrupted training says: where --resume continues, if anywhere."""
    found = checkpoints(run_dir)
    if not found:
        return (
            "interrupted before the first checkpoint; nothing to resume (run again to start over)"
        )
    return f"interrupted; --resume continues from step {int(found[-1].name[5:])} ({found[-1]})"


def main(argv: list[str]) -> int:
    started = time.perf_counter()  # A train.max_minutes budget counts from here.
    cfg, resume = parse_cli(argv, __doc__)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_config(cfg, world_size)
    check_dataset(cfg)
    check_packing(cfg)
    check_memory(cfg, world_size)
    check_out_dir(cfg)
    check_wandb(cfg)
    run_dir = Path(cfg.train.out_dir)
    if cfg.train.compile:
        check_compiler()
    keep_freed_memory()
    # One writer per run directory. Rank 0 holds the lock for the whole job.
    with exclusive(run_dir) if os.environ.get("RANK", "0") == "0" else nullcontext():
        dist = Dist(cfg.train.device)
        try:
            train(cfg, resume, dist, started)
        except BaseException as e:
            # The failed frames hold the model and optimizer. They must go before close().
            traceback.clear_frames(e.__traceback__)
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
                raise Interrupted(interruption(run_dir)) from None
            raise
        finally:
            dist.close()
    if dist.main:
        tokenizer = tokenizer_file(run_dir) if cfg.data.task == "text" else None
        files = f", {tokenizer.name}" if tokenizer else ""
        if cfg.train.sample_tokens:
            print_sample(cfg, dist.device)
        print(
            f"done: the model is in {run_dir} (model.safetensors, config.json{files}); metrics in "
            f"{run_dir / 'metrics.jsonl'}; resumable state in {run_dir / 'train_state'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
