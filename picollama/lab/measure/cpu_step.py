"""train.py's training step on a CPU, with our CPU kernels and with PyTorch's.

Ours are training/cpu_attention.py's written-out attention and training/muon.py's batched Muon.
PyTorch's are flash attention and torch.optim.Muon. Both arms train the default config's model
and optimizer in one process, with steps interleaved in chunks."""

import statistics
import sys
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.config.training import parse_cli
from picollama.device import Dist, check_compiler, keep_freed_memory
from picollama.lab.bench import common
from picollama.training.cpu_attention import cpu_training_attention
from picollama.training.huge_pages import malloc_huge_pages
from picollama.training.optim import Optimizers
from picollama.training.step import build_model, seed_everything, train_step

ARMS = ("pytorch's", "picollama's")  # The kernels each arm's steps run with.


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "cpu_step")
    p.add_argument("--chunks", type=positive(), default=8, help="chunks of each arm (default 8)")
    p.add_argument("--steps", type=positive(), default=10, help="steps a chunk (default 10)")
    p.add_argument("--no-compile", action="store_true", help="eager blocks and loss")
    return common.parse(p, argv)


def with_torch_muon(optimizer: Optimizers) -> Optimizers:
    """The optimizer with torch.optim.Muon over BatchedMuon's matrices, its settings alike."""
    batched, adamw = optimizer
    group = batched.param_groups[0]
    settings = {key: group[key] for key in ("lr", "weight_decay", "momentum")}
    muon = torch.optim.Muon(group["params"], **settings)
    muon.param_groups[0]["lr_scale"] = group["lr_scale"]
    return Optimizers([muon, adamw])


def step_of(cfg, dist: Dist, arm: str):
    """A training step of a fresh default model (seed 0) on random tokens with the arm's kernels."""
    seed_everything(0)
    model, optimizer, _ = build_model(cfg, dist)
    if arm == ARMS[0]:
        optimizer = with_torch_muon(optimizer)
    shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        kernels = cpu_training_attention(dist.device) if arm == ARMS[1] else nullcontext()
        with kernels:
            train_step(model, optimizer, x, y, cfg.optim.lr, cfg, dist)

    return step


def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, _ = common.setup(cli)
    if device.type != "cpu":
        raise UserError(f"device {cli.device!r}: this benchmark measures a CPU's step; use cpu")
    keep_freed_memory()  # As train.py runs.
    overrides = [f"--train.compile={'false' if cli.no_compile else 'true'}"]
    if cli.smoke:
        overrides += [f"--model.{k}={v}" for k, v in common.SMOKE.items() if k != "max_seq_len"]
        overrides += ["--train.seq_len=32", "--model.max_seq_len=32"]
        cli.chunks, cli.steps = 2, 2
    cfg, _ = parse_cli(overrides)
    if cfg.train.compile:
        check_compiler()
    dist = Dist("cpu")
    steps = {arm: step_of(cfg, dist, arm) for arm in ARMS}
    for step in steps.values():  # The compiles, and a first step.
        step()
    seconds = {arm: [] for arm in ARMS}
    for _ in tqdm(range(cli.chunks), desc="chunks", disable=None):
        for arm, step in steps.items():
            start = time.perf_counter()
            for _ in range(cli.steps):
                step()
            seconds[arm].append((time.perf_counter() - start) / cli.steps)
    return report(cli, cfg, seconds)


def report(cli, cfg, seconds: dict) -> int:
    tokens = cfg.train.batch_size * cfg.train.seq_len
    ms = {arm: 1000 * statistics.median(s) for arm, s in seconds.items()}
    rows = [[arm, ms[arm], tokens / ms[arm] * 1000] for arm in ARMS]
    common.print_table(["kernels", "median ms a step", "tokens/s"], rows)
    print(f"picollama's kernels: {ms[ARMS[0]] / ms[ARMS[1]]:.2f}x the tokens/s")
    results = {
        arm: {"ms_per_step": ms[arm], "chunk_ms": [1000 * s for s in seconds[arm]]} for arm in ARMS
    }
    common.write_results(
        cli,
        {
            "compiled": cfg.train.compile,
            "tokens_per_step": tokens,
            "steps_per_chunk": cli.steps,
            "speedup": ms[ARMS[0]] / ms[ARMS[1]],
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    malloc_huge_pages()  # As train.py starts.
    sys.exit(run_command(main))
