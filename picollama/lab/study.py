"""The retrieval study, run as `python generate.py study`.

It trains the runs of a recipe in configs/study/, one per position encoding. They train on the
synthetic retrieval task, or on text with configs/study/text.toml. Then it compares them past
their context, with one seed or several. Training runs in train.py processes. The comparison is
extrapolate.py's."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from data.build import prepare
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli import flags as cli
from picollama.cli.flags import comma_list, positive
from picollama.cli.outputs import atomic_output, check_writable, exclusive, resolved
from picollama.config.checks import check_config
from picollama.config.training import Config, parse_cli
from picollama.config.values import CHOICES
from picollama.lab import extrapolate
from picollama.lab.plots import pyplot, side_by_side_plot, text_report_problem
from picollama.lab.recipe import FINE_TUNE_KEYS, Recipe, Run, chosen_runs, load_recipe, seeded_runs
from picollama.lab.report import markdown_report, retrieval_markdown, table
from picollama.lab.runs import Options
from picollama.lab.seeds import seeds_markdown, seeds_summary
from picollama.lab.trainings import Trainings
from picollama.training.dataset import check_dataset

RECIPE = Path("configs/study/retrieval.toml")  # In the repository.


# ---------------------------------------------------------------- train.py's commands


def run_keys(recipe: Recipe, run: Run, args, configs: dict[str, Config], out: Path) -> dict:
    """The config keys one run trains with, each layer overriding the last.

    First come the study's keys, the run's, --quick's and the run's own --quick. Then --steps,
    except for a fine-tune. A fine-tune then gets its start (in `out`) and its context (from
    `from`'s config). Past the first seed, a run gets the first seed's value plus its offset."""
    keys = recipe.full.config_keys() | run.own.config_keys()
    if args.quick:
        keys |= recipe.quick.config_keys() | run.quick.config_keys()
    if run.source is None and args.steps:
        keys["train.max_steps"] = args.steps
    if run.source is not None:
        context = run.stretch * configs[run.source].train.seq_len
        keys["train.init_from"] = str(out / run.source)
        keys |= dict.fromkeys(FINE_TUNE_KEYS, context)
    if run.seed:
        keys["train.seed"] = configs[run.base].train.seed + run.seed
    return keys


def flag(key: str, value) -> str:
    """--section.key=VALUE, as train.py reads it back."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{key}={value}"


def seeds(recipe: Recipe, args) -> int:
    """How many seeds each run trains with: --seeds, else the recipe's, else 1."""
    return args.seeds or recipe.seeds


def plan(recipe: Recipe, args) -> tuple[dict[str, list[str]], dict[str, Config]]:
    """train.py's arguments and config for each run and seed of the recipe (seeded_runs).

    Configs are checked as train.py checks them, so a bad run fails here, before any training.
    Paths are absolute, because train.py runs in the repository, not the caller's folder."""
    commands, configs = {}, {}
    out, config = resolved(args.out), str(REPO_ROOT / recipe.config)
    for run in seeded_runs(recipe.runs, seeds(recipe, args)):
        keys = run_keys(recipe, run, args, configs, out)
        rest = [f"--train.out_dir={out / run.name}"]
        rest += [flag(key, value) for key, value in keys.items()]
        rest += ["--device", args.device, "--dtype", args.dtype]
        try:
            configs[run.name], _ = parse_cli(["--config", config, *rest])
            check_config(configs[run.name], 1)
        except UserError as e:
            raise UserError(f"run {run.name} of {recipe.path}: {e}") from None
        commands[run.name] = ["--config", config, *rest]
    return commands, configs


# ---------------------------------------------------------------- training and comparing


def train_run(name: str, command: list[str], out: Path, trainings: Trainings) -> dict:
    """Train one run with `python train.py COMMAND` on one thread.

    Its output goes to OUT/logs/NAME.log. Returns wall and CPU seconds and the last validation
    accuracy (metrics.jsonl). If training fails, a UserError quotes the log's last line."""
    # A process of its own, not train.train() here. Runs train side by side, and training holds
    # process-wide state. That is torch.distributed's default group, the global RNGs it seeds,
    # torch's thread count and stdout for its log. Its CPU seconds are then the child's own.
    log = out / "logs" / f"{name}.log"
    start = time.perf_counter()
    # One thread a run, with runs side by side. Tiny models gain nothing from a second thread,
    # and lose much to a busy one.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "x") as stream:  # Never another study's log. Run refuses a used --out.
        process = trainings.start(
            [sys.executable, "train.py", *command],
            cwd=REPO_ROOT,
            stdout=stream,
            stderr=subprocess.STDOUT,
            env=env,
        )
        _, status, usage = os.wait4(process.pid, 0)
        trainings.ended(process)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        lines = log.read_text().strip().splitlines() or ["(no output)"]
        raise UserError(
            f"training {name} failed (exit {process.returncode}): {lines[-1]} (see {log})"
        )
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    accuracy = [m["val_acc"] for m in metrics if "val_acc" in m]
    return {
        "command": ["python", "train.py", *command],
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "steps": max((m["step"] for m in metrics if "step" in m), default=0),
        "val_acc": accuracy[-1] if accuracy else None,
    }


def prepare_datasets(configs: dict[str, Config]):
    """Prepare each missing text dataset once, before the runs train side by side.

    Otherwise each run would start preparing it, and all but the first would fail on its lock."""
    missing = {}
    for cfg in configs.values():
        data_dir = resolved(REPO_ROOT / cfg.data.dir)  # train.py runs in the repository.
        if cfg.data.task == "text" and not (data_dir / "meta.json").is_file():
            missing.setdefault(data_dir, cfg)
    for data_dir, cfg in missing.items():
        check_dataset(replace(cfg, data=replace(cfg.data, dir=str(data_dir))))
        print(f"{data_dir} is not prepared yet: preparing it from {cfg.data.source}")
        vocab_size = cfg.data.vocab_size or cfg.model.vocab_size
        command = ["generate.py", "study"]
        prepare(cfg.data.source, vocab_size, data_dir, command=command, source_key="data.source")


def train_all(runs: list[Run], commands: dict[str, list[str]], out: Path, jobs: int) -> dict:
    """Train the runs, `jobs` at a time. Returns {name: train_run's numbers}.

    A fine-tune waits until the run it starts from is done. Ctrl-C, SIGTERM or a failed run ends
    it within seconds. No queued run starts, and the running ones are stopped (Trainings)."""
    futures = {}
    trainings = Trainings()

    def one(run: Run) -> dict:
        try:
            if run.source is not None:
                futures[run.source].result()  # Submitted earlier, so it cannot deadlock.
            return train_run(run.name, commands[run.name], out, trainings)
        except BaseException:
            trainings.stop()  # Here too, so this thread takes no next run.
            raise

    with ThreadPoolExecutor(jobs) as pool, tqdm(total=len(runs), desc="study", unit="run") as bar:
        try:
            for run in runs:
                futures[run.name] = pool.submit(one, run)
            for future in as_completed(futures.values()):
                future.result()  # The first failure ends the study.
                bar.update()
        except BaseException:
            trainings.stop()
            pool.shutdown(cancel_futures=True)  # Waits only for the stopped runs' threads.
            raise
    return {name: future.result() for name, future in futures.items()}


@contextmanager
def one_thread():
    """Run torch on one thread, as in training.

    A tiny model gains little from two threads, and loses much to a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def compare(recipe: Recipe, runs: list[Run], configs: dict[str, Config], args, out: Path) -> dict:
    """The extrapolation report of the trained runs side by side, written to OUT/compare."""
    chosen = recipe.quick if args.quick else recipe.full
    multiples = chosen.multiples or recipe.full.multiples
    context = min(configs[run.name].train.seq_len for run in runs)
    rows = chosen.rows or recipe.full.rows
    options = Options(
        lengths=[context * k for k in multiples],
        retrieval_rows=rows,
        device=args.device,
        dtype=args.dtype,
    )
    if configs[runs[0].name].data.task != "retrieval":  # A text recipe's rows are windows.
        options.num_windows = rows
        options.passkeys = chosen.passkeys or recipe.full.passkeys or 0
    names = [out / run.name for run in runs]
    compared = out / "compare"
    with one_thread():
        return extrapolate.extrapolation(names, compared, options, options.command(names, compared))


def summary(recipe: Recipe, runs: list[Run], trained: dict, report: dict, seconds: float) -> str:
    """The study's Markdown: what each run is and cost, then the comparison.

    With several seeds, the mean and spread across them come first."""
    rows = []
    for run in runs:
        numbers = trained[run.name]
        accuracy = numbers["val_acc"]
        rows.append(
            [f"`{run.name}`", run.what, str(numbers["steps"])]
            + [f"{accuracy:.1%}" if accuracy is not None else "-"]
            + [f"{numbers['wall_s']:.0f}", f"{numbers['cpu_s'] / 60:.1f}"]
        )
    header = ["run", "what", "steps", "val accuracy", "train wall s", "train CPU min"]
    retrieval = report.get("kind") == "retrieval"
    compared = retrieval_markdown(report) if retrieval else markdown_report(report)
    kind = "retrieval" if retrieval else "perplexity"
    lines = [
        f"# The {kind} study ({seconds / 60:.1f} min)",
        "",
        f"Each run: `python train.py --config {recipe.config}` with its overrides (study.json has "
        "the commands).",
        "",
        *table(header, rows),
        "",
        *seeds_markdown(report, seed_groups(runs)),
        compared.replace("# ", "## ", 1),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def seed_groups(runs: list[Run]) -> dict[str, list[str]]:
    """{the recipe's run name: the folder names of its seeds}, where some run has several."""
    groups = {}
    for run in runs:
        groups.setdefault(run.base, []).append(run.name)
    return groups if any(len(names) > 1 for names in groups.values()) else {}


def add_arguments(parser: cli.ArgumentParser):
    """The flags of `python generate.py study`.

    generate.py builds the parser. main() here builds its own."""
    parser.description = (
        "The retrieval study: the runs of a recipe (every position encoding, in "
        f"{RECIPE}) trained on the synthetic retrieval task and compared past their context."
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=REPO_ROOT / RECIPE,
        help=f"the study's runs and their settings (default {RECIPE}; configs/study/text.toml: "
        "the perplexity study)",
    )
    cli.add_out(
        parser, "output directory (default out/RECIPE-study: out/retrieval-study, out/text-study)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the recipe's [quick]: fewer steps, rows and lengths, a smoke test",
    )
    parser.add_argument(
        "--runs", type=comma_list(), help="a subset of the recipe's runs, comma-separated"
    )
    parser.add_argument(
        "--beside",
        type=comma_list(),
        help="text studies' extrapolation.json, comma-separated: their perplexity beside "
        "retrieval (a run named in several drawn from the last)",
    )
    parser.add_argument(
        "--steps",
        type=positive(),
        help="training steps of each run but fine-tunes (default: the recipe's)",
    )
    parser.add_argument(
        "--seeds",
        type=positive(),
        help="train each run with this many seeds (train.seed + 0, 1, ...; runs past the first "
        "in OUT/NAME-seedK) and report the mean and spread across them (default: the recipe's "
        "seeds, else 1)",
    )
    parser.add_argument(
        "--jobs",
        type=positive(),
        default=2,
        help="runs trained side by side, one thread each (default 2)",
    )
    cli.add_device(parser, "auto", CHOICES["train.device"], CHOICES["train.dtype"])  # As train.py.


def read_beside(path: Path) -> dict:
    """One of --beside's reports, checked as side_by_side_plot reads it.

    Anything but a text study's extrapolation.json is refused before any training."""
    what = f"--beside {path} must be a text study's extrapolation.json (generate.py extrapolate)"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read --beside {path}: {e.strerror or e}") from None
    except ValueError:  # JSON's errors and UnicodeDecodeError.
        raise UserError(f"{what}, not JSON") from None
    problem = text_report_problem(report)
    if problem is not None:
        raise UserError(f"{what}: {problem}")
    return report


def check_unused(out: Path):
    """UserError unless `out` is absent or an empty folder.

    A study writes study.json, logs/, compare/ and a folder per run into a folder of its own. So
    it never replaces another study's files, or anything else."""
    held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"--out {out} already holds {shown}: a study writes into a new or empty folder, "
            "and replaces nothing; choose another --out"
        )


def write_summary(out: Path, numbers: dict, markdown: str, beside: list | None, report: dict):
    """Write study.json, study.md and, with --beside, study.png in out."""
    with atomic_output(out / "study.json") as json_path, atomic_output(out / "study.md") as md_path:
        json_path.write_text(json.dumps(numbers) + "\n")
        md_path.write_text(markdown)
    if beside is not None:
        with atomic_output(out / "study.png") as png_path:
            side_by_side_plot(beside, [report], png_path)


def run(args) -> int:
    """The `study` command, on parsed flags (add_arguments)."""
    pyplot()  # Without matplotlib, fail now rather than after the training.
    recipe = load_recipe(args.recipe)
    args.out = args.out or Path("out") / f"{args.recipe.stem}-study"
    runs = seeded_runs(chosen_runs(recipe, args.runs), seeds(recipe, args))
    out = resolved(args.out)
    commands, configs = plan(recipe, args)
    beside = [read_beside(Path(path)) for path in args.beside] if args.beside else None
    check_writable(out / "study.json")
    with exclusive(out):  # One study at a time in a folder.
        check_unused(out)
        (out / "logs").mkdir(parents=True)
        started = time.perf_counter()
        prepare_datasets(configs)
        trained = train_all(runs, commands, out, args.jobs)
        report = compare(recipe, runs, configs, args, out)
        seconds = time.perf_counter() - started
        numbers = {"quick": args.quick, "seconds": round(seconds, 1), "runs": trained}
        groups = seed_groups(runs)
        if groups:  # With one seed, study.json stays as it was.
            numbers["seeds"] = seeds_summary(report, groups)
        markdown = summary(recipe, runs, trained, report, seconds)
        write_summary(out, numbers, markdown, beside, report)
    figure = f", {out}/study.png" if beside is not None else ""
    print(
        f"wrote {out}/study.md, study.json{figure}, the runs in {out}/NAME and the comparison in "
        f"{out}/compare"
    )
    return 0


def main(argv: list[str]) -> int:
    """The `study` command on its own argv, what follows `python generate.py study`."""
    parser = cli.ArgumentParser(prog="python generate.py study")
    add_arguments(parser)
    return run(parser.parse_args(argv))
