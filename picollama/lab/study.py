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

from picollama import REPO_ROOT
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_device,
    add_out,
    atomic_output,
    check_writable,
    comma_list,
    positive,
)
from picollama.lab import extrapolate
from picollama.lab.report import side_by_side_plot, table

CONFIG = "configs/retrieval.toml"
FINE_TUNE = 4  # the YaRN run: the RoPE run fine-tuned at this multiple of its context

# (run name, what it is, train.py overrides): the RoPE run comes first, the fine-tune starts from it. Every run trains
# configs/retrieval.toml's recipe; where an encoding needs another to reach >= 90% in context (measured, README), its
# overrides say what and why
RUNS = [
    ("rope", "RoPE", []),
    # 2 heads give ALiBi slopes 1/16 and 1/256 only, too flat to single out the previous token (69-71% at 800-1,400
    # steps); with 4, 1/4 .. 1/256 (86-91% from step 700 on a constant lr)
    ("alibi", "ALiBi (4 heads)", ["--model.position=alibi", "--model.n_heads=4"]),
    # NoPE finds positions from the causal mask alone: 1 head learns faster than 2 (76% against 60% at step 900) or 4
    # (22% at 800). Validation rows have filler between keys and queries, which training rows lacked: a quarter of the
    # training slots after the key block as filler, 80% against 74% at 1,500 steps (15%: 79%, half: 15%). It then
    # plateaued short of 90% (83% at dim 128, lr held or 2,000 steps: 80%) until QK-norm (its learned gains plausibly
    # sharpen the attention faster): 91% at dim 64 (2 heads: 83%), 95% at dim 80 (one thread each, two at a time: 122 s)
    (
        "nope",
        "NoPE (1 head, QK-norm, dim 80, 25% filler)",
        [
            "--model.position=nope",
            "--model.n_heads=1",
            "--model.qk_norm=true",
            "--model.dim=80",
            "--data.retrieval_filler=0.25",
        ],
    ),
    # on AdamW the sinusoid sat on the 1/pairs plateau (24-25%) to 2,500 steps, with model.py's √dim token scale too,
    # and 4 heads or lr 3e-4 did not help; Muon's orthogonalised updates leave it by step 300 (96%), 3× the CPU a step
    (
        "sinusoidal",
        "sinusoidal (Muon, 600 steps)",
        ["--model.position=sinusoidal", "--optim.name=muon", "--train.max_steps=600"],
    ),
    # learned positions leave the 1/pairs plateau late (~step 1,300 of 1,500 on this decay): 2,000 steps, 91% from 1,600
    # (2,500 steps gave no more and took 196 s, over the 3-minute aim)
    ("learned", "learned (2,000 steps)", ["--model.position=learned", "--train.max_steps=2000"]),
    # positions from 4× the context: at 16× the gap between neighbouring tokens averages 16, the previous token sits at
    # any offset up to ~60, and training stayed near 50%; at 4× it reached 94-96% from step 700
    ("rope-random", "RoPE + random positions (4×)", ["--train.random_positions=4"]),
    ("rope-logn", "RoPE + log-n attention", ["--model.logn_attention=true"]),
    ("rope-yarn", f"RoPE fine-tuned at {FINE_TUNE}× with YaRN", None),  # overrides: fine_tune()
]
# every run of the study, beyond the config's 800 steps on a constant lr (RoPE's recipe, ~100% by step 500): 1,500 steps
# with a cosine decay to 1e-4, for the encodings that leave the plateau later and then wander by a few points on a
# constant lr (ALiBi 4 heads: 85-91% from step 1,000 to 1,400); RoPE still reads 100% (about 1.7 CPU-minutes a run)
STUDY = ["--train.max_steps=1500", "--optim.min_lr=1e-4"]
# --quick: just past the step where RoPE leaves the 1/pairs plateau (300-400 steps; 93% at 400 on a constant lr of
# 1e-3), no validation on the way, fewer evaluation rows, lengths to 4× and fewer fine-tuning steps: the whole
# pipeline in a test's time
QUICK = ["--train.max_steps=400", "--optim.min_lr=1e-3", "--eval.interval=0"]
QUICK_ROWS, FULL_ROWS = 32, 128
QUICK_MULTIPLES = (1, 2, 4)  # of the context, where the full study scores extrapolate's 1-16×


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
    command = [
        sys.executable,
        "train.py",
        "--config",
        CONFIG,
        f"--train.out_dir={out / name}",
        *overrides,
    ]
    start = time.perf_counter()
    # one thread a run, runs side by side: tiny models gain nothing from a second thread, and lose much to a busy one
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stream:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=stream, stderr=subprocess.STDOUT, env=env
        )
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        lines = log.read_text().strip().splitlines() or ["(no output)"]
        raise UserError(
            f"training {name} failed (exit {process.returncode}): {lines[-1]} (see {log})"
        )
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
    # a run's own recipe over the study's, --quick and --steps over both, the fine-tune's steps over everything
    last = (QUICK if args.quick else []) + (
        [f"--train.max_steps={args.steps}"] if args.steps else []
    )

    def one(name: str, overrides: list[str] | None) -> dict:
        if overrides is None:
            futures["rope"].result()  # submitted first, so running or done by now: no deadlock
            flags = STUDY + last + fine_tune(out, trained_context(out / "rope"), args.quick)
        else:
            flags = STUDY + overrides + last
        return train_run(name, flags + device, out)

    with (
        ThreadPoolExecutor(args.jobs) as pool,
        tqdm(total=len(runs), desc="retrieval study", unit="run") as bar,
    ):
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
    add_out(
        parser,
        "output directory (default out/retrieval-study)",
        default=Path("out/retrieval-study"),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="400 steps a run, fewer rows, lengths to 4×: a smoke test",
    )
    names = [name for name, _, _ in RUNS]
    parser.add_argument(
        "--runs", type=comma_list(choices=names), help="a subset of: " + ",".join(names)
    )
    parser.add_argument(
        "--beside",
        type=Path,
        help="a text study's extrapolation.json: its perplexity beside retrieval",
    )
    parser.add_argument(
        "--steps",
        type=positive(),
        help="training steps of each base run (default 1500; sinusoidal 600, learned 2000)",
    )
    parser.add_argument(
        "--jobs",
        type=positive(),
        default=2,
        help="runs trained side by side, one thread each (default 2)",
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
        [
            f"`{name}`",
            what,
            str(t["steps"]),
            f"{t['val_acc']:.1%}" if t["val_acc"] is not None else "-",
        ]
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
    compare = [
        "--run",
        ",".join(str(out / name) for name, _, _ in runs),
        "--out",
        str(out / "compare"),
    ]
    compare += ["--retrieval-rows", str(QUICK_ROWS if args.quick else FULL_ROWS)]
    if args.quick:
        context = trained_context(out / runs[0][0])
        compare += ["--lengths", ",".join(str(context * k) for k in QUICK_MULTIPLES)]
    compare += ["--device", args.device, "--dtype", args.dtype]
    flags = ArgumentParser(prog="python generate.py extrapolate")
    extrapolate.add_arguments(flags)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as in training: a tiny model gains little from 2 threads, and loses much to a busy CPU
    try:
        extrapolate.run(flags.parse_args(compare), ["extrapolate", *compare])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "compare" / "extrapolation.json").read_text())
    seconds = time.perf_counter() - started
    with atomic_output(out / "study.json") as json_path, atomic_output(out / "study.md") as md_path:
        json_path.write_text(
            json.dumps({"quick": args.quick, "seconds": round(seconds, 1), "runs": trained}) + "\n"
        )
        md_path.write_text(summary(runs, trained, report, out, seconds))
    if beside is not None:
        with atomic_output(out / "study.png") as png_path:
            side_by_side_plot(beside, report, png_path)
    figure = f", {out}/study.png" if beside is not None else ""
    print(
        f"wrote {out}/study.md, study.json{figure}, the runs in {out}/NAME and the comparison in {out}/compare"
    )
    return 0


def main(argv: list[str]) -> int:
    """The `study` command on its own argv (what follows `python generate.py study`)."""
    parser = ArgumentParser(prog="python generate.py study")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def trained_context(run_dir: Path) -> int:
    return json.loads((run_dir / "config.json").read_text())["train"]["seq_len"]
