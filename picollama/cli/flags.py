"""The flags that commands share, each defined once, with their types and value checks."""

import argparse
import math
import os
import sys
import types
import typing
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.text import checked_text


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so run_command prints one `error:` line.
    The shared flags come from the vocabulary below."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")

    def add_argument(self, *args, **kwargs):
        """argparse's add_argument, but a one-value flag given twice with two values is refused.
        Plain argparse keeps the last, so `--run A --run B` would quietly read B."""
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and not isinstance(action, REPEATABLE):
            action.__class__ = given_once(type(action))
        return action

    def parse_known_args(self, args=None, namespace=None):
        self.given = {}  # dest -> (flag, value) this command line set.
        namespace, rest = super().parse_known_args(args, namespace)
        missing = [
            flag
            for dest, flag in getattr(self, "needed", ())
            if getattr(namespace, dest, None) is None
        ]
        if missing:  # Checked here, not by argparse, so an old spelling can supply it.
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return namespace, rest


# Actions meant to be given several times, or that end the parse.
REPEATABLE = (
    argparse._AppendAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


def check_once(given: dict, dest: str, value, flag: str):
    """Record in `given` that `flag` set `dest` to `value`.

    `given` maps dest to (flag, value) for one command line. Each setting takes one value there.
    UserError if another value came before, by this flag or another spelling of it."""
    if dest in given and given[dest][1] != value:
        before, earlier = given[dest]
        said = f"{before} was given twice" if before == flag else f"{before} and {flag} were given"
        values = "" if isinstance(value, bool) else f" ({shown(earlier)}, then {shown(value)})"
        raise UserError(f"{said}{values}; give one")
    given[dest] = (flag, value)


def shown(value) -> str:
    """A flag's value as it was typed (a list comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


ONCE_CLASSES = {}


def given_once(cls: type) -> type:
    """`cls`, an argparse action, whose value goes through check_once (one subclass per class)."""
    if cls not in ONCE_CLASSES:

        def __call__(self, parser, namespace, values, option_string=None):
            cls.__call__(self, parser, namespace, values, option_string)
            check_once(parser.given, self.dest, getattr(namespace, self.dest), option_string)

        ONCE_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return ONCE_CLASSES[cls]


# ---- The command-line vocabulary. Each shared flag is defined once (README: One set of flags).


def positive(kind=int, zero: bool = False):
    """An argparse type: a finite number of `kind` above 0 (or at least 0, with zero=True)."""

    def parse(text: str):
        value = kind(text)
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise ValueError(text)
        return value

    parse.__name__ = f"{'non-negative' if zero else 'positive'} {kind.__name__}"
    return parse


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the system says, else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads(text: str) -> int:
    """An argparse type for --threads: 1 to the CPUs this process may use. More only wait on
    each other, and a million exhausted the system's threads: the server died of a segfault."""
    try:
        value = positive()(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid positive int value: {text!r}") from None
    cpus = usable_cpus()
    if value > cpus:
        raise argparse.ArgumentTypeError(
            f"at most {cpus}, the CPUs this process may use, not {value}"
        )
    return value


def add_threads(parser: ArgumentParser, what: str, default: str):
    """--threads N: CPU threads, 1 to the CPUs this process may use (cpu_threads)."""
    parser.add_argument(
        "--threads",
        type=cpu_threads,
        help=f"{what}, at most the CPUs this process may use (default: {default})",
    )


def comma_list(item=str, choices=None):
    """An argparse type: a non-empty comma-separated list, each item through `item` and one of
    `choices` if given."""

    def parse(text: str) -> list:
        values = []
        for part in filter(None, (part.strip() for part in text.split(","))):
            try:
                values.append(item(part))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not a {item.__name__} (in {text!r})"
                ) from None
            if choices is not None and values[-1] not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {part!r} (choose from {', '.join(choices)})"
                )
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values

    return parse


class Renamed(argparse.Action):
    """A flag's old spelling, kept for one release: it works, with a one-line note."""

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"note: {option_string} is now {self.new}; the old spelling goes in the next release",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_run(parser: ArgumentParser, several: bool = False, required: bool = True):
    """--run DIR: the run directory a command reads (several, comma-separated, where `several`)."""
    kind = comma_list(Path) if several else Path
    what = "run directories, comma-separated" if several else "the run directory"
    parser.add_argument(
        "--run", type=kind, metavar="DIR", help=f"{what} (model.safetensors, config.json, ...)"
    )
    parser.add_argument(
        "--checkpoint", dest="run", type=kind, action=Renamed, new="--run", help=argparse.SUPPRESS
    )
    if required:
        parser.needed = [*getattr(parser, "needed", ()), ("run", "--run")]


def output_path(text: str) -> Path:
    """An argparse type: a path to write, never empty (Path("") is the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; name the file or folder to write")
    return Path(text)


def add_out(parser: ArgumentParser, what: str, **kwargs):
    """--out PATH: what the command writes."""
    parser.add_argument("--out", type=output_path, metavar="PATH", help=what, **kwargs)


DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_device(
    parser: ArgumentParser, default: str | None = "auto", devices=DEVICES, dtypes=DTYPES
):
    """--device and --dtype, "auto" by default (None: the config's, in train.py). Their help
    offers `devices` and `dtypes`, what the command takes."""
    said = f"default {default}" if default else "default: the config's, else auto"
    parser.add_argument(
        "--device",
        default=default,
        help=f"auto (cuda, else mps, else cpu), {either(devices[1:])} ({said})",
    )
    parser.add_argument(
        "--dtype",
        default=default,
        help="auto (bfloat16 where the device computes it natively, else float32), "
        f"{either(dtypes[1:])} ({said})",
    )


def either(words) -> str:
    """'a, b or c'."""
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else "".join(words)


def add_compile(parser: ArgumentParser, what: str, default: bool | None = False):
    """--compile / --no-compile (None: the config's, in train.py)."""
    said = "the config's, else off" if default is None else "on" if default else "off"
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"torch.compile {what} (default {said}; ~10-70 s the first time)",
    )


SEEDS = 2**32  # torch's CPU generator keeps a seed's low 32 bits.


def check_seed(seed: int | None) -> int | None:
    """seed, unless torch would take it for a smaller one (UserError)."""
    if seed is not None and not 0 <= seed < SEEDS:
        raise UserError(
            f"--seed must be in 0..{SEEDS - 1} (torch's CPU generator keeps 32 bits: a larger "
            f"seed would repeat a smaller one's samples), not {seed}"
        )
    return seed


class Seed(argparse.Action):
    """--seed's action: check_seed's one line, not argparse's "invalid value"."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, check_seed(values))


def add_seed(parser: ArgumentParser, what: str, default: int | None = 0, unset: str = "random"):
    """--seed N, in 0..SEEDS-1. `unset` says what no seed means."""
    said = unset if default is None else default
    parser.add_argument(
        "--seed",
        type=positive(int, zero=True),
        action=Seed,
        default=default,
        help=f"{what} (default {said})",
    )


def utf8_argument(text: str, flag: str) -> str:
    """A command-line text, refused unless UTF-8. Other bytes reach Python as lone surrogates,
    which no tokenizer can take."""
    return checked_text(text, flag, "; set the terminal to UTF-8")


def check_type(name: str, value, annotation):
    """value, checked to be of the type `annotation`: int, float, str, bool, or one | None. An
    int passes as a float, but a bool is not an int, nor a string a bool. Else UserError names
    `name`."""
    options = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    base = next(t for t in options if t is not type(None))
    optional = type(None) in options
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        wanted = base.__name__ + (" or none" if optional else "")
        raise UserError(f"{name} must be {wanted}, not {type(value).__name__} {value!r}")
    return value
