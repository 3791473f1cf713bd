"""The retrieval study: every position encoding trained on the synthetic retrieval task (configs/retrieval.toml) and
compared past the training context, side by side (`python generate.py study`)."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from tqdm import tqdm

import extrapolate
from cli import ArgumentParser, UserError, add_device, add_out, atomic_output, check_writable, comma_list, positive
from extrapolation_report import side_by_side_plot, table

REPO_ROOT = Path(__file__).resolve().parent
CONFIG = "configs/retrieval.toml"
FINE_TUNE = 4  # the YaRN run: the RoPE run fine-tuned at this multiple of its context

# (run name, what it is, train.py overrides): the RoPE run comes first, the fine-tune starts from it
RUNS = [
    ("rope", "RoPE", []),
    ("alibi", "ALiBi", ["--model.position=alibi"]),
    ("nope", "NoPE", ["--model.position=nope"]),
    ("sinusoidal", "sinusoidal", ["--model.position=sinusoidal"]),
    ("learned", "learned", ["--model.position=learned"]),
    ("rope-random", "RoPE + random positions (16×)", ["--train.random_positions=16"]),
    ("rope-logn", "RoPE + log-n attention", ["--model.logn_attention=true"]),
    ("rope-yarn", f"RoPE fine-tuned at {FINE_TUNE}× with YaRN", None),  # overrides: fine_tune()
]
# --quick: just past the step where RoPE leaves the 1/pairs plateau (300-400 steps; 93% at 400), no validation on the
# way, fewer evaluation rows and fine-tuning steps: the whole pipeline in a test's time
QUICK = ["--train.max_steps=400", "--eval.interval=0"]
QUICK_ROWS, FULL_ROWS = 32, 128


def fine_tune(out: Path, context: int, quick: bool) -> list[str]:
    """The overrides of the YaRN fine-tune: the RoPE run's weights at FINE_TUNE × its context."""
    length = FINE_TUNE * context
    steps = 30 if quick else 150
    return [
        f"--train.init_from={out / 'rope'}",
        f"--train.seq_len={length}",
        f"--model.max_seq_len={length}",
        "--model.rope_scaling=yarn",
        f"--model.rope_factor={FINE_TUNE}",
        f"--train.batch_size={16 if quick else 32}",
        f"--train.max_steps={steps}",
        f"--optim.warmup_steps={steps // 10}",
    ]


def train_run(name: str, overrides: list[str], out: Path) -> dict:
    """Train one run with `python train.py` on one thread (its output in OUT/logs/NAME.log): wall and CPU seconds,
    and its last validation accuracy (metrics.jsonl); UserError naming the log's last line when training fails."""
    log = out / "logs" / f"{name}.log"
    command = [sys.executable, "train.py", "--config", CONFIG, f"--train.out_dir={out / name}", *overrides]
    start = time.perf_counter()
    # one thread a run, runs side by side: tiny models gain nothing from a second thread, and lose much to a busy one
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stream:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=stream, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        lines = log.read_text().strip().splitlines() or ["(no output)"]
        raise UserError(f"training {name} failed (exit {process.returncode}): {lines[-1]} (see {log})")
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    accuracy = [m["val_acc"] for m in metrics if "val_acc" in m]
    return {
        "command": ["python", "train.py", *command[2:]],
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "steps": max((m["step"] for m in metrics if "step" in m), default=0),
        "val_acc": accuracy[-1] if accuracy else None,
    }


def train_all(runs: list[tuple], out: Path, args, device: list[str]) -> dict:
    """Train the runs, args.jobs at a time (the fine-tune once the RoPE run is done): {name: train_run's numbers}."""
    futures = {}
    common = (QUICK if args.quick else []) + ([f"--train.max_steps={args.steps}"] if args.steps else [])

    def one(name: str, overrides: list[str] | None) -> dict:
        if overrides is None:
            futures["rope"].result()  # submitted first, so running or done by now: no deadlock
            overrides = fine_tune(out, trained_context(out / "rope"), args.quick)
        return train_run(name, common + overrides + device, out)

    with ThreadPoolExecutor(args.jobs) as pool, tqdm(total=len(runs), desc="retrieval study", unit="run") as bar:
        for name, _, overrides in runs:
            futures[name] = pool.submit(one, name, overrides)
        for future in as_completed(futures.values()):
            future.result()  # the first failure ends the study (the pool finishes the runs under way)
            bar.update()
    return {name: future.result() for name, future in futures.items()}


def add_arguments(parser: ArgumentParser):
    """The flags of `python generate.py study` (generate.py builds the parser; main() here builds its own)."""
    parser.description = (
        "The retrieval study: RoPE, ALiBi, NoPE, sinusoidal and learned positions, RoPE with random positions, with "
        f"log-n attention and fine-tuned with YaRN, trained on the synthetic retrieval task ({CONFIG}) and compared "
        "at 1-16× their context."
    )
    add_out(parser, "output directory (default out/retrieval-study)", default=Path("out/retrieval-study"))
    parser.add_argument("--quick", action="store_true", help="400 steps a run, fewer evaluation rows: a smoke test")
    names = [name for name, _, _ in RUNS]
    parser.add_argument("--runs", type=comma_list(choices=names), help="a subset of: " + ",".join(names))
    parser.add_argument(
        "--beside", type=Path, help="a text study's extrapolation.json: its perplexity beside retrieval"
    )
    parser.add_argument("--steps", type=positive(), help="training steps of each base run (default: the config's)")
    parser.add_argument(
        "--jobs", type=positive(), default=2, help="runs trained side by side, one thread each (default 2)"
    )
    add_device(parser)


def chosen_runs(names: list[str] | None) -> list[tuple]:
    if names is None:
        return RUNS
    if "rope-yarn" in names and "rope" not in names:
        raise UserError("--runs: rope-yarn is fine-tuned from rope; name rope too")
    return [run for run in RUNS if run[0] in names]


def summary(runs: list[tuple], trained: dict, report: dict, out: Path, seconds: float) -> str:
    """The study's Markdown: what each run is and cost, then the comparison."""
    rows = [
        [f"`{name}`", what, str(t["steps"]), f"{t['val_acc']:.1%}" if t["val_acc"] is not None else "-"]
        + [f"{t['wall_s']:.0f}", f"{t['cpu_s'] / 60:.1f}"]
        for (name, what, _), t in ((run, trained[run[0]]) for run in runs)
    ]
    header = ["run", "what", "steps", "val accuracy", "train wall s", "train CPU min"]
    lines = [
        f"# The retrieval study ({seconds / 60:.1f} min)",
        "",
        f"Each run: `python train.py --config {CONFIG}` with its overrides (study.json has the commands).",
        "",
        *table(header, rows),
        "",
        (out / "compare" / "extrapolation.md").read_text().replace("# ", "## ", 1),
    ]
    return "\n".join(lines)


def run(args) -> int:
    """The `study` command, on parsed flags (add_arguments)."""
    runs, out = chosen_runs(args.runs), Path(args.out)
    beside = json.loads(args.beside.read_text()) if args.beside else None
    check_writable(out / "study.json")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trained = train_all(runs, out, args, ["--device", args.device, "--dtype", args.dtype])
    compare = ["--run", ",".join(str(out / name) for name, _, _ in runs), "--out", str(out / "compare")]
    compare += ["--retrieval-rows", str(QUICK_ROWS if args.quick else FULL_ROWS)]
    compare += ["--device", args.device, "--dtype", args.dtype]
    flags = ArgumentParser(prog="python generate.py extrapolate")
    extrapolate.add_arguments(flags)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in training: a tiny model gains little from 2 threads, and loses much to a busy CPU
    try:
        extrapolate.run(flags.parse_args(compare), ["extrapolate", *compare])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "compare" / "extrapolation.json").read_text())
    seconds = time.perf_counter() - started
    with atomic_output(out / "study.json") as json_path, atomic_output(out / "study.md") as md_path:
        json_path.write_text(json.dumps({"quick": args.quick, "seconds": round(seconds, 1), "runs": trained}) + "\n")
        md_path.write_text(summary(runs, trained, report, out, seconds))
    if beside is not None:
        with atomic_output(out / "study.png") as png_path:
            side_by_side_plot(beside, report, png_path)
    figure = f", {out}/study.png" if beside is not None else ""
    print(f"wrote {out}/study.md, study.json{figure}, the runs in {out}/NAME and the comparison in {out}/compare")
    return 0


def main(argv: list[str]) -> int:
    """The `study` command on its own argv (what follows `python generate.py study`)."""
    parser = ArgumentParser(prog="python generate.py study")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def trained_context(run_dir: Path) -> int:
    return json.loads((run_dir / "config.json").read_text())["train"]["seq_len"]
