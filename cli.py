"""What every command shares: the one error type for user mistakes, an argument parser raising it, the `error:` exit,
and atomic outputs."""

import argparse
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


class UserError(ValueError):
    """A mistake the user fixes by changing the command, config, data or paths: one `error:` line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so that run_command prints them as one `error:` line."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")


def one_line(e: BaseException) -> str:
    """An exception as one readable line, naming the path for OS errors."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
        return "out of memory: choose a smaller model, batch or length"
    return " ".join(str(e).split()) or type(e).__name__


def run_command(main, argv=None) -> int:
    """main(argv)'s exit status; user mistakes, OS errors and exhausted memory become one `error:` line and
    status 2 (Ctrl-C: 130). Only rank 0 of a torchrun job prints."""
    try:
        return main(sys.argv[1:] if argv is None else list(argv)) or 0
    except KeyboardInterrupt:
        message, status = "interrupted", 130
    except (ValueError, OSError, MemoryError) as e:
        message, status = one_line(e), 2
    except RuntimeError as e:  # torch reports a failed allocation as a RuntimeError
        if "can't allocate memory" not in str(e) and "out of memory" not in str(e).lower():
            raise
        message, status = one_line(e), 2
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    return status


def remove(path: Path):
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(src: Path, dst: Path):
    """Rename src over dst (a file or a directory, which need not be empty)."""
    if dst.is_dir() and not dst.is_symlink():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        remove(old)
        os.replace(dst, old)
        os.replace(src, dst)
        remove(old)
    else:
        os.replace(src, dst)


@contextmanager
def atomic_output(path):
    """Yield a temporary path beside `path`; when the block succeeds it is renamed to `path` (file or directory),
    otherwise it is removed and `path` keeps what it held."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    remove(tmp)
    try:
        yield tmp
        replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def check_writable(path, inputs=(), directory: bool = False):
    """UserError unless `path` (a directory if `directory`, else a file) can be created or replaced: its folder can
    be made and written to, and it is not, does not contain, and does not lie inside any of `inputs`.
    Called before long work starts, so that it never ends in a failed write."""
    path = Path(path).resolve()
    for given in inputs:
        given = Path(given).resolve()
        if path == given or given.is_relative_to(path) or path.is_relative_to(given):
            raise UserError(f"the output {path} overlaps the input {given}; choose another output")
    if path.exists() and path.is_dir() != directory:
        raise UserError(f"cannot write {path}: it is {'a file' if directory else 'a directory'}")
    existing = next(p for p in path.parents if p.exists())  # test there: creating folders would leave them behind
    if not existing.is_dir():
        raise UserError(f"cannot write {path}: {existing} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".picollama-check-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
