"""Run train.py with glibc's malloc asking for transparent huge pages. Some kernels give them only
to memory that asks. That is THP "madvise" mode, the default on Debian and Ubuntu."""

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"  # glibc 2.35+ then asks huge pages for what malloc maps.
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, ...]:
    """glibc's (major, minor), or () where the C library is another."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    except (ValueError, OSError, AttributeError):
        return ()
    return tuple(map(int, version.split(".")[:2])) if name == "glibc" else ()


def wants_tunable() -> bool:
    """Whether this process would gain from TUNABLE: Linux, glibc >= 2.35, THP in madvise mode.
    No hugetlb tunable may be set already, by us or by a user who chose otherwise."""
    if not sys.platform.startswith("linux") or "hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        madvise = "[madvise]" in THP_MODE.read_text()
    except OSError:
        return False
    return madvise and glibc_version() >= (2, 35)


def malloc_huge_pages():
    """Start this command again with TUNABLE, since glibc reads tunables only at process start.
    It runs before torch's import, while a restart costs little. A step's activations, a few
    hundred MB read and written every step, then sit on 2 MB pages. The default model on a 2-core
    Zen 4 gained 1-2.4% tokens/s, with the same values (docs/findings.md)."""
    if not wants_tunable():
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), TUNABLE]))
    os.environ["GLIBC_TUNABLES"] = tunables
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        pass  # Cannot start again, so train as it is.
