"""RoPE's scalings past the training context as functions of the frequencies (Hugging Face's
ROPE_INIT_FUNCTIONS): linear, NTK-aware, dynamic NTK, YaRN, Llama 3. registry.py puts each in
model.py's ROPE_INIT.

How to add a RoPE scaling method. It touches two files:
- here: its function fn(args, d, seq_len) -> (inverse frequencies, attention scale). At
  rope_factor 1 it must give plain RoPE (tests/test_extrapolate.py checks every method). Set
  fn.length_dependent = True where the frequencies follow the current length, as dynamic's do.
- picollama/components/registry.py: its line, ROPE_INIT["name"] = rope_scaling.fn, among the
  others of this file. Messages list the methods in that order.
Everything else reads ROPE_INIT: the rope_scaling config check, generate.py's --rope-scaling,
the lab's --methods, stretched() and the messages that list the methods.
Optional: its export in picollama/convert/hf.py and convert/to_gguf.py (else refused by name),
and docs/usage.md.
More files only for more than frequencies. A method with a new ModelArgs key also touches
model.py, config/model_args.py (CONTEXT_KEYS) and config/values.py (its range). One that attends
in branches, like rerope, has its attention in windowed_rope.py (or a leaf of its own, as dca.py
and reattention.py, merging branches through attention_branches.py), a ROPE_ATTENTIONS line in
registry.py, and its factor in length.py (window_factor), or fn.stretch_only = True on its
attention function where rope_factor only turns it on."""

import math
from dataclasses import replace

import torch

from model import ModelArgs, plain_rope


def linear(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by the factor s."""
    return plain_rope(args, d, seq_len)[0] / args.rope_factor, 1.0


def ntk(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Static NTK-aware scaling: plain RoPE on the base·s^(d/(d-2))."""
    base = args.rope_theta * args.rope_factor ** (d / (d - 2))
    return plain_rope(replace(args, rope_theta=base), d, seq_len)


def dynamic(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: NTK-aware scaling with s taken from the current length, so every cached key goes
    stale as it grows (generate.py recomputes)."""
    s, original_len = args.rope_factor, args.original_seq_len
    seq_len = max(seq_len, original_len)
    base = args.rope_theta * (s * seq_len / original_len - (s - 1)) ** (d / (d - 2))
    return plain_rope(replace(args, rope_theta=base), d, seq_len)


dynamic.length_dependent = True  # its frequencies follow the length: no fixed table


def yarn(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow=1 times over the original context are
    interpolated, more than beta_fast=32 times kept, a linear ramp between; attention scaled by
    0.1·ln s + 1."""
    base, s, original_len = args.rope_theta, args.rope_factor, args.original_seq_len
    inv_freq = plain_rope(args, d, seq_len)[0]

    def dim_of(rotations):
        return d * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), d - 1)
    ramp = (torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
    ramp = ramp.clamp(0, 1)
    attention_scale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    return inv_freq / s * ramp + inv_freq * (1 - ramp), attention_scale


def llama3(args: ModelArgs, d: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1's: wavelengths past original/low_freq_factor interpolated by s, those below
    original/high_freq_factor kept, a smooth blend between."""
    inv_freq, s, original_len = (
        plain_rope(args, d, seq_len)[0],
        args.rope_factor,
        args.original_seq_len,
    )
    wavelen = 2 * math.pi / inv_freq
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    smooth = (original_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / s + smooth * inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / s, scaled)
    return torch.where(wavelen < original_len / high, inv_freq, scaled), 1.0
