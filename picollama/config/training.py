"""Training configuration. Each dataclass below is one TOML section, with its keys and defaults.
Command-line flags of the form --section.key=value override them."""

import difflib
import json
import re
import tomllib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from model import ModelArgs
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.flags import (
    ArgumentParser,
    add_compile,
    add_device,
    add_out,
    add_seed,
    utf8_argument,
)
from picollama.cli.user_files import read_small_text
from picollama.components.registry import WINDOWED
from picollama.components.variants import switches
from picollama.config.model_args import CONTEXT_KEYS, checked_model_args, saved_model_args
from picollama.config.values import CHOICES, TEXT_KEYS, check_value

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"


@dataclass
class DataConfig:
    dir: str = "data/shakespeare"  # A prepared dataset (data/prepare.py). Else made from `source`.
    source: str = "shakespeare"  # As data/prepare.py --source: shakespeare, PATH or hf:NAME.
    vocab_size: int | None = None  # Tokenizer size when preparing. None means model.vocab_size.
    tokenizer_type: str = "bpe"  # The tokenizer's algorithm when preparing: bpe or unigram.
    # Synthetic copy data, Bi-Induct style (data/loader.py's RandomBatches). This share of training
    # windows get a random span, copied later in the window. Induction heads form on it. 0 is off.
    copy_fraction: float = 0.0
    copy_span: int = 8  # Tokens in the span.
    copy_repeats: int = 4  # Copies of it in the window.
    # Pack whole documents into rows by best fit, cutting long ones to row length. Attention stays
    # inside each document, and positions restart at each (data/packing.py). Conversations always
    # are packed.
    pack_documents: bool = False
    # Random: windows are drawn uniformly, with replacement. Epochs: each pass takes every window
    # once, shuffled (data/epochs.py).
    sampling: str = "random"
    # Text trains on the dataset in `dir`. Retrieval is the synthetic key-value recall task of
    # data/retrieval.py. It is generated from train.seed and needs no dataset or tokenizer. It is
    # validated by its accuracy on fixed rows.
    task: str = "text"
    retrieval_keys: int = 64  # The keys' alphabet, token ids 1 to keys.
    # The values' alphabet, the next ids. model.vocab_size must hold 1 + keys + values.
    retrieval_values: int = 64
    retrieval_pairs: int = 8  # Key-value pairs per row. Each key is queried later in the row.
    # The share of training slots after the key block left as filler, not queries.
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
    out_dir: str = "out/default"  # The run directory.
    max_steps: int = 1000  # The run's length, unless max_minutes or epochs sizes it.
    # A wall-clock budget that fixes max_steps from the time spent. It counts data preparation,
    # evaluations, checkpoints and the final sample. With optim.schedule wsd, recent step times
    # decide when the decay starts. With cosine, the first warmup steps decide. None: max_steps.
    max_minutes: float | None = None
    # Passes over the training split that fix max_steps before the first step: epochs × the rows of
    # a pass / batch_size, rounded up. A pass is the split's packed rows (conversations, packed
    # documents), else its windows of seq_len + 1 tokens. None: max_steps, or max_minutes.
    epochs: float | None = None
    # Stop once the validation loss has not improved on its best for this many evaluations in a
    # row. The run then saves only at evaluations that improve it, so it keeps the best weights.
    # 0 is off.
    early_stop: int = 0
    batch_size: int = 16  # Sequences per optimizer step, over all ranks and micro-steps.
    grad_accum: int = 1  # Micro-steps per optimizer step.
    seq_len: int = 256
    seed: int = 1337
    device: str = "auto"  # One of auto, cpu, cuda, mps. Auto is cuda, else mps, else cpu.
    # One of float32, bfloat16, auto. Auto is bfloat16 where the device computes it natively.
    # The weights stay float32, and the forward runs in this dtype.
    dtype: str = "auto"
    compile: bool = False  # torch.compile each block.
    activation_checkpointing: bool = False
    log_interval: int = 10
    peak_tflops: float | None = None  # Per device, for MFU. None looks up the GPU (none on CPU).
    sample_tokens: int = 200  # Tokens of a sample printed at the end. 0 is none.
    sample_prompt: str = ""
    init_from: str | None = None  # A run directory whose weights, not optimizer, start this run.
    # With k > 0, each sequence sits at sorted random positions from [0, k·seq_len). 0 is off.
    random_positions: int = 0
    dropout: float = 0.0  # Each residual write is zeroed with this probability in training.
    # Above 0, evaluate and save an EMA of the weights with this beta. It runs over the wsd decay,
    # or over the whole run with cosine.
    weight_average: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4  # The schedule decays to this at max_steps.
    warmup_steps: int = 100
    # The shape after the linear warmup. Cosine decays to min_lr at max_steps along a cosine. Wsd
    # (warmup-stable-decay) holds lr, then decays it as 1-sqrt to min_lr from decay_start on.
    schedule: str = "cosine"
    # Wsd: the decay's share of max_steps. Under train.max_minutes it is a share of the time. The
    # budget decides max_steps and decay_start when that much time is left.
    decay_fraction: float = 0.2
    decay_start: int | None = None  # Wsd: the step the decay begins. None: from decay_fraction.
    weight_decay: float = 0.1  # On matrices only.
    # Wsd: weight_decay rises on a line over the decay, to this at max_steps. The falling lr would
    # end the shrinking (lr·weight_decay), and this keeps it up. None: weight_decay throughout.
    final_weight_decay: float | None = None
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # Max global gradient norm. 0 is no clipping.
    name: str = "adamw"  # AdamW, or muon (Muon on the blocks' matrices, AdamW on the rest).
    muon_lr: float = 0.02  # Muon's peak learning rate. The schedule scales it as it scales lr.
    muon_momentum: float = 0.95
    z_loss: float = 0.0  # Adds z_loss·mean(logsumexp(logits)²) to the loss (PaLM). 0 is off.


@dataclass
class EvalConfig:
    interval: int = 250  # Steps between validation runs, plus one at the end. 0: only at the end.
    batches: int = 20
    batch_size: int = 16
    interim_batches: int = 0  # Batches read by each evaluation but the last, spread out. 0: all.


@dataclass
class CheckpointConfig:
    interval: int = 500  # Steps between checkpoints, plus one at the end. 0: only at the end.
    keep: int = 2  # How many train_state/step_* directories are kept.


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "picollama"
    run_name: str | None = None  # None means the run directory's name.


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
    """A Config from TOML sections plus (section.key, string) overrides. UserError names any bad
    key or value."""
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
    one_length(values["train"], given)
    for dotted, text in overrides:
        name, _, key = dotted.partition(".")
        if name not in sections or key not in field_types(sections[name]):
            raise unknown_key_error(dotted, all_keys)
        values[name][key] = parse_override(dotted, text, field_types(sections[name])[key])
    if (init_from := values["train"].get("init_from")) is not None:
        # Model keys given with train.init_from or after it. The file's count if it names init_from.
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


LENGTH_KEYS = ("train.max_steps", "train.max_minutes", "train.epochs")  # Each sets the length.


def one_length(train: dict, given: set[str]):
    """Refuse a config file, or a command line (the `given` keys), that sets two of LENGTH_KEYS.
    The command line wins: a length given there turns off the file's. `train` is the file's."""
    for layer, keys in (
        ("the config file", {f"train.{k}" for k in train}),
        ("the command line", given),
    ):
        both = [key for key in LENGTH_KEYS if key in keys]
        if len(both) > 1:
            raise UserError(f"{layer} sets both {' and '.join(both[:2])}; keep one")
    if any(key in given for key in LENGTH_KEYS):
        for key in LENGTH_KEYS[1:]:
            if key not in given:
                train[key[6:]] = None


def init_from_model(run_dir: str, model: dict, given: set[str]) -> dict:
    """The model settings of a run started from train.init_from.

    They are run_dir's own, from its config.json, with the `given` keys of `model` on top. Those
    may change only CONTEXT_KEYS, and a UserError names any other that differs. Where run_dir has
    no config.json, `model` is returned as it is. run_files.load_model reports that later."""
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
    """UserError naming the first model key that differs from `source`, the init_from run's
    model. Only CONTEXT_KEYS may differ."""
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
    [--section.key=value ...] [--resume]`, and whether to resume. The shorthands are the flags
    other commands share (cli/flags.py). They set the train keys in SHORTHANDS."""
    parser = ArgumentParser(
        prog="python train.py",
        description=description,
        epilog="Any config key can be overridden as --section.key=value (sections: "
        + ", ".join(section_types())
        + "), e.g. --train.max_steps=200 --model.dim=128. The model's switches ("
        + ", ".join(f"model.{key}" for key in switches())
        + ") leave LLaMA's format when set: such a run exports to neither Hugging Face (to-hf) "
        "nor GGUF (to-gguf). RoPE scaling keeps it, but for " + ", ".join(WINDOWED) + ".",
    )
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a TOML config (default configs/default.toml)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the latest checkpoint in the run directory"
    )
    add_out(parser, "the run directory written (train.out_dir)")
    # None keeps the config's value.
    add_device(parser, None, CHOICES["train.device"], CHOICES["train.dtype"])
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
        raw = tomllib.loads(read_small_text(args.config, "--config"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{args.config} is not valid TOML: {e}") from None
    return build_config(raw, overrides), args.resume
