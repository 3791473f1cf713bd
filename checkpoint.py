"""Run directories (model.safetensors + config.json + tokenizer.model), what generate.py and convert.py read; and
train.py's resumable state beside them, train_state/step_N (torch.distributed.checkpoint, any number of ranks)."""

import json
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from cli import UserError, atomic_output, remove, replace
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


def load_run(run_dir, device, dtype: torch.dtype) -> tuple[Transformer, dict, spm.SentencePieceProcessor]:
    """(model in dtype and eval mode, config, sentencepiece tokenizer) from a run directory; UserError naming what is
    wrong."""
    model, config = load_model(run_dir, device)
    tokenizer_path = Path(run_dir) / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise UserError(f"{run_dir} has no tokenizer.model; copy the dataset's tokenizer.model there")
    tokenizer = read_tokenizer(tokenizer_path)
    if tokenizer.get_piece_size() > model.args.vocab_size:
        raise UserError(
            f"{run_dir}: the tokenizer has {tokenizer.get_piece_size()} pieces but the model only "
            f"{model.args.vocab_size} embeddings"
        )
    return model.to(dtype).eval(), config, tokenizer


def read_tokenizer(path: Path) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except RuntimeError:
        raise UserError(f"{path} is not a sentencepiece model") from None


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


# ---------------------------------------------------------------- train_state: what --resume continues
# The functions below are called by every rank; `dist` is train.py's Dist (rank, world_size, main, device, barrier).


@contextmanager
def single_process_quiet():
    """Silence DCP's warning that it runs without a process group: that is what a single process means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if device.type == "cuda" else None,
    }


def set_rng_state(state: dict, device: torch.device):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def checkpoints(run_dir) -> list[Path]:
    """Finished train_state/step_* directories, oldest first (unfinished .step_*.tmp ones are ignored)."""
    found = [p for p in (Path(run_dir) / "train_state").glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted((p for p in found if p.is_dir()), key=lambda p: int(p.name[5:]))


def save_checkpoint(run_dir, step: int, model, optimizer, loader, dist, config: dict, tokenizer, keep: int):
    """train_state/step_N (DCP model and optimizer shards, each rank's loader and RNG state, meta.json), written
    into a temporary directory that is renamed once every rank has finished; then the run directory's model export
    (save_model with `config` and `tokenizer`); the last `keep` checkpoints are kept."""
    state_dir = Path(run_dir) / "train_state"
    final = state_dir / f"step_{step:06d}"
    tmp = state_dir / f".{final.name}.tmp"  # one name on every rank, all writing into it (not atomic_output's)
    if dist.main:
        for stale in state_dir.glob(".step_*.tmp"):  # left by a crash
            remove(stale)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    extra = {"step": step, "loader": loader.state_dict(), "rng": rng_state(dist.device)}
    (tmp / f"rank{dist.rank}.json").write_text(json.dumps(extra))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.main:
        meta = {"step": step, "world_size": dist.world_size, "model": model.args.to_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()
    if dist.main:
        replace(tmp, final)
        exported = model_from_state_dict(model.args, {k: v.float() for k, v in full.items()})
        save_model(exported, run_dir, config, tokenizer)
        for old in checkpoints(run_dir)[:-keep]:
            remove(old)
    dist.barrier()


def load_checkpoint(path: Path, model, optimizer, loader, dist) -> int:
    """Restore a checkpoint written by save_checkpoint (with any number of ranks); returns its step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        own = path / f"rank{dist.rank}.json"
        extra = json.loads((own if own.is_file() else path / "rank0.json").read_text())
        loader.load_state_dict(extra["loader"])
        set_rng_state(extra["rng"], dist.device)
    except (Exception, CheckpointException) as e:  # DCP and torch raise many kinds; the user needs one line
        if isinstance(e, CheckpointException):
            e = next(iter(e.failures.values()))[0]
        message = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        raise UserError(f"cannot resume from {path}: the checkpoint is corrupt or incomplete ({message})") from None
    return int(extra["step"])


def resume_point(run_dir, args: ModelArgs, resume: bool) -> Path | None:
    """The checkpoint to continue from, after checking it holds a model of `args`; None for a fresh run."""
    run_dir, found = Path(run_dir), checkpoints(run_dir)
    if not resume:
        if found:
            raise UserError(
                f"{run_dir} already holds a run (checkpoint {found[-1].name}); pass --resume to continue "
                "it, or choose another train.out_dir"
            )
        return None
    if not found:
        raise UserError(f"nothing to resume: {run_dir / 'train_state'} holds no checkpoint; run without --resume")
    latest = found[-1]
    try:
        # through ModelArgs, so that keys added since the checkpoint was written read as their defaults
        saved = ModelArgs.from_dict(json.loads((latest / "meta.json").read_text())["model"]).to_dict()
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"cannot resume from {latest}: meta.json is missing or corrupt") from None
    differences = [f"model.{k} {saved.get(k)!r} → {v!r}" for k, v in args.to_dict().items() if saved.get(k) != v]
    if differences:
        raise UserError(
            f"cannot resume from {latest}: it was trained with a different model ({', '.join(differences)})"
        )
    return latest
