"""Where and in what precision to run: the device, the dtype, native bf16 on CPUs, peak FLOP/s for MFU, and how
glibc should treat the memory a training step frees."""

import ctypes
import ctypes.util
import sys
from pathlib import Path

import torch

from picollama.cli import UserError

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name substring; the first match wins.
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


def mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def pick_device(name: str | None = None) -> torch.device:
    """The named device (cpu, cuda, cuda:1, mps), or what the machine has: cuda, else Apple's mps, else cpu;
    UserError if unusable."""
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
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise UserError(
            f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "mps" and not mps_available():
        raise UserError(
            f"device {name!r}: MPS (Apple's GPU) is not available on this machine; use cpu"
        )
    return device


def check_compiler():
    """UserError unless torch.compile can build kernels here: Inductor needs a C++ compiler (g++, or $CXX)."""
    from torch._inductor import cpp_builder  # imported only when compiling: it takes a while

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # Inductor's InvalidCxxCompiler, or whatever its search runs into
        raise UserError(
            "--compile needs a working C++ compiler for torch.compile (Inductor), and none was found (tried $CXX, "
            "g++); install one or run without compiling"
        ) from None


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX-512 BF16 or AMX), where bf16 matmuls beat fp32."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def keep_freed_memory():
    """Make glibc keep the memory the training step frees for the next step (Linux; elsewhere nothing). By default it
    returns large freed blocks to the OS and the next step faults them back in: ~110k page faults a step of the
    default model on 2 cores, a quarter of its time (measured: 9.6k → 12.9k tokens/s with this). The cost: the
    process holds on to its peak memory."""
    if not sys.platform.startswith("linux") or (name := ctypes.util.find_library("c")) is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(
        libc, "mallopt"
    ):  # glibc's M_TRIM_THRESHOLD (-1) and M_MMAP_THRESHOLD (-3), to 1 GiB
        libc.mallopt(-1, 1 << 30)
        libc.mallopt(-3, 1 << 30)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The named dtype; "auto" (or None) is bfloat16 where the device computes it natively (a GPU that supports it,
    or a CPU with cpu_has_bf16()) and float32 elsewhere."""
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
    """Peak FLOP/s for MFU: `tflops` when given, else the GPU table; None when unknown (CPUs)."""
    if tflops is not None:
        return tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak * 1e12 for key, peak in GPU_BF16_PEAK_TFLOPS if key in name), None)
