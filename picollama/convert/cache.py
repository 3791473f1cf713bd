"""The cache of imported .gguf files and Hugging Face folders.

--run imports such a source once and reuses it. An import whose source changed or went away
is evicted."""

import hashlib
import json
import re
import sys
from pathlib import Path

from data.sources import cache_dir
from picollama.cli.outputs import atomic_output, pid_gone, remove
from picollama.convert.from_gguf import import_gguf
from picollama.convert.hf import import_hf
from picollama.device import gib
from picollama.run_files import is_gguf_file, is_hf_directory

TEMPORARY = re.compile(r"\..+\.(tmp|old)-(\d+)")  # Left by a killed import (outputs.LEFTOVER).


def folder() -> Path:
    """Where imports are cached (PICOLLAMA_CACHE, else .cache/picollama; imported/)."""
    return cache_dir() / "imported"


def source_files(source: Path) -> list[Path] | None:
    """The files an import of `source` reads: a .gguf file, or a Hugging Face folder's files.

    None where `source` is neither. Then --run names a run directory."""
    if is_gguf_file(source):
        return [source]
    if source.is_dir() and is_hf_directory(source):
        return sorted(p for p in source.iterdir() if p.is_file())
    return None


def stamp(files: list[Path]) -> str:
    """What changes when any of `files` does: their paths, sizes and modification times, hashed."""
    stamps = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:12]


def imported_run(source: Path) -> Path:
    """What --run names, as a run directory.

    A .gguf file or Hugging Face directory is imported into the cache once. It is imported again
    when its files change, and the stale copy is evicted. One line reports the cache's size.
    Anything else passes through. The import writes atomically, so a failure leaves nothing."""
    source = Path(source)
    files = source_files(source)
    if files is None:
        return source
    key = stamp(files)
    run = folder() / f"{source.resolve().name}-{key}"
    imported = not (run / "config.json").is_file()
    if imported:
        (import_gguf if is_gguf_file(source) else import_hf)(source, run)
    if imported or not record_of(run).is_file():  # After the import, so only whole ones count.
        with atomic_output(record_of(run)) as tmp:
            tmp.write_text(json.dumps({"source": str(source.resolve()), "stamp": key}) + "\n")
    freed = evict_stale()
    evicted = f", after {gib(freed)} of stale imports were removed" if freed else ""
    if imported:
        entries = cache_entries()
        print(
            f"imported {source} into {run} (once; the cache holds {len(entries)} import"
            f"{'s' * (len(entries) != 1)}, {gib(sum(e['bytes'] for e in entries))}{evicted}: "
            "python -m picollama.convert cache lists them)",
            file=sys.stderr,
        )
    elif freed:
        print(f"note: removed {gib(freed)} of stale imports from {folder()}", file=sys.stderr)
    return run


def record_of(run: Path) -> Path:
    """The file beside a cached import naming its source and the stamp it was imported at."""
    return run.with_name(run.name + ".source.json")


def state(run: Path) -> tuple[str | None, str]:
    """(source, state) of a cached import. The state is "current", "changed", "gone" or "unknown".

    "unknown" is an unreadable record, or an import from before the cache recorded sources."""
    try:
        record = json.loads(record_of(run).read_text())
        source, key = Path(record["source"]), record["stamp"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "unknown"
    files = source_files(source)
    if files is None:
        return str(source), "gone"
    return str(source), "current" if stamp(files) == key else "changed"


def size(path: Path) -> int:
    """The bytes of a file, or of every file under a folder. Links are not followed."""
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size if path.exists() or path.is_symlink() else 0
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir() or f.is_symlink())


def cache_entries() -> list[dict]:
    """The cached imports: {"run", "source", "state", "bytes"}, by name."""
    if not folder().is_dir():
        return []
    entries = []
    for run in sorted(folder().iterdir()):
        if run.is_dir() and not run.name.startswith("."):
            source, status = state(run)
            entries.append({"run": run, "source": source, "state": status, "bytes": size(run)})
    return entries


def dead_temporaries() -> list[Path]:
    """Temporaries in the cache whose process is gone: what killed imports left."""
    if not folder().is_dir():
        return []
    found = [(p, TEMPORARY.fullmatch(p.name)) for p in folder().iterdir()]
    return [p for p, match in found if match and pid_gone(int(match[2]))]


def evict(runs: list[Path]) -> int:
    """Remove cached imports, their records and killed imports' leftovers. Return bytes freed."""
    freed = 0
    for path in [*runs, *dead_temporaries()]:
        freed += size(path)
        remove(path)
        record_of(path).unlink(missing_ok=True)
    return freed


def evict_stale() -> int:
    """Evict imports whose source changed or is gone, and leftovers. Return the bytes freed."""
    return evict([e["run"] for e in cache_entries() if e["state"] in ("changed", "gone")])


def cache_command(clear: bool) -> int:
    """`python -m picollama.convert cache [--clear]`.

    It lists the cached imports with sizes and sources, marking stale ones. --clear removes all."""
    entries = cache_entries()
    if clear:
        freed = evict([e["run"] for e in entries])
        print(f"removed {len(entries)} cached imports from {folder()}: {gib(freed)} freed")
        return 0
    for e in entries:
        said = {"current": "", "changed": " (its source changed)", "gone": " (its source is gone)"}
        note = said.get(e["state"], " (source not recorded)")
        print(f"{gib(e['bytes']):>10}  {e['run'].name}  from {e['source'] or '?'}{note}")
    left = sum(size(p) for p in dead_temporaries())
    total = sum(e["bytes"] for e in entries) + left
    extra = f", {gib(left)} of them left by killed imports" if left else ""
    print(f"{len(entries)} cached imports in {folder()}: {gib(total)}{extra}")
    return 0
