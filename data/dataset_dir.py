"""The dataset folder prepare writes: whether an existing one is reused, refused or replaced.
Also its partial folder, summary and JSON files."""

import json
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.outputs import atomic_output, check_replaceable, listed

# Format 2 ends each document with EOS. Format 3 has fixed-size shards listed in meta.json.
FORMAT_VERSION = 3
# What preparing writes in a dataset folder. Format 2's shards are <split>.bin.
DATASET_FILES = (
    r"meta\.json|tokenizer(\.model|\.json|_config\.json)"
    r"|(train|val)(-\d{5,})?\.(bin|docs\.npy|mask\.bin)"
)


def existing_output(out_dir: Path, inputs: dict, force: bool) -> dict | None:
    """meta.json of an output in out_dir that these inputs can reuse. UserError if it must stay.
    None when out_dir is to be replaced, with --force or no readable meta.json. prepare then checks
    it is its own (check_own), once the inputs are known not to lie inside it."""
    if not out_dir.exists() or out_dir.is_dir() and not any(out_dir.iterdir()):
        return None
    meta_path = out_dir / "meta.json"
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a prepared dataset; choose another --out")
    if not meta_path.is_file():
        held = listed(sorted(p.name + "/" * p.is_dir() for p in out_dir.iterdir()))
        raise UserError(
            f"{out_dir} exists and is not a prepared dataset (no meta.json; it holds {held}); "
            "choose another --out"
        )
    meta = read_json(meta_path)
    if force or not isinstance(meta, dict):
        return None
    problem = reuse_problem(out_dir, meta, inputs)
    if problem is None:
        return meta
    check_own(out_dir)  # So the advice to pass --force never deletes a user's file.
    raise UserError(problem)


def reuse_problem(out_dir: Path, meta: dict, inputs: dict) -> str | None:
    """Why the dataset `meta` describes cannot be reused for these inputs. None if it can."""
    if meta.get("format") != FORMAT_VERSION:
        return (
            f"{out_dir} was prepared in format {meta.get('format')}, not {FORMAT_VERSION} "
            "(training still reads it); pass --force to prepare it again"
        )
    wanted_sha, found_sha = inputs.get("tokenizer_sha256"), str(meta.get("tokenizer_sha256", "?"))
    if wanted_sha and wanted_sha != found_sha:
        return (
            f"{out_dir} was prepared with a different tokenizer (sha256 {found_sha[:12]} there, "
            f"{wanted_sha[:12]} given); pass --force to replace it or --out to write elsewhere"
        )
    recorded = meta.get("inputs") if isinstance(meta.get("inputs"), dict) else {}
    changed = sorted(k for k in inputs.keys() | recorded.keys() if inputs.get(k) != recorded.get(k))
    if changed:
        return (
            f"{out_dir} was prepared from different inputs ({', '.join(changed)} changed); "
            "pass --force to replace it or --out to write elsewhere"
        )
    return None


def check_own(out_dir: Path):
    """UserError unless out_dir is absent, empty or a dataset picollama prepared. Such a dataset
    holds only a manifest meta.json (with a format and splits), a tokenizer and shards."""
    what = "--force replaces only a prepared dataset: meta.json, its tokenizer and shards"
    check_replaceable(out_dir, DATASET_FILES, marks=["meta.json"], what=what)
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    meta = read_json(out_dir / "meta.json")
    manifest = isinstance(meta, dict) and isinstance(meta.get("format"), int)
    if not manifest or "splits" not in meta:
        raise UserError(
            f"not replacing {out_dir}: its meta.json is not a dataset's manifest (JSON with a "
            "format and splits), so picollama did not write it; choose another output"
        )


def summary(out_dir: Path, meta: dict) -> str:
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    shards = sum(len(split.get("shards", [None])) for split in (train, val))
    return (
        f"{out_dir}: train {train['tokens']:,} tokens ({train['docs']} docs), val "
        f"{val['tokens']:,} tokens ({val['docs']} docs) in {shards} shards, vocab "
        f"{meta['vocab_size']}, {meta['bytes_per_token']:.2f} bytes/token"
    )


def partial_dir(out_dir: Path) -> Path:
    """Where a preparation of out_dir is written until complete, then renamed to out_dir. out_dir
    is resolved, so this sits beside a link's target, on its disk."""
    return out_dir.with_name(f".{out_dir.name}.partial")


def write_json(path: Path, value: dict):
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
