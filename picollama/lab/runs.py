"""What both tracks of `generate.py extrapolate` share: its options and the runs it loads."""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from data.tokenizer import tokenizer_file, tokenizer_sha256
from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.components.length import position_limit, stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.run_files import load_model, load_run


@dataclass
class Options:
    """What `python generate.py extrapolate` measures and how.

    These are its flags (add_arguments) with their defaults."""

    lengths: list[int] | None = None  # None: the task's default multiples × the context.
    methods: list[str] | None = None  # None: every scaling each run can use.
    protocol: str = "fixed-target"
    num_windows: int = 8
    probes: int = 16
    probe_span: int = 16
    passkeys: int = 0  # Passkey rows per length and depth. 0 means none.
    data: str | None = None  # None: the first run's data.dir.
    seed: int = 0
    retrieval_rows: int = 256
    max_minutes: int = 60  # The longest evaluation started, as estimated (cost.py).
    device: str = "auto"
    dtype: str = "auto"

    @classmethod
    def from_args(cls, args) -> "Options":
        return cls(**{option.name: getattr(args, option.name) for option in fields(cls)})

    def command(self, runs: list[Path], out: Path | None) -> list[str]:
        """The `python generate.py extrapolate` command line of these options.

        A report records it. Flags at their defaults are left out."""
        command = ["python", "generate.py", "extrapolate", "--run", ",".join(map(str, runs))]
        command += ["--out", str(out)] if out is not None else []
        for option in fields(self):
            value = getattr(self, option.name)
            if value != option.default:
                text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
                command += ["--" + option.name.replace("_", "-"), text]
        return command


def fits(model: Transformer, length: int) -> bool:
    """Whether the model can score `length` tokens at all, by its length policy."""
    limit = position_limit(model.args)
    return limit is None or length <= limit


def scalings(args: ModelArgs) -> list[str]:
    """The methods of ROPE_SCALINGS that a model's ModelArgs accept.

    RoPE takes every one. Positions with nothing to scale take "none" alone."""
    usable = []
    for method in ROPE_SCALINGS:
        try:
            stretched(args, method, args.max_seq_len)
        except ValueError:
            continue
        usable.append(method)
    return usable


def spread(values) -> dict:
    """Mean, standard deviation, standard error of the mean and count."""
    values = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "sem": float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def trained_task(name: str) -> str:
    """data.task in a run directory's config.json.

    It is "text" if it names none or cannot be read. Loading will then say why."""
    try:
        config = json.loads((Path(name) / "config.json").read_text())
        return (config.get("data") or {}).get("task", "text")
    except (OSError, ValueError, AttributeError):
        return "text"


def describe(name: str, model: Transformer, config: dict, methods: list[str] | None) -> dict:
    """A run's entry in the report, before its numbers.

    UserError if `methods` names a RoPE scaling the model cannot use (see scalings)."""
    position = model.args.position
    usable = scalings(model.args)
    refused = [m for m in methods or () if m not in usable]
    if refused:
        raise UserError(
            f"--methods {','.join(refused)}: RoPE scaling applies to RoPE models only, and {name} "
            f"uses {position} positions (leave --methods out, or pass --methods "
            f"{','.join(usable)})"
        )
    return {
        "name": name,
        "task": trained_task(name),
        "position": position,
        "train_context": int(
            (config.get("train") or {}).get("seq_len") or model.args.original_seq_len
        ),
        "original_context": model.args.original_seq_len,  # What RoPE scaling stretches.
        "methods": methods or usable,
        "model": model.args.to_dict(),  # Before the evaluation switches RoPE.
        "config": config,
    }


def load_runs(
    names: list[str], methods: list[str] | None, device, dtype
) -> list[tuple[Transformer, dict]]:
    """(model, run description) for each run directory.

    The runs must share one task and one tokenizer. A RoPE scaling method named for a model
    without RoPE is refused too."""
    tasks = {}
    for name in names:
        tasks.setdefault(trained_task(name), name)
    if len(tasks) > 1:
        raise UserError(
            f"{' and '.join(tasks.values())} were trained on different tasks (data.task "
            f"{' and '.join(tasks)}); compare runs of one task together"
        )
    runs = []
    tokenizers = {}
    for name in names:
        if "retrieval" in tasks:  # The retrieval task has no tokenizer.
            model, config = load_model(name, device)
            model = model.to(dtype).eval()
        else:
            model, config, _ = load_run(name, device, dtype)
            tokenizers.setdefault(tokenizer_sha256(tokenizer_file(name)), name)
        if len(tokenizers) > 1:
            first, other = tokenizers.values()
            raise UserError(
                f"{first} and {other} have different tokenizers (tokenizer.model); runs compared "
                "together must share one, so that they score the same tokens"
            )
        runs.append((model, describe(name, model, config, methods)))
    return runs
