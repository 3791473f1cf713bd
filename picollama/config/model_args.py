"""ModelArgs from settings or a saved run's dict, refused where a key is out of range or misfit."""

import math
import typing
from dataclasses import fields

from model import ACTIVATIONS, NORMS, POSITIONS, ModelArgs
from picollama.cli import UserError
from picollama.cli.flags import check_type
from picollama.components.length import uses_rope
from picollama.components.registry import PLACEMENTS, ROPE_SCALINGS
from picollama.components.variants import switches
from picollama.config.values import range_problem

# The model keys every picollama version has written to config.json and meta.json: one that is
# missing was edited away, and its default would describe another model. Keys added since may be
# absent: their defaults are what older versions computed.
WRITTEN_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "multiple_of",
    "ffn_dim_multiplier",
    "ffn_hidden_dim",
    "norm_eps",
    "rope_theta",
    "max_seq_len",
    "tie_embeddings",
    "rope_scaling",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
)
# What config.json may change in the model its weights were saved with: the context and its RoPE
# scaling (as train.init_from may, and generate.py's --rope-scaling does).
CONTEXT_KEYS = (
    "max_seq_len",
    "rope_scaling",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_window",
    "rope_far_keys",
)
# Far past any published model (the largest: dim 16384, 126 layers, 256k vocabulary, 10M context):
# a size beyond its limit is a corrupt or mistyped config, refused naming the key before anything
# is allocated.
SIZE_LIMITS = dict(
    dim=1 << 16, n_layers=1 << 10, n_heads=1 << 10, n_kv_heads=1 << 10, vocab_size=1 << 22
)
SIZE_LIMITS |= dict(max_seq_len=1 << 24, ffn_hidden_dim=1 << 20)


def model_choices() -> dict[str, tuple]:
    """The values each ModelArgs key with a fixed set of them may take. The named ones are the
    keys of model.py's tables, read when called, so a new entry is a choice at once."""
    choices = {"norm": tuple(NORMS), "norm_placement": PLACEMENTS}
    choices |= {"activation": tuple(ACTIVATIONS), "position": tuple(POSITIONS)}
    on_off = [key for key in switches() if isinstance(getattr(ModelArgs, key), bool)]
    choices |= dict.fromkeys(on_off, (False, True))
    choices["rope_scaling"] = ROPE_SCALINGS
    return choices


def checked_model_args(**values) -> ModelArgs:
    """ModelArgs(**values), refused (ValueError naming the key) where a size is past any
    published model's or the architecture's switches do not fit together."""
    args = ModelArgs(**values)
    for key, limit in SIZE_LIMITS.items():
        if (value := getattr(args, key)) is not None and not 1 <= value <= limit:
            problem = f"at most {limit:,}" if value > 0 else "positive"
            raise ValueError(f"{key} must be {problem}, not {value!r}")
    if args.dim % args.n_heads:
        raise ValueError(f"dim ({args.dim}) must be divisible by n_heads ({args.n_heads})")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(
            f"n_heads ({args.n_heads}) must be divisible by n_kv_heads ({args.n_kv_heads})"
        )
    for key, allowed in model_choices().items():
        if (value := getattr(args, key)) not in allowed:
            allowed = ", ".join(map(str, allowed))
            raise ValueError(f"{key} must be one of {allowed}, not {value!r}")
    for key, ok, allowed in [
        ("rope_factor", args.rope_factor >= 1, ">= 1"),
        ("rope_fraction", 0 < args.rope_fraction <= 1, "in (0, 1]"),
        ("nope_every", args.nope_every >= 0, ">= 0"),
        ("logit_softcap", 0 <= args.logit_softcap < math.inf, "a finite number >= 0"),
    ]:
        if not ok:
            raise ValueError(f"{key} must be {allowed}, not {getattr(args, key)!r}")
    check_rope_keys(args)
    for f in fields(ModelArgs):  # the ranges the training config checks, e.g. rope_theta > 0
        value = getattr(args, f.name)
        if value is not None and (problem := range_problem(f"model.{f.name}", value)):
            raise ValueError(f"{f.name} must be {problem}, not {value!r}")
    return args


def check_rope_keys(args: ModelArgs):
    """ValueError for RoPE's keys on a model without RoPE, and for a RoPE model whose heads (or
    their rotated part) have an odd size: RoPE turns pairs of dimensions."""
    for key, off in (("rope_scaling", "none"), ("rope_fraction", 1.0), ("nope_every", 0)):
        if not uses_rope(args) and getattr(args, key) != off:
            raise ValueError(
                f"{key} applies to position = 'rope' only (or 'prope'), not to position = "
                f"{args.position!r}"
            )
    pairs = args.head_dim * args.rope_fraction / 2
    odd = args.head_dim % 2 or pairs < 1 or abs(pairs - round(pairs)) > 1e-6
    if uses_rope(args) and odd:
        raise ValueError(
            f"head_dim ({args.head_dim}) and head_dim·rope_fraction ({2 * pairs:g}) must be even"
        )


def saved_model_args(saved) -> ModelArgs:
    """ModelArgs from config.json's or meta.json's "model": model_args_from_dict, and a UserError
    naming a WRITTEN_KEYS key that is missing."""
    missing = [key for key in WRITTEN_KEYS if key not in saved] if isinstance(saved, dict) else []
    if missing:
        raise UserError(f"model.{missing[0]} is missing")
    return model_args_from_dict(saved)


def model_args_from_dict(d: dict) -> ModelArgs:
    """ModelArgs from a dict read from a file: each value checked for its field's type (UserError
    naming model.KEY), unknown keys refused."""
    if not isinstance(d, dict):
        raise UserError(f"model must be a table of settings, not {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(ModelArgs)}
    if unknown:
        raise ValueError(f"unknown model argument(s): {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(ModelArgs)
    values = {key: check_type(f"model.{key}", value, hints[key]) for key, value in d.items()}
    try:
        return checked_model_args(**values)
    except ValueError as e:  # a size or combination no model has: name it like a type error
        raise UserError(f"model.{e}") from None
