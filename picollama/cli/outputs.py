"""Writing outputs safely. An output is replaced whole or not at all, and checked before long
work. A lock keeps one writer per output."""

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
    """Yield a temporary path beside `path`, renamed to `path` if the block succeeds.

    On failure it is removed and `path` keeps what it held. `path` must be absent, a regular file
    or a directory. `needed` bytes, where known, must be free first. A full disk, or a file written
    over a directory or the reverse, ends in a UserError naming the path. A symbolic link is
    written through. Its target is replaced from a temporary beside it, on the target's disk, since
    renaming a folder over a link fails."""
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
        if target.exists() and target.is_dir() != tmp.is_dir():  # No file for a folder, or back.
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
    """The one-line error if `e` means the disk filled while writing `path`, else None.
    Such are an OSError ENOSPC or EDQUOT, and torch's and safetensors' reports of one."""
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
    """A size in the unit that shows it, in units of 1000 with three digits: "0 bytes", "940
    bytes", "3.1 KB", "12 MB", "1.27 GB". A full disk once read "need about 0.00 GB and 0.00 GB
    are free"."""
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
    """What `path` is when it exists but is neither a regular file nor a directory, else None.
    Links are followed. Examples are "a FIFO", "a character device", "a symbolic link loop"."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return "a symbolic link loop" if e.errno == errno.ELOOP else None
    return next((name for test, name in FILE_KINDS.items() if test(mode)), None)


def check_output_kind(path):
    """UserError unless path is absent, a regular file or a directory. Symbolic links are followed.
    A link into a loop, a device, a FIFO or a socket is refused, and nothing is replaced. Absent
    includes a dangling link, whose target atomic_output writes. It also includes a path under a
    file, which check_writable reports."""
    kind = file_kind(path)
    if kind == "a symbolic link loop":
        raise UserError(f"cannot write {path}: a symbolic link loop; choose another output")
    if kind is not None:
        raise UserError(
            f"cannot write {path}: it is {kind}, not a regular file or directory; choose another "
            "output"
        )


def check_writable(path, inputs=(), directory: bool = False):
    """UserError unless `path` can be created or replaced, as a directory if `directory`.

    It must be absent, a regular file or a directory (check_output_kind). Its folder must be
    makeable and writable. It must not be, hold or lie inside any of `inputs`. Called before long
    work starts, so that it never ends in a failed write."""
    check_output_kind(path)
    path = resolved(path)
    for given in inputs:
        given = resolved(given)
        if path == given or given.is_relative_to(path) or path.is_relative_to(given):
            raise UserError(f"the output {path} overlaps the input {given}; choose another output")
    if path.exists() and path.is_dir() != directory:
        raise UserError(f"cannot write {path}: it is {'a file' if directory else 'a directory'}")
    # Test the nearest existing folder. Creating folders would leave them behind.
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise UserError(f"cannot write {path}: {existing} is a file, not a directory")
    # Test the directory itself too, where it exists. A resumed run writes into it, and replacing
    # it renames it. A read-only one once trained, then failed at the save.
    for folder in (existing, path) if directory and path.is_dir() else (existing,):
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".picollama-check-"):
                pass
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror or e}") from None


# Leftovers of an interrupted atomic_output or replace (.NAME.tmp-PID, .NAME.old-PID). Also a
# killed writer's lock file (.NAME.lock).
LEFTOVER = r"\..+\.(tmp|old)-\d+|\..+\.lock"


def pid_gone(pid: int) -> bool:
    """Whether no process has the id `pid`. Another user's process counts as there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_leftovers(target: Path):
    """Remove what a killed atomic_output or replace left of `target`, so no temporary stays for
    good. Those are .NAME.tmp-PID and .NAME.old-PID of a process that is gone."""
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
    """UserError unless `folder` is absent, empty or written by picollama. So replacing it never
    deletes a user's files. It must hold the files `marks`. Other entries may only be files
    matching the regular expression `files`, folders matching `folders`, and leftovers of a write.
    Links count as files, and only the link is removed. `what` says in the message what may be
    replaced. A file at `folder` is the caller's to judge."""
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


WAIT_SAID = 2.0  # Seconds of waiting for a lock before saying so.
RESULT_BYTES = 1 << 26  # Results picollama writes are smaller.


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
    """The ownership rule of a result file, the JSON a command writes.

    UserError unless `path` is absent, empty, or a result of `writer`. `writer_of(the JSON object)`
    names the command that wrote it, or None. With `force`, another picollama command's result may
    go too. A file picollama did not write, such as a README, never goes."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return  # Absent. check_writable and check_output_kind judge a folder or a device.
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
    """Hold the one-writer lock of the output `path`, such as a run or a dataset, for the block.

    The lock is an advisory fcntl.flock on .NAME.lock beside it, which records the holder's pid.
    The OS frees it on any exit, even SIGKILL. If another process holds it, a UserError names its
    pid. With `wait` it waits, saying so once. A lock file left by a dead process is taken over,
    with a note. Yields that process's pid, or None. Folders made for the lock go if left empty."""
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
        lock_path.unlink(missing_ok=True)  # First, so no one locks a file that is going.
        os.close(fd)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def locked(path: Path, lock_path: Path, wait: bool) -> int:
    """A descriptor of lock_path, flock-ed exclusively for `exclusive`. UserError naming the
    holder if another process holds it, unless `wait`, which is said after WAIT_SAID seconds."""
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
        # Its last holder may have removed the file between our open and our lock. Then lock the
        # new one.
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
