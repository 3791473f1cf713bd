"""Load a run to sample from. generate.py and the server both load it here.

The model is quantized and cast as the flags say. Without --quantize, a GGUF file decodes in its
own weight format. It gets its fastest one-token step on this machine."""

import sys

import torch

from model import Transformer
from picollama.components.length import length_dependent
from picollama.components.variants import non_llama
from picollama.device import pick_dtype
from picollama.kernels.block_cache import quantize_kept
from picollama.kernels.block_linear import FORMATS, block_ops
from picollama.kernels.float_linear import PRECISIONS
from picollama.kernels.fused_step import DecodeStep
from picollama.kernels.timing import compiled_unless_slower, tune_threads
from picollama.run_files import load_run

# The quantize() mode that keeps a GGUF weight type's own format. Float types keep their precision:
# F16 widens to f32, exactly. Other quantized types (K-quants, Q5, IQ) are rounded again to q8_0:
# finer than the file, and fast.
OWN_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "F32": "f32", "F16": "f32"}
OWN_FORMATS["BF16"] = "bf16"
# llama.cpp's general.file_type, for imports from before from_gguf.py recorded weight types.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 32: "BF16"}


def load_to_sample(args, device: torch.device) -> tuple[Transformer, object, torch.dtype]:
    """The run's model, quantized and cast as the flags say, its tokenizer and activation dtype.

    --quantize auto (the default) becomes own_format's mode, and args.quantize says which. With
    --dtype auto, block formats decode in float32."""
    from picollama.convert.main import imported_run  # Imports a .gguf file or Hugging Face folder.

    dtype = pick_dtype(args.dtype, device)
    run = imported_run(args.run)
    model, config, tokenizer = load_run(run, device, torch.float32)
    if args.quantize == "auto":
        args.quantize, output, f32 = own_format(config, device)
    else:  # Block formats take float32 activations (own_format says why).
        output, f32 = None, args.quantize in (*FORMATS, *PRECISIONS)
    if f32 and args.dtype in (None, "auto"):
        dtype = torch.float32
    return quantize_kept(model, args.quantize, output, run).to(dtype), tokenizer, dtype


def own_format(config: dict, device: torch.device) -> tuple[str, str | None, bool]:
    """(mode, output layer's mode, whether float32) that decode a run in its own weight format.

    A run imported from GGUF decodes in the file's types (from_gguf.weight_types) on the CPU.
    Block formats take float32 activations, which the kernel rounds to int8 anyway. Eager norms
    and attention ran faster in float32 than in bf16: SmolLM2-135M Q4_1 took 7.8 against 9.6 ms
    a step on one Zen 5 core. Float files (F32, F16, BF16) take float32 activations too, with
    float_linear.py's products on weights in the file's precision. Without block_ops.cpp (no C++
    compiler) or on a GPU an F32 file decodes in float32, and F16 or BF16 in the default dtype.
    Anything else gives ("none", None, False): a run trained here, a GPU, or no compiler."""
    source = config.get("converted_from") or {}
    layers = source.get("weight_type")
    if "gguf" in source and layers is None:  # An import from before the types were recorded.
        file_type = (source.get("metadata") or {}).get("general.file_type")
        layers = FILE_TYPES.get(file_type, None if file_type is None else "Q?")
    if layers is None:
        return "none", None, False
    if device.type != "cpu" or block_ops() is None:
        return "none", None, layers == "F32"
    return mode_of(layers), mode_of(source.get("output_type")), True


def mode_of(kind: str | None) -> str | None:
    """The quantize() mode for a GGUF type: its own format (OWN_FORMATS), else q8_0."""
    if kind is None:
        return None
    return OWN_FORMATS.get(kind, "q8_0")


def fast_step(
    model: Transformer, compile: bool, batch: int, kv_dtype=None, threads: int | None = None
) -> DecodeStep | None:
    """The fused one-token step for `batch` rows, or None where the model decodes itself.

    The thread count is timed, unless `threads` gives it. The step is compiled unless that times
    slower. Its KV cache holds kv_dtype, or the activations' dtype for None. Dynamic NTK re-runs
    the prefix as it grows, and the fused step is LLaMA's only. Such models get None."""
    if non_llama(model.args) or length_dependent(model.args):
        return None
    step = DecodeStep(model, threads, kv_dtype=kv_dtype)
    notes = [tune_threads(model, step, batch) if threads is None else None]
    if compile:
        step, note = compiled_unless_slower(model, step, batch)
        notes.append(note)
    for note in filter(None, notes):
        print(note, file=sys.stderr)
    return step
