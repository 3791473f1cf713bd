"""`python -m llama_cpp.server ARGS` as it is, but on an AMX CPU without llama.cpp's extra CPU
buffer types: their AMX kernel crashes on SmolLM2's Q4_1 file there (a segmentation fault at the
first request, llama-cpp-python 0.3.36), as llama_cpp_runner.py found for q8_0 weights."""

import runpy
from pathlib import Path


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (Linux: /proc/cpuinfo's flags)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def without_extra_buffer_types():
    """Make every model llama_cpp.Llama loads use plain CPU buffers (no AMX or repacked ones)."""
    from llama_cpp import llama_cpp

    defaults = llama_cpp.llama_model_default_params

    def params():
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen

    llama_cpp.llama_model_default_params = params


if __name__ == "__main__":
    if has_amx():
        without_extra_buffer_types()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
