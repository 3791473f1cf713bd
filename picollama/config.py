"""Training configuration: a TOML config's sections, `--section.key=value` overrides, and their
validation (ModelArgs' included)."""

import difflib
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from model import ACTIVATIONS, NORMS, PLACEMENTS, POSITIONS, ROPE_SCALINGS, ModelArgs
from picollama import REPO_ROOT
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_compile,
    add_device,
    add_out,
    add_seed,
    check_type,
    utf8_argument,
)

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"


@dataclass
class DataConfig:
    dir: str = "data/shakespeare"  # a prepared dataset (data/prepare.py), else made from `source`
    source: str = "shakespeare"  # shakespeare | PATH | hf:NAME, as for data/prepare.py --source
    vocab_size: int | None = None  # tokenizer size when preparing; None: model.vocab_size
    # synthetic copy data (data/loader.py's RandomBatches, Bi-Induct-style): this fraction of
    # training windows get a random span and copies of it later in the window, for induction heads
    # to form on; 0: none
    copy_fraction: float = 0.0
    copy_span: int = 8  # tokens in the span
    copy_repeats: int = 4  # copies of it in the window
    # text: the dataset in `dir`; retrieval: the synthetic key-value recall task of
    # data/retrieval.py, generated from train.seed (no dataset, no tokenizer), validated by its
    # accuracy on fixed rows
    task: str = "text"
    retrieval_keys: int = 64  # the keys' alphabet (token ids 1..keys)
    # the values' alphabet (the next ids); model.vocab_size must hold 1 + keys + values
    retrieval_values: int = 64
    retrieval_pairs: int = 8  # key-value pairs per row, each key queried from later in the row
    # the fraction of training slots after the key block left as filler, not queries
    retrieval_filler: float = 0.0

    def copy_options(self) -> dict:
        """The copy-data keyword arguments of RandomBatches."""
        return {
            "copy_fraction": self.copy_fraction,
            "copy_span": self.copy_span,
            "copy_repeats": self.copy_repeats,
        }


@dataclass
class TrainConfig:
    out_dir: str = "out/default"  # the run directory
    max_steps: int = 1000  # the run's length, unless max_minutes sizes it
    # a wall-clock budget (data preparation, evaluations, checkpoints and the final sample
    # included) that fixes max_steps from the time spent: with optim.schedule wsd where the decay
    # starts, from recent step times; with cosine after the first warmup steps. None: max_steps
    max_minutes: float | None = None
    batch_size: int = 16  # sequences per optimizer step, over all ranks and micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step
    seq_len: int = 256
    seed: int = 1337
    device: str = "auto"  # auto (cuda, else mps, else cpu) | cpu | cuda | mps
    # float32 | bfloat16 | auto: bfloat16 where the device computes it natively (FSDP2 policy)
    dtype: str = "auto"
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False
    log_interval: int = 10
    peak_tflops: float | None = None  # per device, for MFU; None: the GPU table (nothing on CPU)
    sample_tokens: int = 200  # a sample printed at the end (0: none)
    sample_prompt: str = ""
    init_from: str | None = None  # a run directory whose weights start this run (not its optimizer)
    # k > 0: each sequence at sorted random positions from [0, k·seq_len); 0: off
    random_positions: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4  # the schedule decays to this at max_steps
    warmup_steps: int = 100
    # after the linear warmup, cosine: a cosine decay to min_lr at max_steps; wsd (warmup-stable-
    # decay): lr held, then a 1-sqrt decay to min_lr from decay_start to max_steps
    schedule: str = "cosine"
    # wsd: the decay's share of max_steps, or of a train.max_minutes budget's time (which decides
    # max_steps and decay_start when that much time is left)
    decay_fraction: float = 0.2
    decay_start: int | None = None  # wsd: the step the decay begins; None: decay_fraction's
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0: no clipping
    name: str = "adamw"  # adamw | muon (Muon for the blocks' matrices, AdamW for the rest)
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule scales it as it scales lr
    muon_momentum: float = 0.95
    z_loss: float = 0.0  # adds z_loss·mean(logsumexp(logits)²) to the loss (PaLM); 0: off


@dataclass
class EvalConfig:
    interval: int = 250  # steps between validation runs (and at the end); 0: only at the end
    batches: int = 20
    batch_size: int = 16


@dataclass
class CheckpointConfig:
    interval: int = 500  # steps between checkpoints (and at the end); 0: only at the end
    keep: int = 2  # train_state/step_* directories kept


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "picollama"
    run_name: str | None = None  # None: the run directory's name


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        return {f.name: asdict(getattr(self, f.name)) for f in fields(self)}


# The range of each key that has one, checked as the key is read so that the error names it. Every
# float must also be finite; ModelArgs checks how its fields fit together.
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
    "optim.min_lr",
    "optim.warmup_steps",
    "optim.decay_start",
    "optim.weight_decay",
    "optim.grad_clip",
    "optim.z_loss",
    "eval.interval",
    "checkpoint.interval",
}
BELOW_ONE = {
    "data.copy_fraction",
    "data.retrieval_filler",
    "optim.beta1",
    "optim.beta2",
    "optim.muon_momentum",
    "optim.decay_fraction",
}  # and not negative
TEXT_KEYS = {"train.sample_prompt"}  # text for the tokenizer: UTF-8 only (paths may be any bytes)
CHOICES = {
    "data.task": ("text", "retrieval"),
    "train.device": ("auto", "cpu", "cuda", "mps"),
    "train.dtype": ("auto", "float32", "bfloat16"),
    "optim.name": ("adamw", "muon"),
    "optim.schedule": ("cosine", "wsd"),
}


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
    choices = {"norm": NORMS, "norm_placement": PLACEMENTS, "activation": ACTIVATIONS}
    choices["position"] = POSITIONS
    switches = ("parallel_block", "qk_norm", "logn_attention", "ssmax")
    choices |= dict.fromkeys(switches, (False, True))
    choices["rope_scaling"] = ROPE_SCALINGS
    for key, allowed in choices.items():
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
        if not args.uses_rope and getattr(args, key) != off:
            raise ValueError(
                f"{key} applies to position = 'rope' only (or 'prope'), not to position = "
                f"{args.position!r}"
            )
    pairs = args.head_dim * args.rope_fraction / 2
    odd = args.head_dim % 2 or pairs < 1 or abs(pairs - round(pairs)) > 1e-6
    if args.uses_rope and odd:
        raise ValueError(
            f"head_dim ({args.head_dim}) and head_dim·rope_fraction ({2 * pairs:g}) must be even"
        )


def position_limit(args: ModelArgs) -> int | None:
    """The longest sequence a model computes at all: a learned table's; else None."""
    return args.max_seq_len if args.position == "learned" else None


def needs_scaling(args: ModelArgs, length: int) -> bool:
    """Whether `length` tokens run a RoPE model past its context, unscaled."""
    return args.uses_rope and args.rope_scaling == "none" and length > args.max_seq_len


def length_problem(args: ModelArgs, length: int) -> str | None:
    """Why a model cannot run `length` tokens as it is; None when it can."""
    limit = position_limit(args)
    if limit is not None and length > limit:
        return f"{length} tokens exceed the model's learned position table of {limit} positions"
    if needs_scaling(args, length):
        return f"{length} tokens exceed the model's context of {args.max_seq_len} tokens"
    return None


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


def section_types() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}


def field_types(cls) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def unknown_key_error(key: str, valid: list[str]) -> UserError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(valid)})"
    return UserError(f"unknown config key {key}{hint}")


def type_options(annotation) -> tuple[type, bool]:
    """The field's type without None, and whether None is allowed."""
    options = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    return next(t for t in options if t is not type(None)), type(None) in options


def range_problem(key: str, value) -> str | None:
    """What a value of the right type fails to be, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "finite"
    if key in POSITIVE and value <= 0:
        return "positive"
    if key in NOT_NEGATIVE and value < 0:
        return "zero or more"
    if key in BELOW_ONE and not 0 <= value < 1:
        return "at least 0 and below 1"
    if key in CHOICES and value not in CHOICES[key]:
        return "one of " + ", ".join(CHOICES[key])
    return None


def check_value(key: str, name: str, value, annotation):
    """value converted to the field's type (int → float is allowed) and checked against its range;
    UserError naming the key (as `name`: "config key K" in a file, "--K" on the command line)
    otherwise."""
    value = check_type(name, value, annotation)
    if value is None:
        return None
    problem = range_problem(key, value)
    if problem:
        raise UserError(f"{name} must be {problem}, not {value!r}")
    return value


def parse_override(key: str, text: str, annotation):
    """A command-line string parsed per the field's type and checked like a TOML value."""
    base, optional = type_options(annotation)
    if key in TEXT_KEYS:
        utf8_argument(text, f"--{key}")
    if optional and text.lower() in ("none", "null"):
        return None
    try:
        if base is bool:
            value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[
                text.lower()
            ]
        else:
            value = base(text)
    except (KeyError, ValueError):
        wanted = base.__name__ + (" or none" if optional else "")
        raise UserError(f"--{key}: expected {wanted}, got {text!r}") from None
    return check_value(key, f"--{key}", value, annotation)


def build_config(raw: dict, overrides: list[tuple[str, str]]) -> Config:
    """A Config from TOML sections plus (section.key, string) overrides; UserError names any bad key
    or value."""
    sections = section_types()
    values = {name: {} for name in sections}
    for name, table in raw.items():
        if name not in sections:
            raise unknown_key_error(name, list(sections))
        if not isinstance(table, dict):
            raise UserError(f"config key {name} must be a [{name}] table")
        types_ = field_types(sections[name])
        for key, value in table.items():
            if key not in types_:
                raise unknown_key_error(f"{name}.{key}", [f"{name}.{k}" for k in types_])
            values[name][key] = check_value(
                f"{name}.{key}", f"config key {name}.{key}", value, types_[key]
            )
    all_keys = [f"{name}.{k}" for name, cls in sections.items() for k in field_types(cls)]
    given = {dotted for dotted, _ in overrides}
    for layer, keys in (
        ("the config file", {f"train.{k}" for k in values["train"]}),
        ("the command line", given),
    ):
        if {"train.max_steps", "train.max_minutes"} <= keys:
            raise UserError(f"{layer} sets both train.max_steps and train.max_minutes; keep one")
    if (
        "train.max_steps" in given
    ):  # the command line wins: a step count given there turns off the file's budget
        values["train"]["max_minutes"] = None
    for dotted, text in overrides:
        name, _, key = dotted.partition(".")
        if name not in sections or key not in field_types(sections[name]):
            raise unknown_key_error(dotted, all_keys)
        values[name][key] = parse_override(dotted, text, field_types(sections[name])[key])
    if (init_from := values["train"].get("init_from")) is not None:
        # the model keys given with train.init_from or after it: the file's where it names it too
        explicit = {dotted[6:] for dotted in given if dotted.startswith("model.")}
        if "init_from" in raw.get("train", {}):
            explicit |= set(raw.get("model", {}))
        values["model"] = init_from_model(init_from, values["model"], explicit)
    built = {}
    for name, cls in sections.items():
        try:
            built[name] = (checked_model_args if cls is ModelArgs else cls)(**values[name])
        except ValueError as e:
            raise UserError(f"[{name}] {e}") from None
    return Config(**built)


def init_from_model(run_dir: str, model: dict, given: set[str]) -> dict:
    """The model settings of a run started from train.init_from: run_dir's own (its config.json's),
    with the `given` keys of `model`, which may change CONTEXT_KEYS only (UserError naming another
    that differs); `model` as it is where run_dir has no config.json to read (a run not trained
    yet, or no run: train.py's load_model says so)."""
    path = Path(run_dir) / "config.json"
    try:
        saved = json.loads(path.read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return model
    try:
        source = saved_model_args(saved).to_dict()
    except ValueError as e:
        raise UserError(f"train.init_from: {path} is corrupt: {e}") from None
    check_init_model(run_dir, source, {key: model[key] for key in given})
    return source | {key: model[key] for key in given}


def check_init_model(run_dir, source: dict, model: dict):
    """UserError naming the first key of `model` (model settings) but CONTEXT_KEYS whose value
    differs from the model of the train.init_from run run_dir, `source`."""
    for key in (k for k in source if k in model and k not in CONTEXT_KEYS):
        if model[key] != source[key]:
            raise UserError(
                f"train.init_from {run_dir} has model.{key} = {source[key]!r}, this run "
                f"{model[key]!r}; only model.{', model.'.join(CONTEXT_KEYS)} may change (the "
                "rest is taken from its config.json: leave it out)"
            )


def split_overrides(rest: list[str]) -> list[tuple[str, str]]:
    """(section.key, text) pairs from `--section.key=value` or `--section.key value` arguments."""
    overrides = []
    i = 0
    while i < len(rest):
        match = re.fullmatch(r"--([A-Za-z_]\w*\.\w+)(?:=(.*))?", rest[i], re.S)
        if not match:
            raise UserError(
                f"unexpected argument {rest[i]!r}; overrides look like --section.key=value"
            )
        if match[2] is None:
            if i + 1 >= len(rest):
                raise UserError(f"--{match[1]} needs a value")
            overrides.append((match[1], rest[i + 1]))
            i += 2
        else:
            overrides.append((match[1], match[2]))
            i += 1
    return overrides


SHORTHANDS = {
    "out": "train.out_dir",
    "device": "train.device",
    "dtype": "train.dtype",
    "compile": "train.compile",
    "seed": "train.seed",
}


def parse_cli(argv: list[str], description: str | None = None) -> tuple[Config, bool]:
    """The Config of `[--config F.toml] [--out DIR --device D --dtype T --compile --seed N]
    [--section.key=value ...] [--resume]`, and whether to resume. The shorthands are the flags other
    commands share (cli.py): they set the train keys of SHORTHANDS."""
    parser = ArgumentParser(
        prog="python train.py",
        description=description,
        epilog="Any config key can be overridden as --section.key=value (sections: "
        + ", ".join(section_types())
        + "), e.g. --train.max_steps=200 --model.dim=128.",
    )
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a TOML config (default configs/default.toml)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the latest checkpoint in the run directory"
    )
    add_out(parser, "the run directory written (train.out_dir)")
    add_device(parser, default=None)  # None: the config's value stands
    add_compile(parser, "each block (train.compile)", default=None)
    add_seed(parser, "the run's seed (train.seed)", default=None, unset="the config's")
    args, rest = parser.parse_known_args(argv)
    overrides = split_overrides(rest)
    for flag, key in SHORTHANDS.items():
        value = getattr(args, flag)
        if value is not None:
            if key in dict(overrides):
                raise UserError(f"--{flag} and --{key} set the same key; give one")
            overrides.append((key, str(value)))
    try:
        raw = tomllib.loads(Path(args.config).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read config {args.config}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{args.config} is not valid TOML: {e}") from None
    return build_config(raw, overrides), args.resume


def check_config(cfg: Config, world_size: int) -> None:
    """Refuse, before any work, configs whose batch or context does not fit (single keys are checked
    as read)."""
    t = cfg.train
    m = cfg.model
    if t.batch_size % (t.grad_accum * world_size):
        raise UserError(
            f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum × ranks "
            f"({t.grad_accum} × {world_size}); change batch_size or grad_accum"
        )
    if t.seq_len > m.max_seq_len:
        raise UserError(
            f"train.seq_len ({t.seq_len}) exceeds the model's context model.max_seq_len "
            f"({m.max_seq_len}); lower train.seq_len or raise model.max_seq_len"
        )
    check_training_options(cfg)
    if cfg.data.task == "retrieval":
        check_retrieval(cfg)


def check_retrieval(cfg: Config) -> None:
    """Refuse a retrieval task the model's vocabulary or the row cannot hold, and a sample it has no
    tokenizer for."""
    d = cfg.data
    needed = 1 + d.retrieval_keys + d.retrieval_values
    if cfg.model.vocab_size < needed:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) cannot hold the retrieval task's "
            f"1 + {d.retrieval_keys} keys + {d.retrieval_values} values; "
            f"set --model.vocab_size={needed}"
        )
    if d.retrieval_pairs > d.retrieval_keys:
        raise UserError(
            f"data.retrieval_pairs ({d.retrieval_pairs}) exceeds data.retrieval_keys: "
            "keys are distinct"
        )
    if 4 * d.retrieval_pairs > cfg.train.seq_len + 1:
        raise UserError(
            f"train.seq_len ({cfg.train.seq_len}) cannot hold {d.retrieval_pairs} retrieval pairs "
            "and their queries; lower data.retrieval_pairs or raise train.seq_len to "
            f"{4 * d.retrieval_pairs}"
        )
    if cfg.train.sample_tokens:
        raise UserError(
            "data.task retrieval has no tokenizer to sample with; set train.sample_tokens = 0"
        )


def check_training_options(cfg: Config) -> None:
    """Refuse random positions the model cannot use, an init_from run that would be overwritten, and
    a cosine budget without the warmup steps it times."""
    t = cfg.train
    m = cfg.model
    check_schedule(cfg)
    if t.max_minutes and cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps < 4:
        raise UserError(
            "train.max_minutes needs optim.warmup_steps of 4 or more with optim.schedule cosine "
            f"(not {cfg.optim.warmup_steps}): it times the first warmup steps, whose learning rate "
            "does not depend on the run's length, to size the run"
        )
    if t.random_positions and m.position == "nope":
        raise UserError(
            "train.random_positions needs a position encoding, and model.position nope has none"
        )
    if m.position == "learned" and t.random_positions * t.seq_len > m.max_seq_len:
        raise UserError(
            f"train.random_positions ({t.random_positions}) × train.seq_len ({t.seq_len}) exceeds "
            f"the learned position table model.max_seq_len ({m.max_seq_len}); "
            "raise model.max_seq_len or lower random_positions"
        )
    if t.init_from is not None and Path(t.init_from).resolve() == Path(t.out_dir).resolve():
        raise UserError(
            f"train.init_from ({t.init_from}) must be another run directory than train.out_dir"
        )


def check_schedule(cfg: Config) -> None:
    """Refuse an optim.decay_start that no wsd decay of train.max_steps can begin at."""
    o = cfg.optim
    if o.decay_start is None:
        return
    if o.schedule != "wsd":
        raise UserError(f"optim.decay_start applies to optim.schedule wsd, not {o.schedule}")
    if cfg.train.max_minutes:
        raise UserError(
            "optim.decay_start is decided by the train.max_minutes budget; give train.max_steps "
            "with it"
        )
    if o.decay_start >= cfg.train.max_steps:
        raise UserError(
            f"optim.decay_start ({o.decay_start}) must be below train.max_steps "
            f"({cfg.train.max_steps})"
        )
