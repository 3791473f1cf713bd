"""Run directories (model.safetensors + config.json + tokenizer.model): what generate.py and convert.py read."""
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cli import UserError, atomic_output
from model import ModelArgs, Transformer


def save_model(model: Transformer, run_dir, config: dict | None = None, tokenizer=None) -> Path:
    """Write model.safetensors, config.json ({"model": ModelArgs, **config}) and a copy of tokenizer.model, each
    file atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        del state["output.weight"]  # the same tensor as tok_embeddings.weight
    with atomic_output(run_dir / "model.safetensors") as tmp:
        save_file(state, tmp)
    with atomic_output(run_dir / "config.json") as tmp:
        tmp.write_text(json.dumps({"model": model.args.to_dict(), **(config or {})}, indent=2))
    if tokenizer is not None and Path(tokenizer).resolve() != (run_dir / "tokenizer.model").resolve():
        with atomic_output(run_dir / "tokenizer.model") as tmp:
            shutil.copyfile(tokenizer, tmp)
    return run_dir


def load_model(run_dir, device="cpu") -> tuple[Transformer, dict]:
    """The model saved in run_dir and its config.json; UserError naming what is missing or wrong."""
    run_dir = Path(run_dir)
    for name in ("model.safetensors", "config.json"):
        if not (run_dir / name).is_file():
            raise UserError(f"{run_dir} is not a picollama run directory: {name} is missing")
    try:
        config = json.loads((run_dir / "config.json").read_text())
        args = ModelArgs.from_dict(config["model"])
        state = load_file(run_dir / "model.safetensors", device=str(device))
    except (json.JSONDecodeError, KeyError, TypeError, SafetensorError) as e:
        raise UserError(f"{run_dir}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    try:
        return model_from_state_dict(args, state), config
    except RuntimeError as e:
        raise UserError(f"{run_dir}: weights do not match config.json ({str(e).splitlines()[0]})") from None


def model_from_state_dict(args: ModelArgs, state: dict) -> Transformer:
    """A Transformer of args holding state's tensors as they are (dtype, device), without a random init."""
    if args.tie_embeddings:
        state = {**state, "output.weight": state["tok_embeddings.weight"]}
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model
