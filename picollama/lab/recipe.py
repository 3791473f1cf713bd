"""The retrieval study's recipe, from configs/study/.

A recipe lists the runs and their settings. This module reads and checks it. It trains nothing."""

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.user_files import read_small_text


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


# Every key of a recipe, what it must be, and the check.
KEYS = {
    "config": ("a config file", is_text),
    "multiples": ("a list of positive integers", is_counts),
    "settings": ("a table of config sections", is_table),
    "quick": ("a table", is_table),
    "runs": ("a list of [[runs]] tables", is_tables),
    "name": ("a name", is_text),
    "what": ("a description", is_text),
    "from": ("a run's name", is_text),
} | dict.fromkeys(
    ("rows", "steps", "stretch", "seeds", "passkeys"), ("a positive integer", is_count)
)
# The keys of each table of a recipe, the required ones first.
RECIPE_KEYS = "config multiples rows runs steps settings quick seeds passkeys"
TABLES = {
    "recipe": tuple(RECIPE_KEYS.split()),
    "quick": ("multiples", "rows", "steps", "settings", "passkeys"),
    "run": ("name", "what", "from", "stretch", "steps", "settings", "quick"),
    "run quick": ("steps", "settings"),
}
REQUIRED = {"recipe": 4, "quick": 0, "run": 2, "run quick": 0}
# The config keys the study sets itself, and where each comes from.
OWN_KEYS = {
    "train.out_dir": "the study (OUT/NAME)",
    "train.init_from": "from",
    "train.max_steps": "steps",
    "train.device": "--device",
    "train.dtype": "--dtype",
}
FINE_TUNE_KEYS = ("train.seq_len", "model.max_seq_len")  # Set by `from` and `stretch`.


@dataclass
class Level:
    """Steps and settings ({"section.key": value}) of the study, of a run, or of either's --quick.

    The study's level also gives the lengths compared (× the context) and the rows at each. A
    text recipe adds the passkey rows at each length and depth."""

    steps: int | None = None
    settings: dict = field(default_factory=dict)
    multiples: list[int] | None = None
    rows: int | None = None
    passkeys: int | None = None

    def config_keys(self) -> dict:
        """The config keys this level sets."""
        return self.settings | ({"train.max_steps": self.steps} if self.steps else {})


@dataclass
class Run:
    name: str
    what: str
    own: Level
    quick: Level
    source: str | None = None  # `from`. Fine-tune that run's weights once it is trained.
    stretch: int = 1  # At this multiple of that run's context.
    seed: int = 0  # Added to the config's train.seed. 0 is the recipe's run as written.
    base: str = ""  # The recipe's name of the run, without the seed's suffix.

    def __post_init__(self):
        self.base = self.base or self.name


@dataclass
class Recipe:
    path: Path
    config: str  # The config file every run trains, in the repository.
    full: Level
    quick: Level
    runs: list[Run]
    seeds: int = 1  # Training runs of each recipe run, at train.seed + 0, 1, ...


def seed_name(name: str, seed: int) -> str:
    """The folder of a run trained with seed offset `seed`. NAME-seedK, or NAME at 0.

    So a one-seed study keeps the folders it always had."""
    return name if seed == 0 else f"{name}-seed{seed}"


def seeded_runs(runs: list[Run], seeds: int) -> list[Run]:
    """Each run at seed offsets 0 .. seeds-1, grouped by seed so the first seed trains first.

    A fine-tune starts from the same seed's run. UserError if a seeded name clashes with one of
    the recipe's own."""
    names = {run.name for run in runs}
    seeded = []
    for seed in range(seeds):
        for run in runs:
            name = seed_name(run.name, seed)
            if seed and name in names:
                raise UserError(
                    f"--seeds {seeds}: run {run.name}'s seed {seed} is named {name}, "
                    "the name of another run of the recipe; rename that run"
                )
            source = run.source and seed_name(run.source, seed)
            seeded.append(replace(run, name=name, source=source, seed=seed, base=run.name))
    return seeded


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
    multiples, rows, passkeys = (table.get(key) for key in ("multiples", "rows", "passkeys"))
    return Level(table.get("steps"), settings, multiples, rows, passkeys)


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
        raw = tomllib.loads(read_small_text(path, "--recipe"))
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
    full, quick = level(raw, str(path)), level(quick, str(path))
    return Recipe(path, raw["config"], full, quick, runs, raw.get("seeds", 1))


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
