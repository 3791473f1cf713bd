"""train.py starts again with glibc's huge-page malloc where THP is opt-in, and only there."""

import os
import subprocess
import sys

import pytest

from picollama.training import huge_pages

SCRIPT = """
import os, sys
print("started", file=sys.stderr)
from picollama.training.huge_pages import malloc_huge_pages
malloc_huge_pages()
print(repr((sys.argv[1:], sys.flags.utf8_mode, os.environ["GLIBC_TUNABLES"])))
"""
MODES = {
    "always [madvise] never\n": True,
    "[always] madvise never\n": False,  # every large mapping gets huge pages already
    "always madvise [never]\n": False,
}


@pytest.mark.parametrize("mode", MODES)
def test_only_opt_in_huge_pages_want_the_tunable(mode, tmp_path, monkeypatch):
    (tmp_path / "enabled").write_text(mode)
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "enabled")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert huge_pages.wants_tunable() is MODES[mode]
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # a user's choice stands
    assert huge_pages.wants_tunable() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 34))  # no such tunable yet
    assert huge_pages.wants_tunable() is False


def opt_in_machine() -> bool:
    """This machine's facts, read without the module: Linux, glibc >= 2.35, THP "madvise"."""
    if not sys.platform.startswith("linux"):
        return False
    name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
    mode = huge_pages.THP_MODE.read_text() if huge_pages.THP_MODE.exists() else ""
    glibc = name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)
    return glibc and "[madvise]" in mode


def test_a_process_starts_again_with_the_tunable_and_its_arguments(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    command = [sys.executable, "-X", "utf8", str(script), "a b"]
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    argv, utf8_mode, tunables = eval(run.stdout)
    assert (argv, utf8_mode) == (["a b"], 1)  # the same arguments and interpreter options
    again = opt_in_machine()
    assert run.stderr == "started\n" * (1 + again)
    assert tunables == "glibc.malloc.arena_max=2" + ":glibc.malloc.hugetlb=1" * again
