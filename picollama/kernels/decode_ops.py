"""The Python side of decode_ops.cpp and prefill_attention.cpp.

It builds the C++ into torch.ops.picollama (decode_attention, int4_linear, prefill_attention).
It also names this CPU's vector ISA class (cpu_isa). Builds are cached per ISA class."""

import functools
import hashlib
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from picollama import REPO_ROOT
from picollama.cli.outputs import exclusive
from picollama.device import cpu_flags

ISA_FLAGS = (
    ("amx", "amx_tile"),
    ("avx512_bf16", "avx512_bf16"),
    ("avx512", "avx512f"),
    ("avx2", "avx2"),
)


@functools.cache
def decode_ops():
    """torch.ops.picollama with decode_ops.cpp's decode_attention and int4_linear, and
    prefill_attention.cpp's prefill_attention.

    The first call builds it (~16 s) into the project's cache, for this CPU and torch. Later
    processes load the built library as it is (1 ms, where torch's build check took 0.15 s).
    Without a C++ compiler it warns and returns None. Attention then goes through SDPA."""
    here = Path(__file__).parent
    paths = [here / "decode_ops.cpp", here / "prefill_attention.cpp"]
    source = "".join(path.read_text() for path in [*paths, here / "vectors.h"])
    key = hashlib.sha256(f"{source}|{cpu_isa()}|{torch.__version__}".encode()).hexdigest()[:16]
    folder = REPO_ROOT / ".cache" / "extensions" / key
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with build_lock(folder):
            built = folder / "picollama_decode_ops.so"
            if built.exists() and loaded(built):
                return registered()
            from torch.utils.cpp_extension import load

            load(  # Not load_inline, which puts torch/extension.h first.
                "picollama_decode_ops",
                sources=[str(path) for path in paths],
                is_python_module=False,
                build_directory=str(folder),
                # ATen's parallel_for is inlined here. Without -fopenmp it runs on one thread.
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
    except Exception as e:  # No compiler, or a failing one. SDPA still works.
        warnings.warn(f"decode_ops.cpp not built ({e}); attending with SDPA", stacklevel=2)
        return None
    return registered()


def loaded(library: Path) -> bool:
    """Whether a library built before loads. One a killed build left unfinished does not."""
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError):
        return False
    return True


def registered():
    """torch.ops.picollama, its ops' output shapes told to the compiler."""
    torch.library.register_fake("picollama::decode_attention")(_attention_shape)
    torch.library.register_fake("picollama::int4_linear")(_int4_shape)
    torch.library.register_fake("picollama::prefill_attention")(_prefill_shape)
    return torch.ops.picollama


@contextmanager
def build_lock(folder: Path):
    """One build in `folder` at a time, by a lock the OS releases when its holder dies.

    This is outputs.exclusive. A second build waits and says for whom. Torch also locks, with a
    file `lock` it removes when done. A killed build leaves that file, and every later build
    would wait forever. Under our lock no other build runs, so a stale file is removed. One line
    says so, unless exclusive already named the killed holder."""
    with exclusive(folder, wait=True) as gone:
        baton = folder / "lock"
        if baton.exists():
            baton.unlink(missing_ok=True)
            if gone is None:
                print(f"note: removed {baton}, left by a build that was killed", file=sys.stderr)
        yield


def _attention_shape(q, k, v, length, k_scale=None, v_scale=None, lengths=None):
    return q.new_empty(q.shape, dtype=torch.float32)


def _prefill_shape(q, k, v, mask=None, bf16=False):
    return q.new_empty(q.shape, dtype=torch.float32)


def _int4_shape(x, packed, group, scales_zeros):
    return x.new_empty(x.shape[0], packed.shape[0])


def isa_class(flags: set[str]) -> str:
    """The vector ISA class of /proc/cpuinfo flags: amx, avx512_bf16, avx512, avx2 or other."""
    return next((isa for isa, flag in ISA_FLAGS if flag in flags), "other")


def cpu_isa() -> str:
    """This machine's isa_class. It is "other" where /proc/cpuinfo has no flags line."""
    return isa_class(cpu_flags())
