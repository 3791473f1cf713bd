"""Resuming a run: its checkpoints, which one to continue, and refusing a resume that would not
continue the same run."""

import json
import re
from pathlib import Path

from data.tokenizer import same_tokenizer, tokenizer_file, tokenizer_sha256
from model import ModelArgs
from picollama.cli import UserError
from picollama.cli.flags import check_type
from picollama.cli.outputs import resolved
from picollama.config.model_args import saved_model_args


def checkpoints(run_dir) -> list[Path]:
    """Finished train_state/step_* directories, oldest first (not the unfinished .step_*.tmp)."""
    found = [
        p
        for p in (Path(run_dir) / "train_state").glob("step_*")
        if re.fullmatch(r"step_\d+", p.name)
    ]
    return sorted((p for p in found if p.is_dir()), key=lambda p: int(p.name[5:]))


def unusable(path: Path, problem: str) -> UserError:
    """The error for a checkpoint that cannot be resumed, pointing at the one before it."""
    step = int(path.name[5:])
    earlier = [p for p in checkpoints(path.parent.parent) if int(p.name[5:]) < step]
    hint = (
        f"delete it to resume from {earlier[-1]}"
        if earlier
        else "run without --resume to start again"
    )
    return UserError(f"cannot resume from {path}: {problem}; {hint}")


# What a resume must keep to continue exactly: the data stream and the optimizer. The checkpoint
# holds their state and records these keys in meta.json's "settings". The model, data and
# tokenizer are checked on their own. The schedule (max_steps, learning rates) may change.
EXACT_KEYS = (
    "optim.name",
    "train.batch_size",
    "train.seq_len",
    "train.random_positions",
    "data.copy_fraction",
    "data.copy_span",
    "data.copy_repeats",
    "data.pack_documents",
    "data.sampling",
    "data.retrieval_keys",
    "data.retrieval_values",
    "data.retrieval_pairs",
    "data.retrieval_filler",
)
# What to do with a run that cannot be continued.
NEW_RUN = "start a new run from its weights: --train.init_from={run_dir} and another train.out_dir"
# What makes a directory a run, with or without train_state/.
RUN_FILES = ("model.safetensors", "config.json")


def setting(config: dict, key: str):
    """config["section"]["name"] for key "section.name" (None where absent)."""
    section, _, name = key.partition(".")
    return (config.get(section) or {}).get(name)


def resume_point(run_dir, args: ModelArgs, resume: bool, config: dict | None = None) -> Path | None:
    """The checkpoint to continue from, or None for a fresh run. It must hold a model of `args`.
    `config`, the run's settings as save_checkpoint gets them, must keep its EXACT_KEYS and leave
    steps to do. A fresh run is refused in a directory that holds a run."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found and not resume:
        raise UserError(
            f"{run_dir} already holds a run ({found[-1].name}); pass --resume to continue it, "
            "or choose another train.out_dir"
        )
    if not found and held:  # Said alike with --resume or without. Neither can go on here.
        raise without_checkpoint(run_dir, held)
    if not resume:
        return None
    if not found:
        raise UserError(
            f"nothing to resume: {run_dir / 'train_state'} holds no checkpoint; "
            "run without --resume"
        )
    latest = found[-1]
    meta = read_meta(latest)
    if config is not None:  # First, as another source means another model too.
        check_init_from(latest, meta.get("settings") or {}, setting(config, "train.init_from"))
    saved = saved_model_args(meta["model"]).to_dict()  # Keys added since read as defaults.
    differences = [
        f"model.{k} {saved.get(k)!r} → {v!r}"
        for k, v in args.to_dict().items()
        if saved.get(k) != v
    ]
    if differences:
        raise UserError(
            f"cannot resume from {latest}: it was trained with a different model "
            f"({', '.join(differences)})"
        )
    if config is None:
        return latest
    recorded = meta.get("settings") or {}
    current = {k: setting(config, k) for k in EXACT_KEYS}
    changed = [
        f"{k} {recorded[k]!r} → {current[k]!r}"
        for k in EXACT_KEYS
        if recorded.get(k) not in (None, current[k])
    ]
    if changed:
        raise UserError(
            f"cannot resume from {latest} exactly: {', '.join(changed)}; resume with the "
            f"checkpoint's values, or {NEW_RUN.format(run_dir=run_dir)}"
        )
    max_steps = setting(config, "train.max_steps")
    if setting(config, "train.max_minutes"):  # The length its budget chose.
        max_steps = recorded_max_steps(latest)
    if not setting(config, "train.epochs"):  # train.py checks those once it has the data.
        steps_left(latest, max_steps, f"train.max_steps is {max_steps}", "train.max_steps")
    return latest


def steps_left(checkpoint: Path, max_steps: int | None, length: str, key: str):
    """UserError if `checkpoint` is at max_steps already (None: no end). `length` says the run's
    length, and `key` is the key that would lengthen it."""
    step = read_meta(checkpoint)["step"]
    if max_steps is not None and step >= max_steps:
        raise UserError(
            f"nothing to do: {checkpoint} is at step {step} and {length}; raise {key} to train on"
        )


def check_init_from(latest: Path, recorded: dict, given: str | None):
    """UserError unless `given`, a resume's train.init_from, is the run's own. The checkpoint's
    settings record it, or for older checkpoints the run's config.json. Else config.json would
    record a source the run was not trained from."""
    if "train.init_from" in recorded:
        started = recorded["train.init_from"]
    else:
        try:
            config = json.loads((latest.parent.parent / "config.json").read_text())
            started = config["train"]["init_from"]
        except (OSError, ValueError, KeyError, TypeError):
            return
    if not isinstance(started, str | None) or started == given:
        return
    if None not in (started, given) and resolved(started) == resolved(given):
        return
    said = [f"train.init_from={p}" if p else "no train.init_from" for p in (started, given)]
    raise UserError(
        f"cannot resume from {latest}: the run was started with {said[0]}, this resume gives "
        f"{said[1]}; resume with the run's, or {NEW_RUN.format(run_dir=latest.parent.parent)}"
    )


def without_checkpoint(run_dir: Path, held: list[str]) -> UserError:
    """The error for a run directory holding RUN_FILES (`held`) but no checkpoint to resume."""
    if "model.safetensors" not in held:
        # Never say "delete it". A folder holding only a config.json may be the user's own.
        return UserError(
            f"train.out_dir {run_dir} holds {', '.join(held)} but no model.safetensors and no "
            "checkpoint (train_state/): nothing to resume or start from; choose another "
            "train.out_dir (a new or empty folder, or a run's)"
        )
    return UserError(
        f"{run_dir} already holds a run ({', '.join(held)}) but no checkpoint to resume "
        f"(train_state/): {NEW_RUN.format(run_dir=run_dir)}, or delete {run_dir} to start over "
        "there"
    )


def read_meta(checkpoint: Path) -> dict:
    """A checkpoint's meta.json, each value checked for its type (UserError naming the key)."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise TypeError(type(meta).__name__)
        for key, kind in (("step", int), ("world_size", int), ("tokenizer_sha256", str | None)):
            check_type(key, meta.get(key), kind)
        check_type("settings", meta.get("settings"), dict | None)
        saved_model_args(meta["model"])
    except UserError as e:
        raise unusable(checkpoint, f"meta.json: {e}") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise unusable(checkpoint, "meta.json is missing or corrupt") from None
    return meta


def recorded_max_steps(checkpoint: Path) -> int:
    """The step count a train.max_minutes run chose, as its checkpoint records it."""
    steps = (read_meta(checkpoint).get("settings") or {}).get("train.max_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UserError(
            f"{checkpoint} records no step count for train.max_minutes; "
            "resume with --train.max_steps=N"
        )
    return steps


def check_tokenizer(checkpoint: Path, tokenizer: Path):
    """UserError unless `tokenizer`, the dataset's, is the one the checkpoint was trained with.
    meta.json records it. For checkpoints that record none, the run's tokenizer.model says."""
    meta = read_meta(checkpoint)
    run_tokenizer = tokenizer_file(checkpoint.parent.parent)
    expected = meta.get("tokenizer_sha256")
    if not expected and run_tokenizer is not None:
        expected = tokenizer_sha256(run_tokenizer)
    if not same_tokenizer(expected, tokenizer):
        recorded, data_dir = recorded_data_dir(checkpoint.parent.parent), Path(tokenizer).parent
        other = recorded and resolved(recorded) != resolved(data_dir)
        hint = f" (--data.dir={recorded}, as its config.json records)" if other else ""
        raise UserError(
            f"cannot resume from {checkpoint}: it was trained with another tokenizer "
            f"(sha256 {expected[:12]}) than data.dir {data_dir} has "
            f"(sha256 {tokenizer_sha256(tokenizer)[:12]}); resume with the dataset it was trained "
            f"on{hint}, or train on {data_dir} in a new train.out_dir"
        )


def recorded_data_dir(run_dir: Path) -> str | None:
    """The data.dir a run's config.json records. None if none, or not readable."""
    try:
        recorded = json.loads((run_dir / "config.json").read_text())["data"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recorded if isinstance(recorded, str) else None
