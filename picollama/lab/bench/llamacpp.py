"""llama.cpp beside our model, for the benchmarks.

llama_server_flags is how the serving benchmark starts llama.cpp's own llama-server, its anchor.
LlamaCpp exports our model to GGUF and decodes greedily at batch 1 (the decode benchmark).
Run as `python -m picollama.lab.bench.llamacpp ARGS`, it is `python -m llama_cpp.server ARGS`
without extra CPU buffer types on AMX CPUs. llama.cpp's AMX kernel crashes there on SmolLM2's
Q4_1 file at the first request, and on q8_0 weights (llama-cpp-python 0.3.36)."""

import logging
import runpy
from pathlib import Path

import numpy as np
import torch

from picollama.convert.to_gguf import write_gguf

LLAMA_CPP_TYPES = ("f32", "bf16", "q8_0")
# Where ../shared/tools/llama_cpp_tools.sh builds llama.cpp's tools from a 2026 tree.
LLAMA_SERVER = Path.home() / ".cache/llama.cpp-tools/bin/llama-server"
LLAMA_SERVER_SLOTS = 4  # its -np: requests decoded together by continuous batching
LLAMA_SERVER_CONTEXT = 8192  # its -c, shared by the slots
# llama_cpp.server's options, and why. Its threads follow --threads, by default every core.
LLAMA_CPP_OPTIONS = {
    "--interrupt_requests": (
        "False",
        "its default (True) ends the running stream when another request comes: with "
        "concurrent clients most answers would be cut short; False queues them, one at a time",
    ),
    "--logits_all": (
        "False",
        "its default (True) computes the logits of every prompt token; only the last one's are "
        "needed here (no logprobs), so False spares it work",
    ),
    "--verbose": ("False", "its timings printed for every request, not needed"),
}
# Sent to llama-cpp-python only. Its default repeat_penalty of 1.1 changes greedy decoding.
# Ours has no repeat penalty, and refuses fields it does not implement.
LLAMA_CPP_BODY = {"repeat_penalty": 1.0}


class LlamaCpp:
    """A llama.cpp model and context (llama-cpp-python's C API) for greedy decoding at batch 1, with
    its defaults (f16 KV cache, flash attention where it chooses) except the extra CPU buffer types:
    their AMX kernel crashes on q8_0 weights on AMX CPUs (ggml_backend_amx_mul_mat, llama-cpp-python
    0.3.36)."""

    def __init__(self, path: Path, context: int, threads: int):
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # Where its C logs go.
        self.api = llama_cpp
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = context_params.n_batch = context
        context_params.n_threads = context_params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, context_params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        api = self.api
        out = []
        api.llama_memory_clear(api.llama_get_memory(self.context), True)
        tokens = prompt
        for _ in range(max_new_tokens):
            ids = (api.llama_token * len(tokens))(*tokens)  # Kept alive while llama_decode reads.
            if api.llama_decode(self.context, api.llama_batch_get_one(ids, len(tokens))):
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(
                api.llama_get_logits_ith(self.context, -1), shape=(self.vocab,)
            )
            tokens = [int(logits.argmax())]
            out.append(tokens[0])
        return out

    def close(self):
        self.api.llama_free(self.context)
        self.api.llama_model_free(self.model)


def gguf_type(path: Path) -> str:
    """A GGUF file's weight type as llama.cpp names it (q4_1, q8_0, ...), from its metadata."""
    import gguf

    field = gguf.GGUFReader(path).fields["general.file_type"]
    return (
        gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_").lower()
    )


def llama_cpp_decoders(model, tokenizer, context: int, folder: Path) -> tuple[dict, str | None]:
    """({name: LlamaCpp} of our model exported as f32, bf16 and q8_0 GGUF files, or {}; why not)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}, "llama-cpp-python is not installed (pip install -e '.[llama]')"
    if tokenizer is None:
        return {}, "no tokenizer (--tokenizer, or a --run) for the GGUF vocabulary"
    if tokenizer.get_piece_size() > model.args.vocab_size:
        vocab = model.args.vocab_size
        return {}, f"the tokenizer has more pieces than the model's {vocab} embeddings"
    decoders = {}
    for kind in LLAMA_CPP_TYPES:
        write_gguf(model, tokenizer, folder / f"{kind}.gguf", kind, "bench")
        decoders[f"llama_cpp_{kind}"] = LlamaCpp(
            folder / f"{kind}.gguf", context, torch.get_num_threads()
        )
    return decoders, None


def llama_server_flags(cli) -> list:
    """llama-server's flags: its defaults but the slots, the context and the threads, and no
    weight repacking on AMX CPUs, where its repacked kernels die with SIGILL at the first prompt."""
    flags = ["-m", cli.gguf, "-np", LLAMA_SERVER_SLOTS, "-c", LLAMA_SERVER_CONTEXT]
    flags += ["-t", cli.threads, "-tb", cli.threads, "--host", "127.0.0.1"]
    return flags + ["--no-repack"] * has_amx()


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
