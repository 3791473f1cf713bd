"""Run train.py with glibc's malloc asking for transparent huge pages, where the kernel gives them
only to memory that asks (THP "madvise", Debian's and Ubuntu's default)."""

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) on what malloc maps
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, ...]:
    """glibc's (major, minor), or () where the C library is another."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (ValueError, OSError, AttributeError):
        return ()
    return tuple(map(int, version.split(".")[:2])) if name == "glibc" else ()


def wants_tunable() -> bool:
    """Whether this process would gain from TUNABLE: Linux with glibc >= 2.35, THP in madvise
    mode, and no hugetlb tunable already set (by us, or by a user who chose otherwise)."""
    if not sys.platform.startswith("linux") or "hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        madvise = "[madvise]" in THP_MODE.read_text()
    except OSError:
        return False
    return madvise and glibc_version() >= (2, 35)


def malloc_huge_pages():
    """Start this command again with TUNABLE (glibc reads tunables only when a process starts),
    before torch's import makes that cost anything. A training step's activations, a few hundred
    MB that every step reads and writes, then sit on 2 MB pages: 1-2.4% more tokens/s for the
    default model on a 2-core Zen 4, the same values (docs/findings.md)."""
    if not wants_tunable():
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), TUNABLE]))
    os.environ["GLIBC_TUNABLES"] = tunables
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        pass  # cannot start again: train as it is
