"""Load a run to sample from. generate.py and the server both load it here.

The model is quantized and cast as the flags say. It gets its fastest one-token step on this
machine."""

import sys

import torch

from model import Transformer
from picollama.components.length import length_dependent
from picollama.components.variants import non_llama
from picollama.device import pick_dtype
from picollama.kernels.fused_step import DecodeStep
from picollama.kernels.quantize import quantize
from picollama.kernels.timing import compiled_unless_slower, tune_threads
from picollama.run_files import load_run


def load_to_sample(args, device: torch.device) -> tuple[Transformer, object, torch.dtype]:
    """The run's model, quantized and cast as the flags say, its tokenizer and activation dtype."""
    from picollama.convert.main import imported_run  # Imports a .gguf file or Hugging Face folder.

    dtype = pick_dtype(args.dtype, device)
    model, _, tokenizer = load_run(imported_run(args.run), device, torch.float32)
    return quantize(model, args.quantize).to(dtype), tokenizer, dtype


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
