"""A run loaded to sample from, as generate.py and the server both load it: the model quantized
and cast as the flags say, and its fastest one-token step on this machine."""

import sys

import torch

from model import Transformer
from picollama.components.length import length_dependent
from picollama.components.variants import non_llama
from picollama.device import pick_dtype
from picollama.run_files import load_run
from picollama.sampling.fused_step import DecodeStep
from picollama.sampling.quantize import quantize
from picollama.sampling.timing import compiled_unless_slower, tune_threads


def load_to_sample(args, device: torch.device) -> tuple[Transformer, object, torch.dtype]:
    """The run's model (quantized and cast as the flags say), its tokenizer and activation dtype."""
    from picollama.convert.main import imported_run  # a .gguf file or a Hugging Face directory

    dtype = pick_dtype(args.dtype, device)
    model, _, tokenizer = load_run(imported_run(args.run), device, torch.float32)
    return quantize(model, args.quantize).to(dtype), tokenizer, dtype


def fast_step(
    model: Transformer, compile: bool, batch: int, kv_dtype=None, threads: int | None = None
) -> DecodeStep | None:
    """The fused one-token step for `batch` rows on its fastest thread count (timed; or on
    `threads`, untimed), compiled unless that measures slower, on a KV cache of kv_dtype (None: the
    activations'), or None where the model itself decodes: dynamic NTK re-runs the prefix as it
    grows, and the fused step is LLaMA's."""
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
