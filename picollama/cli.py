"""What every command shares: UserError and its `error:` exit, the flags, checks, outputs, locks."""

import argparse
import errno
import fcntl
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import types
import typing
from contextlib import contextmanager
from pathlib import Path


class UserError(ValueError):
    """A mistake the user fixes in the command, config, data or paths: one `error:` line, exit 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so that run_command prints them as one `error:`
    line, and whose flags come from the vocabulary below, shared by every command."""

    def error(self, message):
        raise UserError(f"{message} (see --help)")

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        missing = [
            flag
            for dest, flag in getattr(self, "needed", ())
            if getattr(namespace, dest, None) is None
        ]
        if missing:  # checked here, not by argparse, so that a flag's old spelling can supply it
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return namespace, rest


# ---- the command-line vocabulary: each shared flag is defined once here (README: One set of flags)


def positive(kind=int, zero: bool = False):
    """An argparse type: a finite number of `kind` above 0 (or at least 0, with zero=True)."""

    def parse(text: str):
        value = kind(text)
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise ValueError(text)
        return value

    parse.__name__ = f"{'non-negative' if zero else 'positive'} {kind.__name__}"
    return parse


def comma_list(item=str, choices=None):
    """An argparse type: a non-empty comma-separated list, each item through `item` (and one of
    `choices`, if given)."""

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


def add_device(parser: ArgumentParser, default: str | None = "auto"):
    """--device and --dtype, "auto" by default (None: the config's, in train.py)."""
    said = f"default {default}" if default else "default: the config's, else auto"
    parser.add_argument(
        "--device",
        default=default,
        help=f"auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps ({said})",
    )
    parser.add_argument(
        "--dtype",
        default=default,
        help="auto (bfloat16 where the device computes it natively, else float32), float32, "
        f"bfloat16 or float16 ({said})",
    )


def add_compile(parser: ArgumentParser, what: str, default: bool | None = False):
    """--compile / --no-compile (None: the config's, in train.py)."""
    said = "the config's, else off" if default is None else "on" if default else "off"
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"torch.compile {what} (default {said}; ~10-70 s the first time)",
    )


SEEDS = 2**32  # the seeds torch's CPU generator tells apart (it keeps a seed's low 32 bits)


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
    """--seed N, in 0..SEEDS-1; `unset` says what no seed means."""
    said = unset if default is None else default
    parser.add_argument(
        "--seed",
        type=positive(int, zero=True),
        action=Seed,
        default=default,
        help=f"{what} (default {said})",
    )


def one_line(e: BaseException) -> str:
    """An exception as one readable line, naming the path for OS errors."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    if out_of_memory(e):
        return "out of memory: choose a smaller model, batch or length"
    return " ".join(str(e).split()) or type(e).__name__


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` reports exhausted memory (torch's failed allocations are RuntimeErrors)."""
    text = str(e)
    return (
        isinstance(e, MemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, with a message saying what was kept (e.g. where --resume continues)."""


def run_command(main, argv=None) -> int:
    """main(argv)'s exit status; user mistakes, OS errors and exhausted memory become one `error:`
    line and status 2; Ctrl-C (130) and SIGTERM (143) at any moment become one `error:` line too,
    even where Python would swallow the KeyboardInterrupt (in a __del__ or a callback). Only rank 0
    of a torchrun job prints."""
    received = []
    with interrupt_handlers(received):
        try:
            status = main(sys.argv[1:] if argv is None else list(argv)) or 0
            if not received:
                return status
            # a signal whose KeyboardInterrupt was swallowed: the work may be incomplete
            message = "interrupted"
        except KeyboardInterrupt as e:
            message, status = str(e) or "interrupted", 128 + signal.SIGINT
        except (ValueError, OSError, MemoryError) as e:
            message, status = one_line(e), 2
        except RuntimeError as e:
            if not out_of_memory(e):
                raise
            message, status = one_line(e), 2
    if received:
        status = 128 + received[0]
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    return status


@contextmanager
def interrupt_handlers(received: list):
    """SIGINT and SIGTERM raise KeyboardInterrupt and are recorded in `received`; a
    KeyboardInterrupt that Python reports as "Exception ignored" is not printed (the caller sees it
    in `received`). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def unraisable(info):
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous_hook(info)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        sys.unraisablehook = previous_hook


@contextmanager
def held_signals(escape: bool = True):
    """SIGINT and SIGTERM wait until the block ends (work that must finish, or leave nothing), then
    arrive as if sent then; with `escape`, a second one while waiting arrives at once. Yields the
    signals received while holding. Main thread only (elsewhere the block runs as it is)."""
    received = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def hold(signum, frame):
        received.append(signum)
        if escape and len(received) == 2:  # asked twice: stop now (the caller cleans up)
            restore()
            signal.raise_signal(signum)

    def restore():
        for s, old in previous.items():
            signal.signal(s, old)

    for s in previous:
        signal.signal(s, hold)
    try:
        yield received
    finally:
        restore()
        if received and not (escape and len(received) > 1):  # else delivered already
            signal.raise_signal(received[0])  # its own handler: a KeyboardInterrupt, or the default


def utf8_argument(text: str, flag: str) -> str:
    """A command-line text, refused unless UTF-8: other bytes reach Python as lone surrogates,
    which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = len(text[: e.start].encode("utf-8"))
        raise UserError(
            f"{flag} is not UTF-8 text (byte {byte}); set the terminal to UTF-8"
        ) from None
    return text


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
def atomic_output(path, needed: int | None = None):
    """Yield a temporary path beside `path`; when the block succeeds it is renamed to `path` (file
    or directory), otherwise it is removed and `path` keeps what it held. `path` must be absent, a
    regular file or a directory; `needed` bytes (where the size is known) must be free first. A full
    disk ends in a UserError naming the path, and so does a file written over a directory or the
    reverse. A symbolic link is written through: its target is replaced, by a temporary beside it
    (on its disk; renaming a folder over a link fails)."""
    path = Path(path)
    check_output_kind(path)
    target = resolved(path)
    if needed is not None:
        check_free_space(target, needed)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    remove(tmp)
    try:
        yield tmp
        if target.exists() and target.is_dir() != tmp.is_dir():  # never one for the other
            raise UserError(
                f"cannot write {path}: it is {'a directory' if target.is_dir() else 'a file'}"
            )
        replace(tmp, target)
    except BaseException as e:
        remove(tmp)
        failure = write_failure(path, e, needed)
        if failure is not None:
            raise failure from None
        raise


def write_failure(path, e: BaseException, needed: int | None = None) -> "UserError | None":
    """The one-line error for an exception that means the disk is full while writing `path` (an
    OSError ENOSPC or EDQUOT, or torch's and safetensors' reports of one); None otherwise."""
    text = str(e)
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    full = full or "No space left on device" in text or "Disk quota exceeded" in text
    full = full or (
        isinstance(e, RuntimeError) and "inline_container" in text and "unexpected pos" in text
    )
    if not full:
        return None
    note = space_note(path, needed)
    return UserError(f"cannot write {path}: No space left on device ({note}); free some space")


def space_note(path, needed: int | None) -> str:
    free = shutil.disk_usage(existing_parent(Path(path))).free
    return f"{free:,} bytes free" + (f", about {needed:,} needed" if needed is not None else "")


def check_free_space(path, needed: int, what: str | None = None):
    """UserError unless the file system that will hold `path` has `needed` bytes free."""
    if shutil.disk_usage(existing_parent(Path(path))).free < needed:
        raise UserError(
            f"cannot write {what or path}: not enough disk space ({space_note(path, needed)})"
        )


def existing_parent(path: Path) -> Path:
    return next(p for p in Path(os.path.abspath(path)).parents if p.exists())


FILE_KINDS = {
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
}


def file_kind(path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory ("a FIFO", "a
    character device", "a symbolic link loop", ...; links are followed); None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return "a symbolic link loop" if e.errno == errno.ELOOP else None
    return next((name for test, name in FILE_KINDS.items() if test(mode)), None)


def check_output_kind(path):
    """UserError unless path is absent, a regular file or a directory (a symbolic link is followed:
    to one of those it is fine; into a loop, a device, a FIFO or a socket it is refused, and nothing
    is replaced). Absent includes a dangling link (atomic_output writes its target) and a folder
    that is not one (check_writable says)."""
    kind = file_kind(path)
    if kind == "a symbolic link loop":
        raise UserError(f"cannot write {path}: a symbolic link loop; choose another output")
    if kind is not None:
        raise UserError(
            f"cannot write {path}: it is {kind}, not a regular file or directory; choose another "
            "output"
        )


def check_writable(path, inputs=(), directory: bool = False):
    """UserError unless `path` (a directory if `directory`, else a file) can be created or replaced:
    it is absent, a regular file or a directory (check_output_kind), its folder can be made and
    written to, and it is not, does not contain, and does not lie inside any of `inputs`. Called
    before long work starts, so that it never ends in a failed write."""
    check_output_kind(path)
    path = resolved(path)
    for given in inputs:
        given = resolved(given)
        if path == given or given.is_relative_to(path) or path.is_relative_to(given):
            raise UserError(f"the output {path} overlaps the input {given}; choose another output")
    if path.exists() and path.is_dir() != directory:
        raise UserError(f"cannot write {path}: it is {'a file' if directory else 'a directory'}")
    # test there: creating folders would leave them behind
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise UserError(f"cannot write {path}: {existing} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".picollama-check-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


# what an interrupted atomic_output or replace leaves in a folder: .NAME.tmp-PID, .NAME.old-PID
LEFTOVER = r"\..+\.(tmp|old)-\d+"


def check_replaceable(folder: Path, files: str, folders: str = "", marks=(), what: str = ""):
    """UserError unless `folder` is absent, empty or what picollama wrote: it holds the files
    `marks` and nothing else but files whose names match the regular expression `files`, folders
    whose names match `folders`, and leftovers of an interrupted write. So that replacing it never
    deletes a user's files; `what` says, in the message, what may be replaced (links count as
    files: only the link is removed). A file `folder` is the caller's to judge."""
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    foreign = []
    for entry in entries:
        is_folder = entry.is_dir() and not entry.is_symlink()
        if not re.fullmatch(f"{folders if is_folder else files}|{LEFTOVER}", entry.name):
            foreign.append(entry.name + "/" * is_folder)
    missing = [mark for mark in marks if not (folder / mark).is_file()]
    if not entries or not foreign and not missing:
        return
    held = f"holds {listed(foreign)}" if foreign else f"holds no {' and '.join(missing)}"
    advice = "move them out or choose another output" if foreign else "choose another output"
    raise UserError(
        f"not replacing {folder}: it {held}, so picollama did not write it all ({what}); {advice}"
    )


def listed(names: list[str], most: int = 3) -> str:
    """'a', 'a and b', 'a, b and c', 'a, b, c and 2 more'."""
    shown = names[:most] if len(names) <= most else [*names[:most], f"{len(names) - most} more"]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def resolved(path) -> Path:
    try:
        return Path(path).resolve()
    except RuntimeError:  # Python 3.11's report of a symbolic link loop
        raise UserError(f"{path}: a symbolic link loop") from None


@contextmanager
def exclusive(path):
    """Hold the one-writer lock of `path` (a run or dataset directory) for the block: an advisory
    fcntl.flock on the lock file .NAME.lock beside it, which records the holder's pid and which the
    OS releases on any exit, even SIGKILL. UserError, naming that pid, when another process holds
    it. Folders made for the lock file are removed again if left empty."""
    path = resolved(path)
    lock_path = path.parent / f".{path.name}.lock"
    made = [p for p in path.parents if not p.exists()]
    while True:
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(
                f"{path} is in use by another process (pid {holder}, lock file {lock_path}); wait "
                "for it to end"
            ) from None
        # the file may have been removed by its last holder between our open and our lock: lock
        # the new one
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # before unlocking: no one locks a file that is going
        os.close(fd)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def check_type(name: str, value, annotation):
    """value, of the type `annotation` (int, float, str, bool, or one of those | None; an int passes
    as a float); UserError naming `name` otherwise (a bool is not an int, a string not a bool)."""
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
