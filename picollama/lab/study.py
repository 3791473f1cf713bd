"""The retrieval study (`python generate.py study`): the runs of a recipe (configs/study/),
every position encoding trained on the synthetic retrieval task, compared past their context."""

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from picollama import REPO_ROOT, cli
from picollama.cli import UserError, atomic_output, check_writable, comma_list, positive
from picollama.config import Config, check_config, parse_cli
from picollama.lab import extrapolate
from picollama.lab.report import retrieval_markdown, side_by_side_plot, table

RECIPE = Path("configs/study/retrieval.toml")  # in the repository


# ---------------------------------------------------------------- the recipe


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_counts(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(map(is_count, value))


def is_text(value) -> bool:
    return isinstance(value, str) and value != ""


def is_table(value) -> bool:
    return isinstance(value, dict)


def is_tables(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(map(is_table, value))


# Every key of a recipe: what it must be, and the check
KEYS = {
    "config": ("a config file", is_text),
    "multiples": ("a list of positive integers", is_counts),
    "rows": ("a positive integer", is_count),
    "steps": ("a positive integer", is_count),
    "settings": ("a table of config sections", is_table),
    "quick": ("a table", is_table),
    "runs": ("a list of [[runs]] tables", is_tables),
    "name": ("a name", is_text),
    "what": ("a description", is_text),
    "from": ("a run's name", is_text),
    "stretch": ("a positive integer", is_count),
}
# The keys of each table of a recipe, the required ones first
TABLES = {
    "recipe": ("config", "multiples", "rows", "runs", "steps", "settings", "quick"),
    "quick": ("multiples", "rows", "steps", "settings"),
    "run": ("name", "what", "from", "stretch", "steps", "settings", "quick"),
    "run quick": ("steps", "settings"),
}
REQUIRED = {"recipe": 4, "quick": 0, "run": 2, "run quick": 0}
# The config keys the study sets itself, and from what
OWN_KEYS = {
    "train.out_dir": "the study (OUT/NAME)",
    "train.init_from": "from",
    "train.max_steps": "steps",
    "train.device": "--device",
    "train.dtype": "--dtype",
}
FINE_TUNE_KEYS = ("train.seq_len", "model.max_seq_len")  # a fine-tune's, from `from` and `stretch`


@dataclass
class Level:
    """Steps and settings ({"section.key": value}) of the study, of a run, or of either's --quick;
    the study's also the lengths compared (× the context) and the rows at each."""

    steps: int | None = None
    settings: dict = field(default_factory=dict)
    multiples: list[int] | None = None
    rows: int | None = None

    def config_keys(self) -> dict:
        """The config keys this level sets."""
        return self.settings | ({"train.max_steps": self.steps} if self.steps else {})


@dataclass
class Run:
    name: str
    what: str
    own: Level
    quick: Level
    source: str | None = None  # `from`: a fine-tune of that run's weights, once it is trained
    stretch: int = 1  # at this multiple of that run's context


@dataclass
class Recipe:
    path: Path
    config: str  # the config file every run trains, in the repository
    full: Level
    quick: Level
    runs: list[Run]


def check_table(table: dict, kind: str, where: str) -> dict:
    """table, with the keys of TABLES[kind] only, the required ones, each what KEYS says."""
    keys = TABLES[kind]
    for key in keys[: REQUIRED[kind]]:
        if key not in table:
            raise UserError(f"{where}: {key} is missing")
    for key, value in table.items():
        if key not in keys:
            raise UserError(f"{where}: unknown key {key!r} (valid: {', '.join(keys)})")
        what, check = KEYS[key]
        if not check(value):
            raise UserError(f"{where}: {key} must be {what}, not {value!r}")
    return table


def level(table: dict, where: str) -> Level:
    """A checked table's steps, settings (flattened to config keys), multiples and rows."""
    settings = {}
    for section, values in table.get("settings", {}).items():
        if not isinstance(values, dict):
            raise UserError(f"{where}: settings.{section} must be a table of {section}'s keys")
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if dotted in OWN_KEYS:
                raise UserError(f"{where}: settings {dotted}: {OWN_KEYS[dotted]} sets it")
            if not isinstance(value, (bool, int, float, str)):
                raise UserError(f"{where}: settings {dotted} must be one value, not {value!r}")
            settings[dotted] = value
    return Level(table.get("steps"), settings, table.get("multiples"), table.get("rows"))


def read_run(table: dict, where: str) -> Run:
    if is_text(table.get("name")):
        where = f"{where} ({table['name']})"
    check_table(table, "run", where)
    name, source, stretch = table["name"], table.get("from"), table.get("stretch", 1)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name) or name in ("logs", "compare"):
        raise UserError(f"{where}: name {name!r} must be a folder name other than logs or compare")
    if source is None and "stretch" in table:
        raise UserError(f"{where}: stretch needs from (the run it fine-tunes)")
    quick = check_table(table.get("quick", {}), "run quick", f"{where} quick")
    run = Run(name, table["what"], level(table, where), level(quick, where), source, stretch)
    given = run.own.settings | run.quick.settings
    fixed = [key for key in FINE_TUNE_KEYS if key in given]
    if source is not None and fixed:
        raise UserError(f"{where}: settings {fixed[0]}: from and stretch set it")
    return run


def load_recipe(path: Path) -> Recipe:
    """The study's recipe, checked; UserError naming the file and the key otherwise."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read the recipe {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None
    check_table(raw, "recipe", str(path))
    quick = check_table(raw.get("quick", {}), "quick", f"{path} [quick]")
    runs = [read_run(table, f"{path} runs[{i}]") for i, table in enumerate(raw["runs"])]
    seen = set()
    for run in runs:
        if run.name in seen:
            raise UserError(f"{path}: two runs are named {run.name}")
        if run.source is not None and run.source not in seen:
            raise UserError(f"{path}: run {run.name}: from {run.source!r} names no earlier run")
        seen.add(run.name)
    return Recipe(path, raw["config"], level(raw, str(path)), level(quick, str(path)), runs)


def run_keys(recipe: Recipe, run: Run, args, configs: dict[str, Config]) -> dict:
    """The config keys one run trains with: the study's, the run's, --quick's, the run's own
    --quick, --steps (but for a fine-tune), then a fine-tune's start and context (from `from`'s
    config, in configs)."""
    keys = recipe.full.config_keys() | run.own.config_keys()
    if args.quick:
        keys |= recipe.quick.config_keys() | run.quick.config_keys()
    if run.source is None and args.steps:
        keys["train.max_steps"] = args.steps
    if run.source is not None:
        context = run.stretch * configs[run.source].train.seq_len
        keys["train.init_from"] = str(Path(args.out) / run.source)
        keys |= dict.fromkeys(FINE_TUNE_KEYS, context)
    return keys


def flag(key: str, value) -> str:
    """--section.key=VALUE, as train.py reads it back."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{key}={value}"


def plan(recipe: Recipe, args) -> tuple[dict[str, list[str]], dict[str, Config]]:
    """train.py's arguments for each run of the recipe, and the config each trains, checked as
    train.py checks them: a run it would refuse fails here, before any training."""
    commands, configs = {}, {}
    for run in recipe.runs:
        keys = run_keys(recipe, run, args, configs)
        rest = [f"--train.out_dir={Path(args.out) / run.name}"]
        rest += [flag(key, value) for key, value in keys.items()]
        rest += ["--device", args.device, "--dtype", args.dtype]
        try:
            configs[run.name], _ = parse_cli(["--config", str(REPO_ROOT / recipe.config), *rest])
            check_config(configs[run.name], 1)
        except UserError as e:
            raise UserError(f"run {run.name} of {recipe.path}: {e}") from None
        commands[run.name] = ["--config", recipe.config, *rest]
    return commands, configs


def chosen_runs(recipe: Recipe, names: list[str] | None) -> list[Run]:
    """The recipe's runs that --runs names (all of them without it)."""
    if names is None:
        return recipe.runs
    known = [run.name for run in recipe.runs]
    for name in names:
        if name not in known:
            raise UserError(f"--runs: unknown {name!r} (choose from {', '.join(known)})")
    runs = [run for run in recipe.runs if run.name in names]
    for run in runs:
        if run.source is not None and run.source not in names:
            raise UserError(
                f"--runs: {run.name} is fine-tuned from {run.source}; name {run.source} too"
            )
    return runs


# ---------------------------------------------------------------- training and comparing


def train_run(name: str, command: list[str], out: Path) -> dict:
    """Train one run with `python train.py COMMAND` on one thread (its output in OUT/logs/NAME.log):
    wall and CPU seconds, and its last validation accuracy (metrics.jsonl); UserError naming the
    log's last line when training fails."""
    # A process of its own, not train.train() here: runs train side by side, and training holds
    # process-wide state (torch.distributed's default group, the global RNGs it seeds, torch's
    # thread count, stdout for its log); and its CPU seconds are the child's own.
    log = out / "logs" / f"{name}.log"
    start = time.perf_counter()
    # one thread a run, runs side by side: tiny models gain nothing from a second thread, and lose
    # much to a busy one
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as stream:
        process = subprocess.Popen(
            [sys.executable, "train.py", *command],
            cwd=REPO_ROOT,
            stdout=stream,
            stderr=subprocess.STDOUT,
            env=env,
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
        "command": ["python", "train.py", *command],
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "steps": max((m["step"] for m in metrics if "step" in m), default=0),
        "val_acc": accuracy[-1] if accuracy else None,
    }


def train_all(runs: list[Run], commands: dict[str, list[str]], out: Path, jobs: int) -> dict:
    """Train the runs, `jobs` at a time (a fine-tune once the run it starts from is done): {name:
    train_run's numbers}."""
    futures = {}

    def one(run: Run) -> dict:
        if run.source is not None:
            futures[run.source].result()  # submitted earlier, so running or done: no deadlock
        return train_run(run.name, commands[run.name], out)

    with (
        ThreadPoolExecutor(jobs) as pool,
        tqdm(total=len(runs), desc="retrieval study", unit="run") as bar,
    ):
        for run in runs:
            futures[run.name] = pool.submit(one, run)
        for future in as_completed(futures.values()):
            future.result()  # the first failure ends the study (the runs under way finish)
            bar.update()
    return {name: future.result() for name, future in futures.items()}


@contextmanager
def one_thread():
    """torch on one thread, as in training: a tiny model gains little from two, and loses much to a
    busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def compare(recipe: Recipe, runs: list[Run], configs: dict[str, Config], args) -> dict:
    """The extrapolation report of the trained runs side by side, written to OUT/compare."""
    chosen = recipe.quick if args.quick else recipe.full
    multiples = chosen.multiples or recipe.full.multiples
    context = min(configs[run.name].train.seq_len for run in runs)
    options = extrapolate.Options(
        lengths=[context * k for k in multiples],
        retrieval_rows=chosen.rows or recipe.full.rows,
        device=args.device,
        dtype=args.dtype,
    )
    names = [Path(args.out) / run.name for run in runs]
    compared = Path(args.out) / "compare"
    with one_thread():
        return extrapolate.extrapolation(names, compared, options, options.command(names, compared))


def summary(recipe: Recipe, runs: list[Run], trained: dict, report: dict, seconds: float) -> str:
    """The study's Markdown: what each run is and cost, then the comparison."""
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
    lines = [
        f"# The retrieval study ({seconds / 60:.1f} min)",
        "",
        f"Each run: `python train.py --config {recipe.config}` with its overrides (study.json has "
        "the commands).",
        "",
        *table(header, rows),
        "",
        retrieval_markdown(report).replace("# ", "## ", 1),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_arguments(parser: cli.ArgumentParser):
    """The flags of `python generate.py study` (generate.py builds the parser; main() here builds
    its own)."""
    parser.description = (
        "The retrieval study: the runs of a recipe (every position encoding, in "
        f"{RECIPE}) trained on the synthetic retrieval task and compared past their context."
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=REPO_ROOT / RECIPE,
        help=f"the study's runs and their settings (default {RECIPE})",
    )
    default = Path("out/retrieval-study")
    cli.add_out(parser, f"output directory (default {default})", default=default)
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
        type=Path,
        help="a text study's extrapolation.json: its perplexity beside retrieval",
    )
    parser.add_argument(
        "--steps",
        type=positive(),
        help="training steps of each run but fine-tunes (default: the recipe's)",
    )
    parser.add_argument(
        "--jobs",
        type=positive(),
        default=2,
        help="runs trained side by side, one thread each (default 2)",
    )
    cli.add_device(parser)


def run(args) -> int:
    """The `study` command, on parsed flags (add_arguments)."""
    recipe = load_recipe(args.recipe)
    runs, out = chosen_runs(recipe, args.runs), Path(args.out)
    commands, configs = plan(recipe, args)
    beside = json.loads(args.beside.read_text()) if args.beside else None
    check_writable(out / "study.json")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trained = train_all(runs, commands, out, args.jobs)
    report = compare(recipe, runs, configs, args)
    seconds = time.perf_counter() - started
    with atomic_output(out / "study.json") as json_path, atomic_output(out / "study.md") as md_path:
        numbers = {"quick": args.quick, "seconds": round(seconds, 1), "runs": trained}
        json_path.write_text(json.dumps(numbers) + "\n")
        md_path.write_text(summary(recipe, runs, trained, report, seconds))
    if beside is not None:
        with atomic_output(out / "study.png") as png_path:
            side_by_side_plot(beside, report, png_path)
    figure = f", {out}/study.png" if beside is not None else ""
    print(
        f"wrote {out}/study.md, study.json{figure}, the runs in {out}/NAME and the comparison in "
        f"{out}/compare"
    )
    return 0


def main(argv: list[str]) -> int:
    """The `study` command on its own argv (what follows `python generate.py study`)."""
    parser = cli.ArgumentParser(prog="python generate.py study")
    add_arguments(parser)
    return run(parser.parse_args(argv))
