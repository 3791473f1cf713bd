"""Saving and loading the model in a run directory: model.safetensors, config.json and the
tokenizer. They are replaced together, so a failed save leaves the old ones."""

import json
import re
import shutil
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from data.tokenizer import (
    TOKENIZER_CONFIG,
    open_tokenizer,
    same_tokenizer,
    tokenizer_file,
    tokenizer_sha256,
)
from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.cli.command import held_signals
from picollama.cli.flags import check_type
from picollama.cli.outputs import atomic_output, check_free_space
from picollama.config.model_args import CONTEXT_KEYS, saved_model_args

# The metadata key in model.safetensors that records the model its weights are for, as JSON.
# A config.json edited to another n_heads or activation loads the same shapes. It would quietly
# compute something else.
WEIGHTS_MODEL = "picollama.model"


def save_model(model: Transformer, run_dir, config: dict | None = None, tokenizer=None) -> Path:
    """Write model.safetensors, config.json and a copy of the tokenizer, atomically together.
    config.json holds {"model": ModelArgs, **config} and the tokenizer's sha256. A NaN or infinite
    weight, or too little disk space, is a UserError, and nothing is written."""
    with model_files(model, run_dir, config, tokenizer):
        pass
    return Path(run_dir)


@contextmanager
def model_files(model: Transformer, run_dir, config: dict | None = None, tokenizer=None):
    """save_model's files. Each is written to a temporary name before the block. All are renamed
    into place after it, in the order tokenizer, config, weights. So a failed write, such as a full
    disk, or a failed block leaves the previous model, config and tokenizer consistent."""
    run_dir = Path(run_dir)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    bad = non_finite(state.items())
    if bad:
        raise UserError(f"not saving {run_dir}: {', '.join(bad[:3])} hold NaN or infinite values")
    if model.args.tie_embeddings:
        del state["output.weight"]  # The same tensor as tok_embeddings.weight.
    recorded = {"tokenizer_sha256": tokenizer_sha256(tokenizer)} if tokenizer is not None else {}
    text = json.dumps({"model": model.args.to_dict(), **(config or {}), **recorded}, indent=2)
    target = run_dir / tokenizer_name(tokenizer) if tokenizer is not None else None
    copy = tokenizer is not None and Path(tokenizer).resolve() != target.resolve()
    needed = model_bytes(model) + len(text) + (Path(tokenizer).stat().st_size if copy else 0)
    check_free_space(run_dir, needed, f"the model to {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    # Signals wait from the block to the last rename, so all or none are renamed.
    with ExitStack() as renames, ExitStack() as files:  # Files are renamed in reverse order.
        weights = files.enter_context(atomic_output(run_dir / "model.safetensors", needed))
        save_file(state, weights, metadata={WEIGHTS_MODEL: json.dumps(model.args.to_dict())})
        config_tmp = files.enter_context(atomic_output(run_dir / "config.json"))
        config_tmp.write_text(text)
        if copy:
            shutil.copyfile(tokenizer, files.enter_context(atomic_output(target)))
            tokenizer_config = Path(tokenizer).with_name(TOKENIZER_CONFIG)
            if tokenizer_config.is_file():  # Special tokens and the chat template.
                shutil.copyfile(
                    tokenizer_config, files.enter_context(atomic_output(run_dir / TOKENIZER_CONFIG))
                )
        renames.enter_context(held_signals(escape=False))
        yield


def tokenizer_name(tokenizer) -> str:
    """The name a tokenizer file takes in a run directory: tokenizer.json or tokenizer.model."""
    return "tokenizer.json" if Path(tokenizer).suffix == ".json" else "tokenizer.model"


def model_bytes(model: Transformer) -> int:
    """About the size of model.safetensors: the weights, a tied output once, and a header."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) + 64 * 1024


def non_finite(named_tensors) -> list[str]:
    """The names of the floating-point tensors among (name, tensor) pairs that hold a NaN or inf.
    A NaN or inf makes the sum NaN or inf, so a finite sum proves a tensor finite. That skips
    isfinite's full-size mask: 0.03 s against 0.29 s for a 135M model's weights."""
    return [
        name
        for name, t in named_tensors
        if t.is_floating_point()
        and not bool(torch.isfinite(t.sum(dtype=torch.float32)))
        and not bool(torch.isfinite(t).all())
    ]


def load_model(run_dir, device="cpu") -> tuple[Transformer, dict]:
    """The model saved in run_dir and its config.json. UserError names what is missing or wrong."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise UserError(not_a_run_file(run_dir))
    if is_hf_directory(run_dir):
        raise UserError(
            f"{run_dir} is a Hugging Face model directory; import it first: "
            f"python -m picollama.convert from-hf --hf-dir {run_dir} --out RUN_DIR"
        )
    for name in ("model.safetensors", "config.json"):
        if not (run_dir / name).is_file():
            raise UserError(f"{run_dir} is not a picollama run directory: {name} is missing")
    config = read_run_config(run_dir / "config.json")
    try:
        args = saved_model_args(config["model"])
        check_type("tokenizer_sha256", config.get("tokenizer_sha256"), str | None)
        state, saved = read_weights(run_dir / "model.safetensors", device)
    except UserError as e:
        raise UserError(f"{run_dir}/config.json is corrupt: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, SafetensorError) as e:
        raise UserError(f"{run_dir}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    bad = non_finite(state.items())
    if bad:
        raise UserError(
            f"{run_dir}/model.safetensors holds NaN or infinite weights ({', '.join(bad[:3])}): "
            "the run diverged; use an earlier checkpoint"
        )
    try:
        check_saved_model(args, saved)
        return model_from_state_dict(args, state), config
    except UserError as e:
        raise UserError(f"{run_dir}: {e}") from None


def not_a_run_file(path: Path) -> str:
    """What to say of a file given where a run directory goes. A GGUF must be imported first.
    A file inside a run points to its run. Anything else is neither."""
    if is_gguf_file(path):
        return (
            f"{path} is a GGUF file, not a run directory; import it first: "
            f"python -m picollama.convert from-gguf --gguf {path} --out RUN_DIR"
        )
    parent = path.parent
    if (parent / "model.safetensors").is_file() and (parent / "config.json").is_file():
        return f"{path} is a file: pass the run directory that holds it, {parent}"
    return f"{path} is a file, neither a run directory nor a .gguf file"


def read_run_config(path: Path) -> dict:
    """A run's config.json, a JSON object with a "model" key. A UserError names the file and what
    is wrong: not UTF-8, not JSON, not an object, or no "model"."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is corrupt: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path} is corrupt: not valid JSON (line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is corrupt: a JSON {type(config).__name__}, not an object")
    if "model" not in config:
        raise UserError(f'{path} is corrupt: it has no "model" key (the model\'s settings)')
    return config


def read_weights(path: Path, device) -> tuple[dict, dict | None]:
    """(state dict, the ModelArgs dict its metadata records, or None if saved before it did)."""
    with safe_open(path, framework="pt", device=str(device)) as file:
        state = {key: file.get_tensor(key) for key in file.keys()}
        recorded = (file.metadata() or {}).get(WEIGHTS_MODEL)
    saved = None if recorded is None else json.loads(recorded)
    if saved is not None and not isinstance(saved, dict):
        raise ValueError(f"its {WEIGHTS_MODEL} metadata is not a JSON object")
    return state, saved


def check_saved_model(args: ModelArgs, saved: dict | None):
    """UserError naming the first model key where config.json's `args` differ from `saved`, the
    model the weights were saved with. CONTEXT_KEYS may differ. None means it was not recorded."""
    ours = args.to_dict()
    for key, value in (saved or {}).items():
        if key in ours and key not in CONTEXT_KEYS and ours[key] != value:
            raise UserError(
                f"weights do not match config.json: model.{key} is {ours[key]} there, {value} in "
                "the weights"
            )


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file named *.gguf, in any case (UPPER.GGUF too). --run imports one."""
    return path.suffix.lower() == ".gguf" and path.is_file()


def is_hf_directory(path: Path) -> bool:
    """Whether path holds a Hugging Face config.json (a model_type, no picollama "model" key)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config and "model" not in config


def load_run(run_dir, device, dtype: torch.dtype) -> tuple[Transformer, dict, object]:
    """(model in dtype and eval mode, config, tokenizer) from a run directory. UserError names
    what is wrong. The tokenizer, with data.tokenizer's interface, may have fewer pieces than a
    padded vocabulary has embeddings. generate.py then samples only ids it can decode."""
    model, config = load_model(run_dir, device)
    tokenizer_path = tokenizer_file(run_dir)
    if tokenizer_path is None:
        raise UserError(
            f"{run_dir} has no tokenizer.model or tokenizer.json; copy the dataset's one there"
        )
    recorded = config.get("tokenizer_sha256")
    if not same_tokenizer(recorded, tokenizer_path):
        raise UserError(
            f"{tokenizer_path} is not the tokenizer the model was saved with (config.json records "
            f"sha256 {recorded[:12]}); copy the dataset's {tokenizer_path.name} there"
        )
    tokenizer = read_tokenizer(tokenizer_path)
    if tokenizer.get_piece_size() > model.args.vocab_size:
        raise UserError(
            f"{run_dir}: the tokenizer has {tokenizer.get_piece_size()} pieces but the model only "
            f"{model.args.vocab_size} embeddings"
        )
    return model.to(dtype).eval(), config, tokenizer


def read_tokenizer(path: Path):
    """The tokenizer of a tokenizer.model or tokenizer.json file. UserError if it is not one."""
    try:
        return open_tokenizer(path)
    except ValueError as e:
        raise UserError(str(e)) from None


@contextmanager
def embedding_not_drawn():
    """Make nn.init.normal_ a no-op while a model is built on the meta device for given weights.
    nn.Embedding draws its table with it. On a meta tensor, that runs a Python reference that
    imports torch._dynamo, a second of a chat's start-up. transformers' no_init_weights skips
    inits the same way."""
    normal = nn.init.normal_

    def not_drawn(tensor, *args, **kwargs):
        return tensor

    nn.init.normal_ = not_drawn
    try:
        yield
    finally:
        nn.init.normal_ = normal


def model_from_state_dict(args: ModelArgs, state: dict, config: str = "config.json") -> Transformer:
    """A Transformer of args holding state's tensors as they are (dtype, device), uninitialized.
    `config` names where args came from, in errors."""
    layers = len({key.split(".")[1] for key in state if key.startswith("layers.")})
    embedding = state.get("tok_embeddings.weight")
    rows, columns = (
        embedding.shape if embedding is not None and embedding.ndim == 2 else (None, None)
    )
    # Checked before the model is built. A corrupt size could take minutes.
    for key, found in (("n_layers", layers), ("vocab_size", rows), ("dim", columns)):
        if found not in (None, getattr(args, key)):
            raise UserError(
                f"weights do not match {config}: model.{key} is {getattr(args, key)} there, "
                f"{found} in the weights"
            )
    if args.tie_embeddings:
        state = {**state, "output.weight": state["tok_embeddings.weight"]}
    with torch.device("meta"), embedding_not_drawn():
        model = Transformer(args)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:  # One line per wrong weight. The first, with its shapes, says enough.
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        first = re.sub(
            r"copying a param with shape torch\.Size\((.*?)\) from checkpoint, "
            r"the shape in current model is torch\.Size\((.*?)\)",
            r"\1 in the weights, \2 by the config",
            problems[0] if problems else str(e),
        )[:300]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"weights do not match {config}: {first}{more}") from None
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model
