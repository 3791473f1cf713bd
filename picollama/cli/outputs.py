"""Writing outputs safely: atomic replacement, checks before writing, free space, locks."""

import errno
import fcntl
import glob
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from picollama.cli import UserError


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
    remove_leftovers(target)
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
    """What the disk of `path` has free, and about what is `needed` (None: not known)."""
    free = shutil.disk_usage(existing_parent(Path(path))).free
    return f"{byte_size(free)} free" + (f", about {byte_size(needed)} needed" if needed else "")


def byte_size(count: int) -> str:
    """A size in the unit that shows it: "0 bytes", "940 bytes", "3.1 KB", "12 MB", "1.27 GB" (units
    of 1000; three digits). A full disk once read "need about 0.00 GB and 0.00 GB are free"."""
    if count < 1000:
        return f"{count:,} byte{'' if count == 1 else 's'}"
    for unit in ("KB", "MB", "GB", "TB", "PB"):
        count /= 1000
        if count < 999.5 or unit == "PB":
            return f"{count:.3g} {unit}" if count < 999.5 else f"{count:,.0f} {unit}"


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
    # and in the directory itself where it exists: a run resumed there writes into it (a read-only
    # one trained, then failed at the save), and replacing it renames it
    for folder in (existing, path) if directory and path.is_dir() else (existing,):
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".picollama-check-"):
                pass
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None


# what an interrupted atomic_output or replace leaves in a folder (.NAME.tmp-PID, .NAME.old-PID),
# and a killed writer's lock file (.NAME.lock)
LEFTOVER = r"\..+\.(tmp|old)-\d+|\..+\.lock"


def pid_gone(pid: int) -> bool:
    """Whether no process has the id `pid` (one of another user's is there: not gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_leftovers(target: Path):
    """Remove what atomic_output and replace left of `target` when killed (.NAME.tmp-PID and
    .NAME.old-PID of a process that is gone): a SIGKILL leaves no temporary behind for good."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)")
    try:
        entries = list(target.parent.glob(f".{glob.escape(target.name)}.*-*"))
    except OSError:
        return
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and int(match[2]) > 0 and pid_gone(int(match[2])):
            remove(entry)


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


WAIT_SAID = 2.0  # seconds a wait for a lock (exclusive's `wait`) goes on before it is said
RESULT_BYTES = 1 << 26  # a result file picollama writes is smaller: a larger file is not one


def json_object(path: Path) -> dict | None:
    """The JSON object file `path` holds, or None where it holds something else (or is huge)."""
    try:
        if path.stat().st_size > RESULT_BYTES:
            return None
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def check_own_result(path, writer: str, writer_of, force: bool = False, flag: str = "--out"):
    """The ownership rule of a result file (the JSON a command writes): UserError unless `path` is
    absent, empty, or the result of `writer` (`writer_of(the JSON object)` names the command that
    wrote one, None for none); with `force`, the result of another picollama command too. Never a
    file picollama did not write (a README, a user's data), whatever the flags."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return  # absent, or a folder or a device: check_writable's and check_output_kind's
    found = json_object(path)
    found = writer_of(found) if found is not None else None
    if found == writer or (force and found is not None):
        return
    if found is None:
        raise UserError(
            f"not replacing {path}: it is not a result of {writer}, so picollama did not write "
            f"it; choose another {flag}"
        )
    raise UserError(
        f"not replacing {path}: it holds the results of {found}, not of {writer}; pass --force "
        f"to replace it, or choose another {flag}"
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
def exclusive(path, wait: bool = False):
    """Hold the one-writer lock of `path` (an output: a run, a dataset, a report) for the block: an
    advisory fcntl.flock on the lock file .NAME.lock beside it, which records the holder's pid and
    which the OS releases on any exit, even SIGKILL. When another process holds it: a UserError
    naming its pid, or with `wait` a wait for it (said in one line). A lock file left by a process
    that is gone is taken over, said in one line. Yields that process's pid (None if there was
    none). Folders made for the lock file are removed again if left empty."""
    path = resolved(path)
    lock_path = path.parent / f".{path.name}.lock"
    made = [p for p in path.parents if not p.exists()]
    fd = locked(path, lock_path, wait)
    try:
        previous = os.read(fd, 64).decode(errors="replace").strip()
        gone = int(previous) if previous.isdigit() and int(previous) != os.getpid() else None
        if gone is not None:
            print(
                f"note: took over the lock of {path} left by pid {gone}, which ended without "
                "releasing it (killed?)",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield gone
    finally:
        lock_path.unlink(missing_ok=True)  # before unlocking: no one locks a file that is going
        os.close(fd)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def locked(path: Path, lock_path: Path, wait: bool) -> int:
    """A descriptor of lock_path, flock-ed exclusively (exclusive's lock): UserError naming the
    holder when another process holds it, unless `wait` (said after WAIT_SAID seconds)."""
    waited = time.monotonic()
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
            if not wait:
                raise UserError(
                    f"{path} is in use by another process (pid {holder}, lock file {lock_path}); "
                    "wait for it to end"
                ) from None
            if waited is not None and time.monotonic() - waited > WAIT_SAID:
                print(f"waiting for pid {holder}, which is writing {path}", file=sys.stderr)
                waited = None
            time.sleep(0.1)
            continue
        # the file may have been removed by its last holder between our open and our lock: lock
        # the new one
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
