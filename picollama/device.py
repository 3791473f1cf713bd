"""Where and how training runs: the device, the dtype and a job's ranks. Also each GPU's peak
FLOP/s, glibc's memory reuse, and the CPU threads that the machine's other work leaves free."""

import contextlib
import ctypes
import ctypes.util
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import init_device_mesh

import model
from picollama.cli import UserError

# Dense bf16 tensor-core peaks in TFLOP/s, by device-name substring. The first match wins.
GPU_BF16_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# Devices whose tensors neither gloo nor nccl can hold, even in a group of one. That is MPS.
NO_COLLECTIVES = ("mps",)
# Devices where one process trains the plain model, with no group and no FSDP2. On the CPU a
# group of one only added FSDP2's per-block copies and hooks. Without them, the default config
# ran 1.3x the tokens/s, compiled (docs/findings.md).
UNGROUPED = ("mps", "cpu")


def mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def pick_device(name: str | None = None) -> torch.device:
    """The named device (cpu, cuda, cuda:1, mps), or what the machine has: cuda, else Apple's
    mps, else cpu. UserError if unusable."""
    if name in (None, "auto"):
        return torch.device(
            "cuda" if torch.cuda.is_available() else "mps" if mps_available() else "cpu"
        )
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(
            f"device {name!r}: not a device (examples: cpu, cuda, cuda:1, mps)"
        ) from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(
            f"device {name!r}: picollama runs on cpu, cuda (cuda:N) or mps; choose one of those"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r}: CUDA is not available on this machine")
    count = torch.cuda.device_count() if device.type == "cuda" else None
    if count is not None and device.index is not None and device.index >= count:
        raise UserError(f"device {name!r}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not mps_available():
        raise UserError(
            f"device {name!r}: MPS (Apple's GPU) is not available on this machine; use cpu"
        )
    return device


class Dist:
    """Rank, world size, device, device mesh and the collectives training needs.
    A single process on an UNGROUPED device has no group. Its mesh is None, so there is no FSDP2.
    Elsewhere it is an in-process group of one. It runs the same FSDP2 code as N ranks."""

    def __init__(self, device_name: str):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = pick_device(device_name)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.mesh = None  # No group: a plain model, no FSDP2.
        if self.device.type in NO_COLLECTIVES and self.world_size > 1:
            raise UserError(
                f"no collective backend serves {self.device.type} tensors: train there in one "
                "process"
            )
        if self.device.type in UNGROUPED and self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:  # Set by torchrun.
            torch_dist.init_process_group(backend)
        else:
            store = torch_dist.HashStore()
            torch_dist.init_process_group(backend, store=store, rank=0, world_size=1)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.mesh is not None:
            torch_dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            torch_dist.all_reduce(tensor)
        return tensor

    def mean(self, scalar: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor, as a Python number (a host sync)."""
        return self.all_reduce_sum(scalar).item() / self.world_size

    def close(self):
        """Destroy the process group once nothing references the model and optimizer.
        Otherwise gloo can abort at exit (pytorch#190489). So drop the mesh, collect the freed
        FSDP modules, then destroy."""
        self.mesh = None
        if torch_dist.is_initialized():
            gc.collect()  # Costs ~0.2 s, so only with a group to destroy.
            torch_dist.destroy_process_group()


def check_compiler():
    """UserError unless torch.compile can build kernels, since Inductor needs a C++ compiler.

    Then Inductor trusts the CPU's flags for its vector ISAs (AVX2, AVX-512). Otherwise it builds a
    test program for each before its first kernel. That took 5.5 s of a 5-minute run's cold start
    on a 2-core Zen 4. A TORCHINDUCTOR_VEC_ISA_OK that the user sets decides instead."""
    from torch._inductor import config, cpp_builder  # Imported only when compiling. It is slow.

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # Inductor's InvalidCxxCompiler, or whatever its search hits.
        raise UserError(
            "--compile needs a working C++ compiler for torch.compile (Inductor), and none was "
            "found (tried $CXX, g++); install one, or run without compiling (--no-compile)"
        ) from None
    if "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:
        config.cpp.vec_isa_ok = True


def cpu_flags() -> set[str]:
    """The feature flags of this CPU, from /proc/cpuinfo (none where it has no flags line)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    line = next((line for line in lines if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively, with AVX-512 BF16 or AMX. There bf16 beats fp32."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


@contextlib.contextmanager
def cpu_sdpa(device: torch.device, kernel):
    """While it lasts, model.py's attention calls `kernel` in SDPA's place (model.SDPA_KERNEL),
    on a CPU device only. Training and sampling's prefill each bring their own."""
    if device.type != "cpu":
        yield
        return
    kept, model.SDPA_KERNEL = model.SDPA_KERNEL, kernel
    try:
        yield
    finally:
        model.SDPA_KERNEL = kept


def keep_freed_memory():
    """Make glibc keep the memory a training step frees, for the next step. Linux only.

    By default glibc returns large freed blocks to the OS, and the next step faults them back in.
    The default model on 2 cores took ~110k page faults a step, a quarter of its time. This raised
    it from 9.6k to 12.9k tokens/s. The cost is that the process keeps its peak memory."""
    if not sys.platform.startswith("linux") or (name := ctypes.util.find_library("c")) is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):  # M_TRIM_THRESHOLD (-1) and M_MMAP_THRESHOLD (-3) to 1 GiB.
        libc.mallopt(-1, 1 << 30)
        libc.mallopt(-3, 1 << 30)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The named dtype. "auto" or None picks bfloat16 where the device computes it natively, else
    float32. Native means a GPU that supports it, or a CPU with cpu_has_bf16()."""
    if name in (None, "auto"):
        native = (
            torch.cuda.is_bf16_supported()
            if device.type == "cuda"
            else device.type == "cpu" and cpu_has_bf16()
        )
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise UserError(f"dtype {name!r}: choose float32, bfloat16 or float16")
    return DTYPES[name]


def peak_flops(device: torch.device, tflops: float | None = None) -> float | None:
    """Peak FLOP/s for MFU. `tflops` when given, else the GPU table. None when unknown (CPUs)."""
    if tflops is not None:
        return tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak * 1e12 for key, peak in GPU_BF16_PEAK_TFLOPS if key in name), None)


# A container's memory limit, under cgroup v2 and v1.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes(device: torch.device) -> int | None:
    """The memory a device computes in: a GPU's own, else this machine's, or its cgroup's limit
    when lower. None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    for limit in CGROUP_LIMITS:
        try:
            total = min(total, int(Path(limit).read_text()))
        except (OSError, ValueError):  # Absent, or "max".
            pass
    return total


def gib(n: int) -> str:
    """A size in bytes as GiB, or MiB below one GiB."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def runnable_elsewhere() -> int | None:
    """Threads runnable on this machine now, besides this process's: /proc/stat's procs_running
    less this process's own running threads. None where there is no /proc."""
    try:
        stat = Path("/proc/stat").read_text()
        own = 0
        for task in Path("/proc/self/task").iterdir():
            # The state follows the name, which is in parentheses and may hold spaces.
            own += (task / "stat").read_text().rpartition(")")[2].split()[0] == "R"
    except (OSError, IndexError):  # No /proc, or a thread that ended while read.
        return None
    line = next((line for line in stat.splitlines() if line.startswith("procs_running")), None)
    return None if line is None else max(0, int(line.split()[1]) - own)


def free_cores(most: int, samples: int = 5) -> int:
    """The threads to compute on: the cores this process may use, less those that other work
    keeps busy (the median of `samples` looks 10 ms apart), at least one and at most `most`."""
    seen = []
    for n in range(samples):
        time.sleep(0.01 if n else 0)  # Between looks only: a server's engine thread waits here.
        if (others := runnable_elsewhere()) is None:
            return most
        seen.append(others)
    return max(1, min(most, len(os.sched_getaffinity(0)) - round(statistics.median(seen))))


class CoreShare:
    """torch's CPU threads, kept to the cores that other work leaves free.

    With two threads on a 2-core machine that other work kept busy, a training step ran ~40x
    slower for ~2.2x less CPU: every parallel region waits for a descheduled thread, and libgomp
    spins while it waits. One thread on the core left falls in proportion to the CPU it gets.
    check() looks again every `every_s` seconds of its caller's loop and says when the count
    changes. A thread count the user set (OMP_NUM_THREADS, or a flag: `fixed`) is kept as it is."""

    def __init__(self, device: torch.device, every_s: float = 10.0, fixed: bool = False):
        self.most = torch.get_num_threads()
        fixed = fixed or "OMP_NUM_THREADS" in os.environ
        self.adapts = device.type == "cpu" and self.most > 1 and not fixed
        self.every_s = every_s
        self.due = 0.0

    def threads(self, samples: int = 5) -> int | None:
        """The free cores now, or None where the count is the user's or not the CPU's."""
        return free_cores(self.most, samples) if self.adapts else None

    def check(self) -> str | None:
        """Set the thread count to the free cores when a look is due. A line when it changed."""
        if not self.adapts or time.monotonic() < self.due:
            return None
        self.due = time.monotonic() + self.every_s
        threads, before = self.threads(), torch.get_num_threads()
        if threads == before:
            return None
        torch.set_num_threads(threads)
        why = (
            "other work keeps the rest busy" if threads < self.most else "the cores are free again"
        )
        return f"CPU threads: {threads} of {self.most}, {why} (was {before})"
