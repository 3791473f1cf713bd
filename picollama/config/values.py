"""The allowed range of each config key. A value is checked for type and range as it is read."""

import math

from picollama.cli import UserError
from picollama.cli.flags import SEEDS, check_type

# Each key is checked as it is read, so the error can name it. Every float must also be finite.
# ModelArgs checks how its fields fit together.
POSITIVE = {
    "model.multiple_of",
    "model.ffn_dim_multiplier",
    "model.ffn_hidden_dim",
    "model.norm_eps",
    "model.rope_theta",
    "model.rope_original_max_seq_len",
    "model.rope_low_freq_factor",
    "model.rope_high_freq_factor",
    "model.rope_far_keys",
    "data.vocab_size",
    "data.copy_span",
    "data.copy_repeats",
    "data.retrieval_keys",
    "data.retrieval_values",
    "data.retrieval_pairs",
    "train.max_steps",
    "train.max_minutes",
    "train.epochs",
    "train.batch_size",
    "train.grad_accum",
    "train.seq_len",
    "train.log_interval",
    "train.peak_tflops",
    "optim.lr",
    "optim.eps",
    "optim.muon_lr",
    "optim.decay_fraction",
    "eval.batches",
    "eval.batch_size",
    "checkpoint.keep",
}
NOT_NEGATIVE = {
    "model.rope_window",
    "train.seed",
    "train.sample_tokens",
    "train.random_positions",
    "train.early_stop",
    "optim.min_lr",
    "optim.warmup_steps",
    "optim.decay_start",
    "optim.weight_decay",
    "optim.final_weight_decay",
    "optim.grad_clip",
    "optim.z_loss",
    "eval.interval",
    "eval.interim_batches",
    "checkpoint.interval",
}
BELOW_ONE = {
    "data.copy_fraction",
    "data.retrieval_filler",
    "optim.beta1",
    "optim.beta2",
    "optim.muon_momentum",
    "optim.decay_fraction",
    "train.dropout",
    "train.weight_average",
}  # And not negative.
# An empty path would mean the current directory. Training would write into it.
PATH_KEYS = {"data.dir", "data.source", "train.out_dir", "train.init_from"}
TEXT_KEYS = {"train.sample_prompt"}  # Text for the tokenizer must be UTF-8. Paths may be any bytes.
CHOICES = {
    "data.task": ("text", "retrieval"),
    "data.sampling": ("random", "epochs"),
    "data.tokenizer_type": ("bpe", "unigram"),  # Also data/prepare.py --tokenizer-type.
    "train.device": ("auto", "cpu", "cuda", "mps"),
    "train.dtype": ("auto", "float32", "bfloat16"),
    "optim.name": ("adamw", "muon"),
    "optim.schedule": ("cosine", "wsd"),
}


def range_problem(key: str, value) -> str | None:
    """What a value of the right type fails to be, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "finite"
    if key in PATH_KEYS and not value.strip():
        return "a path (empty is not one)"
    if key in POSITIVE and value <= 0:
        return "positive"
    if key in NOT_NEGATIVE and value < 0:
        return "zero or more"
    if key == "train.seed" and value >= SEEDS:  # Else numpy refuses it, less clearly.
        return f"below {SEEDS:,} (torch keeps a seed's low 32 bits)"
    if key in BELOW_ONE and not 0 <= value < 1:
        return "at least 0 and below 1"
    if key in CHOICES and value not in CHOICES[key]:
        return "one of " + ", ".join(CHOICES[key])
    return None


def check_value(key: str, name: str, value, annotation):
    """Convert value to the field's type (int to float is allowed) and check its range.

    A UserError names the key as `name`: "config key K" in a file, "--K" on the command line."""
    value = check_type(name, value, annotation)
    if value is None:
        return None
    problem = range_problem(key, value)
    if problem:
        raise UserError(f"{name} must be {problem}, not {value!r}")
    return value
