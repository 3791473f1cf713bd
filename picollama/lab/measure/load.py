"""train.py's minute budget on a busy machine: the wall time against the budget, and the tokens
each CPU-second buys, with busy processes beside the run and without.

The load is external: --hogs processes that spin on a core each, started before train.py and
stopped after it. Each way sets train.py's threads as a user could:
- adapt: no thread count given, so train.py follows the free cores (picollama.device.CoreShare).
- spin: OMP_NUM_THREADS = the cores, with libgomp's default wait, which spins. This was the
  default before CoreShare.
- passive: OMP_NUM_THREADS = the cores, and OMP_WAIT_POLICY=PASSIVE, so a waiting thread sleeps."""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import comma_list, positive
from picollama.config.training import parse_cli
from picollama.lab.bench import common

CORES = len(os.sched_getaffinity(0))
WAYS = ("adapt", "spin", "passive")
HOG = "while True: pass"
NOTES = ("CPU threads", "budget", "the machine slowed")  # train.py's lines kept in the results
# --smoke: a tiny model for 12 seconds of budget beside one hog.
SMOKE_MODEL = [
    *("--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--train.batch_size=2"),
    *("--train.seq_len=32", "--eval.batches=1", "--eval.batch_size=2", "--train.compile=false"),
    *("--train.sample_tokens=0", "--eval.interval=0", "--checkpoint.interval=0"),
]


def environment(way: str) -> dict:
    """train.py's environment for `way`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if way != "adapt":
        env["OMP_NUM_THREADS"] = str(CORES)
    if way == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def hogs(count: int) -> list[subprocess.Popen]:
    """`count` processes that spin until stopped."""
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]):
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def train(args, way: str, hogs_count: int, out_dir: Path) -> dict:
    """One train.py run, timed as a whole process beside `hogs_count` hogs."""
    command = [sys.executable, "train.py", "--config", args.config, f"--train.out_dir={out_dir}"]
    command += [f"--train.max_minutes={args.minutes}"] if args.minutes else []
    command += SMOKE_MODEL if args.smoke else []
    busy = hogs(hogs_count)
    try:
        cpu, begin = children_cpu_s(), time.perf_counter()
        done = subprocess.run(
            command, cwd=common.REPO_ROOT, env=environment(way), stdout=subprocess.PIPE, text=True
        )
        wall, cpu = time.perf_counter() - begin, children_cpu_s() - cpu  # The hogs still run.
    finally:
        stop(busy)
    if done.returncode != 0:
        last = done.stdout[-500:]
        raise UserError(f"train.py failed ({way}, {hogs_count} hogs); its output ends: {last}")
    return summary(out_dir / "metrics.jsonl", wall, cpu, done.stdout)


def children_cpu_s() -> float:
    """The CPU seconds of this process's finished children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(metrics: Path, wall: float, cpu: float, output: str) -> dict:
    """What one run did: its wall time, steps, tokens/s, final bits/byte and thread notes."""
    entries = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [e["tokens_per_s"] for e in entries if "tokens_per_s" in e][1:]  # after the compile
    final = [e for e in entries if "val_bpb" in e]
    return {
        "wall_s": round(wall, 1),
        "steps": max((e["step"] for e in entries if "loss" in e), default=0),
        "tokens_per_s": round(sum(rates) / len(rates)) if rates else None,
        "cpu_s": round(cpu, 1),
        "val_bpb": round(final[-1]["val_bpb"], 4) if final else None,
        "notes": [line for line in output.splitlines() if line.startswith(NOTES)],
    }


def parse_args(argv: list[str]):
    p = common.parser(__doc__.splitlines()[0], "load", models=False)
    p.add_argument("--config", default="configs/default.toml", help="train.py's config")
    p.add_argument(
        "--hogs", type=positive(), default=2 * CORES, help=f"busy processes (default {2 * CORES})"
    )
    p.add_argument(
        "--ways",
        type=comma_list(choices=WAYS),
        default="adapt",
        help=f"comma-separated: {', '.join(WAYS)}",
    )
    p.add_argument(
        "--minutes", type=positive(float), help="the budget (default: the config's max_minutes)"
    )
    p.add_argument("--idle", action="store_true", help="also run each way with no hogs")
    args = common.parse(p, argv)
    if args.smoke:
        args.minutes, args.hogs = 0.1, 1
    cfg, _ = parse_cli(["--config", args.config])
    args.minutes = args.minutes or cfg.train.max_minutes
    if not args.minutes:
        raise UserError(f"{args.config} sets no train.max_minutes: give --minutes")
    return args


def report(runs: list[dict], budget_s: float):
    rows = []
    for r in runs:
        per_cpu = r["tokens_per_s"] * r["wall_s"] / r["cpu_s"] if r["cpu_s"] else None
        share = r["wall_s"] / budget_s
        rows.append([r["way"], r["hogs"], r["wall_s"], f"{share:.2f}x", r["steps"]])
        rows[-1] += [r["tokens_per_s"], r["cpu_s"], per_cpu and round(per_cpu), r["val_bpb"]]
    headers = ["way", "hogs", "wall s", "of budget", "steps", "tokens/s", "CPU s"]
    common.print_table([*headers, "tokens/CPU-s", "bits/byte"], rows)


@common.one_writer
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    plan = [(way, hogs) for way in args.ways for hogs in ([0] if args.idle else []) + [args.hogs]]
    runs = []
    with tempfile.TemporaryDirectory(prefix="picollama-load-") as tmp:
        for n, (way, hogs_count) in enumerate(tqdm(plan, desc="runs", unit="run")):
            run = train(args, way, hogs_count, Path(tmp) / f"run{n}")
            runs.append({"way": way, "hogs": hogs_count, **run})
    budget_s = args.minutes * 60
    report(runs, budget_s)
    common.write_results(
        args, {"config": args.config, "budget_s": budget_s, "cores": CORES, "runs": runs}
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
