"""Where a command may write: never over its own inputs, nor in or under another command's
folder. Checked before any work."""

import glob
import re
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.outputs import LEFTOVER, check_output_kind, listed, resolved

# What --force may replace, so that it never deletes a user's own files. That is an empty
# directory, or a GGUF file, known by its magic bytes. It is also a directory with
# model.safetensors and config.json and only other files picollama writes there. Those are a run's
# train_state/, metrics.jsonl and extrapolation/, an export's tokenizer files, and save leftovers.
OWN_FILES = (
    r"model\.safetensors|config\.json|tokenizer(\.model|\.json|_config\.json)|metrics\.jsonl"
)
OWN_FOLDERS = r"train_state|extrapolation"

TRAINING_RUN, RUN, DATASET = "a training run", "a run", "a dataset"
# The folders each writer makes. It may write into them again, when its own checks allow.
OWN_KINDS = {
    "train.py": {TRAINING_RUN, RUN},
    "prepare": {DATASET},
    "to-hf": {RUN},
    "from-hf": {RUN},
    "from-gguf": {RUN},
    "to-gguf": set(),
}
# What train.py may find in train.out_dir. That is its own files and leftovers of a killed write.
RUN_ENTRIES = rf"{OWN_FILES}|{OWN_FOLDERS}|{LEFTOVER}"


def folder_kind(folder: Path) -> str | None:
    """The kind of picollama folder `folder` is, or None: TRAINING_RUN (train_state/ or
    metrics.jsonl), RUN (config.json and model.safetensors, an import or export), DATASET."""
    if not folder.is_dir():
        return None
    if (folder / "meta.json").is_file():
        return DATASET
    if (folder / "train_state").is_dir() or (folder / "metrics.jsonl").is_file():
        return TRAINING_RUN
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return RUN
    return None


def input_paths(value) -> list[Path]:
    """The existing paths an input names. A glob names the files it matches.

    A name such as shakespeare or hf:NAME names none. Neither does a dataset still to prepare,
    which check_writable compares instead."""
    text = "" if value is None else str(value)
    if not text:
        return []
    found = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
    return [path for path in map(resolved, found) if path.exists()]


def check_output_place(out, inputs: dict, command: str, flag: str = "--out"):
    """Check, before any work, where an output goes. `inputs` maps a flag or key to a path.

    UserError when `out` is, holds or lies inside one of `inputs`. The same when it lies inside a
    folder another command made (a run, a dataset), or is one of a kind `command` does not make.
    So --force never replaces a training run's checkpoints. train.py's out_dir must also be a run
    or hold no user files."""
    check_output_kind(out)  # Names a link loop, a FIFO or a device as such.
    path = resolved(out)
    for key, value in inputs.items():
        given = next((p for p in input_paths(value) if overlap(path, p)), None)
        if given is None:
            continue
        place = "is" if path == given else "lies inside" if path.is_relative_to(given) else "holds"
        raise UserError(
            f"the output {flag} {out} overlaps the input {key} {value} (it {place} it); choose "
            f"another {flag}"
        )
    for parent in path.parents:
        if kind := folder_kind(parent):
            raise UserError(
                f"{flag} {out} lies inside {parent}, {kind}: another command's folder, which "
                f"{command} never writes into; choose another {flag}"
            )
    kind = folder_kind(path)
    if kind is not None and kind not in OWN_KINDS[command]:
        raise UserError(
            f"not replacing {out}: it is {kind}, which {command} does not make (--force replaces "
            f"only what {command} made); choose another {flag}"
        )
    if command == "train.py" and kind is None and path.is_dir():
        check_run_entries(path, out, flag)


def overlap(path: Path, given: Path) -> bool:
    """Whether `path` is, holds or lies inside `given`."""
    return path.is_relative_to(given) or given.is_relative_to(path)


def check_run_entries(path: Path, out, flag: str):
    """UserError unless the folder `path` holds only what train.py writes in a run directory."""
    foreign = [
        entry.name + "/" * entry.is_dir()
        for entry in sorted(path.iterdir())
        if not re.fullmatch(RUN_ENTRIES, entry.name)
    ]
    if foreign:
        raise UserError(
            f"{flag} {out} is not a run directory: it holds {listed(foreign)}, which train.py "
            f"did not write; choose another {flag} (a new or empty folder, or a run's)"
        )
