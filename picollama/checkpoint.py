"""Run directories (model.safetensors, config.json, tokenizer.model) and train_state/ to resume."""

import json
import os
import random
import re
import shutil
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from data.tokenizer import (
    TOKENIZER_CONFIG,
    open_tokenizer,
    same_tokenizer,
    tokenizer_file,
    tokenizer_sha256,
)
from model import ModelArgs, Transformer
from picollama.cli import (
    UserError,
    atomic_output,
    check_free_space,
    check_type,
    held_signals,
    one_line,
    remove,
    replace,
    resolved,
    write_failure,
)
from picollama.config import CONTEXT_KEYS, saved_model_args

# model.safetensors' metadata key recording the model its weights are for (ModelArgs as JSON):
# config.json edited to another n_heads or activation would load the same shapes, computing
# something else
WEIGHTS_MODEL = "picollama.model"


def save_model(model: Transformer, run_dir, config: dict | None = None, tokenizer=None) -> Path:
    """Write model.safetensors, config.json ({"model": ModelArgs, **config, and the tokenizer's
    sha256}) and a copy of tokenizer.model, all atomically together (see model_files); UserError,
    writing nothing, if a weight is NaN or infinite or the disk has too little space."""
    with model_files(model, run_dir, config, tokenizer):
        pass
    return Path(run_dir)


@contextmanager
def model_files(model: Transformer, run_dir, config: dict | None = None, tokenizer=None):
    """save_model's files, each written to a temporary name before the block and all renamed into
    place after it (in the order tokenizer, config, weights), so that a failed write (a full disk)
    or a failed block leaves the previous model, config and tokenizer as they were, consistent."""
    run_dir = Path(run_dir)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    bad = non_finite(state.items())
    if bad:
        raise UserError(f"not saving {run_dir}: {', '.join(bad[:3])} hold NaN or infinite values")
    if model.args.tie_embeddings:
        del state["output.weight"]  # the same tensor as tok_embeddings.weight
    recorded = {"tokenizer_sha256": tokenizer_sha256(tokenizer)} if tokenizer is not None else {}
    text = json.dumps({"model": model.args.to_dict(), **(config or {}), **recorded}, indent=2)
    target = run_dir / tokenizer_name(tokenizer) if tokenizer is not None else None
    copy = tokenizer is not None and Path(tokenizer).resolve() != target.resolve()
    needed = model_bytes(model) + len(text) + (Path(tokenizer).stat().st_size if copy else 0)
    check_free_space(run_dir, needed, f"the model to {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    # a signal waits from the block to the last rename, so that all or none are renamed
    with ExitStack() as renames, ExitStack() as files:  # files renamed in the reverse order
        weights = files.enter_context(atomic_output(run_dir / "model.safetensors", needed))
        save_file(state, weights, metadata={WEIGHTS_MODEL: json.dumps(model.args.to_dict())})
        config_tmp = files.enter_context(atomic_output(run_dir / "config.json"))
        config_tmp.write_text(text)
        if copy:
            shutil.copyfile(tokenizer, files.enter_context(atomic_output(target)))
            tokenizer_config = Path(tokenizer).with_name(TOKENIZER_CONFIG)
            if tokenizer_config.is_file():  # special tokens, the chat template
                shutil.copyfile(
                    tokenizer_config, files.enter_context(atomic_output(run_dir / TOKENIZER_CONFIG))
                )
        renames.enter_context(held_signals(escape=False))
        yield


def tokenizer_name(tokenizer) -> str:
    """The name a tokenizer file takes in a run directory: tokenizer.json or tokenizer.model."""
    return "tokenizer.json" if Path(tokenizer).suffix == ".json" else "tokenizer.model"


def model_bytes(model: Transformer) -> int:
    """About the size of model.safetensors: the weights (a tied output counted once), a header."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params) + 64 * 1024


def non_finite(named_tensors) -> list[str]:
    """The names of the floating-point tensors among (name, tensor) pairs that hold a NaN or inf.
    A finite sum proves a tensor finite (a NaN or inf makes it NaN or inf) without the full-size
    mask that isfinite makes (0.03 s against 0.29 s for a 135M model's weights)."""
    return [
        name
        for name, t in named_tensors
        if t.is_floating_point()
        and not bool(torch.isfinite(t.sum(dtype=torch.float32)))
        and not bool(torch.isfinite(t).all())
    ]


def load_model(run_dir, device="cpu") -> tuple[Transformer, dict]:
    """The model saved in run_dir and its config.json; UserError naming what is missing or wrong."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise UserError(
            f"{run_dir} is a file: pass the run directory that holds it, {run_dir.parent}"
        )
    if is_hf_directory(run_dir):
        raise UserError(
            f"{run_dir} is a Hugging Face model directory; import it first: "
            f"python -m picollama.convert from-hf --hf-dir {run_dir} --out RUN_DIR"
        )
    for name in ("model.safetensors", "config.json"):
        if not (run_dir / name).is_file():
            raise UserError(f"{run_dir} is not a picollama run directory: {name} is missing")
    try:
        config = json.loads((run_dir / "config.json").read_text())
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
    """UserError naming the first model key (but CONTEXT_KEYS) in which config.json's model, `args`,
    differs from the one the weights were saved with, `saved` (None: not recorded)."""
    ours = args.to_dict()
    for key, value in (saved or {}).items():
        if key in ours and key not in CONTEXT_KEYS and ours[key] != value:
            raise UserError(
                f"weights do not match config.json: model.{key} is {ours[key]} there, {value} in "
                "the weights"
            )


def is_hf_directory(path: Path) -> bool:
    """Whether path holds a Hugging Face config.json (a model_type, no picollama "model" key)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config and "model" not in config


def load_run(run_dir, device, dtype: torch.dtype) -> tuple[Transformer, dict, object]:
    """(model in dtype and eval mode, config, tokenizer (data.tokenizer's interface)) from a run
    directory; UserError naming what is wrong. The tokenizer may have fewer pieces than the model
    has embeddings (padded vocabularies): generate.py then samples only ids it can decode."""
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
    """The tokenizer of a tokenizer.model or tokenizer.json file; UserError if it is not one."""
    try:
        return open_tokenizer(path)
    except ValueError as e:
        raise UserError(str(e)) from None


def model_from_state_dict(args: ModelArgs, state: dict) -> Transformer:
    """A Transformer of args holding state's tensors as they are (dtype, device), uninitialized."""
    layers = len({key.split(".")[1] for key in state if key.startswith("layers.")})
    embedding = state.get("tok_embeddings.weight")
    rows, columns = (
        embedding.shape if embedding is not None and embedding.ndim == 2 else (None, None)
    )
    # checked before the model is built: a corrupt size could take minutes
    for key, found in (("n_layers", layers), ("vocab_size", rows), ("dim", columns)):
        if found not in (None, getattr(args, key)):
            raise UserError(
                f"weights do not match config.json: model.{key} is {getattr(args, key)} there, "
                f"{found} in the weights"
            )
    if args.tie_embeddings:
        state = {**state, "output.weight": state["tok_embeddings.weight"]}
    with torch.device("meta"):
        model = Transformer(args)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:  # a line per wrong weight; the first, with its shapes, says enough
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        first = re.sub(
            r"copying a param with shape torch\.Size\((.*?)\) from checkpoint, "
            r"the shape in current model is torch\.Size\((.*?)\)",
            r"\1 in the weights, \2 by the config",
            problems[0] if problems else str(e),
        )[:300]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"weights do not match config.json: {first}{more}") from None
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


# ---------------------------------------------------------------- train_state: what --resume reads
# Called by every rank; `dist` is train.py's Dist (rank, world_size, main, device, barrier).


@contextmanager
def single_process_quiet():
    """Silence DCP's warning that it runs without a process group: a single process has none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if device.type == "cuda"
        else None,
    }


def set_rng_state(state: dict, device: torch.device):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(
        (state["numpy"][0], np.array(state["numpy"][1], dtype=np.uint32), *state["numpy"][2:])
    )
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def checkpoints(run_dir) -> list[Path]:
    """Finished train_state/step_* directories, oldest first (not the unfinished .step_*.tmp)."""
    found = [
        p
        for p in (Path(run_dir) / "train_state").glob("step_*")
        if re.fullmatch(r"step_\d+", p.name)
    ]
    return sorted((p for p in found if p.is_dir()), key=lambda p: int(p.name[5:]))


def save_checkpoint(
    run_dir, step: int, model, optimizer, loader, dist, config: dict, tokenizer, keep: int
):
    """train_state/step_N (DCP model and optimizer shards, each rank's loader and RNG state,
    meta.json), written into a temporary directory, and the run directory's model export (save_model
    with `config` and `tokenizer`) written beside it; both are renamed into place only once all is
    written, so that a failed save (a full disk: checked first, and reported as one line) removes
    its temporary files and leaves the previous checkpoint and model, consistent with each other.
    SIGINT and SIGTERM wait for the save to end (a second one stops it, removing what it wrote).
    The last `keep` checkpoints are kept."""
    check_finite(model, optimizer, dist, f"at step {step}", run_dir)
    state_dir = Path(run_dir) / "train_state"
    final = state_dir / f"step_{step:06d}"
    # one name on every rank, all writing into it (not atomic_output's)
    tmp = state_dir / f".{final.name}.tmp"
    needed = dist.world_size * local_state_bytes(model, optimizer) + model_bytes(model)
    with held_signals() as received:
        try:
            if dist.main:
                remove_temporaries(state_dir)  # left by a crash
                check_free_space(run_dir, needed, f"checkpoint {final} and the model export")
                tmp.mkdir(parents=True)
            dist.barrier()
            write_checkpoint(tmp, final, step, model, optimizer, loader, dist, config, tokenizer)
            if dist.main:
                for old in checkpoints(run_dir)[:-keep]:  # hidden first: never half a checkpoint
                    hidden = old.with_name(f".{old.name}.tmp")
                    os.replace(old, hidden)
                    remove(hidden)
        except BaseException as e:
            if dist.main:
                remove_temporaries(state_dir)
            cause = cause_of(e)
            # a second signal; or DCP or torch.save wrapping a Ctrl-C (torch.save's "unexpected
            # pos" would otherwise read as a full disk)
            if received or isinstance(cause, KeyboardInterrupt) and cause is not e:
                raise KeyboardInterrupt from None
            if isinstance(cause, UserError):  # already one line (another rank's failure among them)
                raise cause from None
            failure = write_failure(final, cause, needed)
            if failure is not None:
                raise failure from None
            raise
        dist.barrier()


def remove_temporaries(state_dir: Path):
    """Delete train_state's .step_*.tmp directories: a save's, or a checkpoint being deleted."""
    for path in state_dir.glob(".step_*.tmp"):
        remove(path)


def write_checkpoint(
    tmp: Path, final: Path, step: int, model, optimizer, loader, dist, config: dict, tokenizer
):
    """save_checkpoint's writes: every rank's part of the checkpoint into `tmp`, then rank 0's
    model export, renamed into place together with `tmp` renamed to `final`."""

    def write():
        write_train_state(tmp, step, model, optimizer, loader, dist, config, tokenizer)

    def export():
        if dist.main:
            exported = model_from_state_dict(model.args, {k: v.float() for k, v in full.items()})
            with model_files(exported, final.parent.parent, config, tokenizer):
                replace(tmp, final)

    together(dist, write, final)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    together(dist, export, final)


def cause_of(e: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException (the first failing rank's), else e."""
    return next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e


def together(dist, work, final: Path):
    """work() on this rank, then the ranks agree: if it failed on any, every rank raises (the
    failing rank its own exception, the others a UserError naming that rank and its one-line
    reason), so that no rank waits in a collective for one that gave up (a disk full on rank 1
    only), and rank 0, the one that prints, says why."""
    try:
        work()
        failure = None
    except Exception as e:
        failure = e
    if dist.world_size == 1:
        if failure is not None:
            raise failure
        return
    cause = failure and cause_of(failure)
    message = cause and one_line(write_failure(final, cause) or cause)
    messages = [None] * dist.world_size
    torch_dist.all_gather_object(messages, message)
    if failure is not None:
        raise failure
    rank, message = next(((r, m) for r, m in enumerate(messages) if m is not None), (None, None))
    if message is not None:
        raise UserError(f"rank {rank} failed to save: {message}")


def write_train_state(
    tmp: Path, step: int, model, optimizer, loader, dist, config: dict, tokenizer
):
    """This rank's part of a checkpoint in `tmp`: DCP shards, rank{R}.json; and rank 0's meta.json,
    which records the model, the tokenizer and the settings a resume must keep (EXACT_KEYS)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    # One process saves without DCP's collectives: after a save with them, training ran ~25% slower
    # ever after, the cores idle in OpenMP barrier waits (most likely gloo's threads start a second
    # OpenMP team, and libgomp, seeing more threads than cores, stops spinning).
    with single_process_quiet():
        dcp.save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=str(tmp),
            no_dist=dist.world_size == 1,
        )
    extra = {"step": step, "loader": loader.state_dict(), "rng": rng_state(dist.device)}
    (tmp / f"rank{dist.rank}.json").write_text(json.dumps(extra))
    if dist.main:
        meta = {"step": step, "world_size": dist.world_size, "model": model.args.to_dict()}
        # what a resume must keep, the run's length (which a train.max_minutes budget decides) and
        # the wall seconds it has spent (which the budget goes on from until it has decided)
        recorded = (*EXACT_KEYS, "train.max_steps", "optim.decay_start", "train.spent_s")
        meta["settings"] = {key: setting(config, key) for key in recorded}
        if tokenizer is not None:
            meta["tokenizer_sha256"] = tokenizer_sha256(tokenizer)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))


def local_state_bytes(model, optimizer) -> int:
    """About the bytes this rank's shard of a checkpoint takes: weights, optimizer state, JSON."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [
            v.to_local() if hasattr(v, "to_local") else v
            for v in state.values()
            if torch.is_tensor(v)
        ]
    return sum(t.numel() * t.element_size() for t in tensors) + 256 * 1024


def check_finite(model, optimizer, dist, when: str, run_dir):
    """Stop (on every rank) when this rank's shard of the weights or of the optimizer state holds a
    NaN or an infinity, anywhere: such a state is never saved."""
    local = [
        (name, p.to_local() if hasattr(p, "to_local") else p)
        for name, p in model.named_parameters()
    ]
    for i, state in enumerate(optimizer.state.values()):
        local += [
            (f"optimizer {key} {i}", v.to_local() if hasattr(v, "to_local") else v)
            for key, v in state.items()
        ]
    bad = non_finite(local)
    if dist.all_reduce_sum(torch.tensor(float(len(bad)), device=dist.device)).item():
        names = ", ".join(bad[:3]) or "on another rank"
        problem = f"the weights or optimizer state are NaN or infinite {when} ({names})"
        raise stopped(f"{problem}; they were not saved", run_dir)


def stopped(problem: str, run_dir) -> UserError:
    """The error stopping a run whose numbers are no longer finite, naming the checkpoint to use."""
    found = checkpoints(run_dir)
    if not found:
        return UserError(f"{problem}. Try a lower optim.lr or a smaller model")
    return UserError(
        f"{problem}. The last good checkpoint is {found[-1]}: continue it with --resume and a "
        "lower optim.lr, or start again with a smaller model"
    )


def unusable(path: Path, problem: str) -> UserError:
    """The error for a checkpoint that cannot be resumed, pointing at the one before it."""
    step = int(path.name[5:])
    earlier = [p for p in checkpoints(path.parent.parent) if int(p.name[5:]) < step]
    hint = (
        f"delete it to resume from {earlier[-1]}"
        if earlier
        else "run without --resume to start again"
    )
    return UserError(f"cannot resume from {path}: {problem}; {hint}")


def load_checkpoint(path: Path, model, optimizer, loader, dist) -> int:
    """Restore a checkpoint save_checkpoint wrote (by any number of ranks); returns its step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        own = path / f"rank{dist.rank}.json"
        extra = json.loads((own if own.is_file() else path / "rank0.json").read_text())
        loader.load_state_dict(extra["loader"])
        set_rng_state(extra["rng"], dist.device)
    except (Exception, CheckpointException) as e:  # DCP and torch raise many kinds: one line
        e = cause_of(e)
        message = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        if any(words in str(e) for words in MISMATCHES):  # readable, but saved by another setup
            raise UserError(
                f"cannot resume from {path}: it holds the state of another optimizer or model "
                f"({message}), e.g. saved with another optim.name; resume with the settings it was "
                f"saved with, or {NEW_RUN.format(run_dir=path.parent.parent)}"
            ) from None
        raise unusable(path, f"the checkpoint is corrupt or incomplete ({message})") from None
    return int(extra["step"])


# How DCP and torch.optim say that a readable checkpoint holds other state than the run's (not that
# it is corrupt): every checkpoint of the run would say the same.
MISMATCHES = (
    "Missing key in checkpoint state_dict",
    "Size mismatch between saved",
    "parameter group",
)


# What a resume must keep to continue exactly (the model, data and tokenizer are checked on their
# own): the data stream and the optimizer, whose state the checkpoint holds; a checkpoint records
# them in meta.json's "settings". The schedule (max_steps, learning rates) may change.
EXACT_KEYS = (
    "optim.name",
    "train.batch_size",
    "train.seq_len",
    "train.random_positions",
    "data.copy_fraction",
    "data.copy_span",
    "data.copy_repeats",
    "data.retrieval_keys",
    "data.retrieval_values",
    "data.retrieval_pairs",
    "data.retrieval_filler",
)
# what to do with a run that cannot be continued
NEW_RUN = "start a new run from its weights: --train.init_from={run_dir} and another train.out_dir"
# what makes a directory a run, with or without train_state/
RUN_FILES = ("model.safetensors", "config.json")


def setting(config: dict, key: str):
    """config["section"]["name"] for key "section.name" (None where absent)."""
    section, _, name = key.partition(".")
    return (config.get(section) or {}).get(name)


def resume_point(run_dir, args: ModelArgs, resume: bool, config: dict | None = None) -> Path | None:
    """The checkpoint to continue from, after checking it holds a model of `args`, that `config`
    (the run's settings as save_checkpoint gets them) keeps its EXACT_KEYS and has steps left to do;
    None for a fresh run, which is refused in a directory that holds a run."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found and not resume:
        raise UserError(
            f"{run_dir} already holds a run ({found[-1].name}); pass --resume to continue it, "
            "or choose another train.out_dir"
        )
    if not found and held:  # said alike with --resume or without: neither can go on here
        raise without_checkpoint(run_dir, held)
    if not resume:
        return None
    if not found:
        raise UserError(
            f"nothing to resume: {run_dir / 'train_state'} holds no checkpoint; "
            "run without --resume"
        )
    latest = found[-1]
    meta = read_meta(latest)
    saved = saved_model_args(meta["model"]).to_dict()  # keys added since read as their defaults
    differences = [
        f"model.{k} {saved.get(k)!r} → {v!r}"
        for k, v in args.to_dict().items()
        if saved.get(k) != v
    ]
    if differences:
        raise UserError(
            f"cannot resume from {latest}: it was trained with a different model "
            f"({', '.join(differences)})"
        )
    if config is None:
        return latest
    recorded = meta.get("settings") or {}
    current = {k: setting(config, k) for k in EXACT_KEYS}
    changed = [
        f"{k} {recorded[k]!r} → {current[k]!r}"
        for k in EXACT_KEYS
        if recorded.get(k) not in (None, current[k])
    ]
    if changed:
        raise UserError(
            f"cannot resume from {latest} exactly: {', '.join(changed)}; resume with the "
            f"checkpoint's values, or {NEW_RUN.format(run_dir=run_dir)}"
        )
    max_steps = setting(config, "train.max_steps")
    if setting(config, "train.max_minutes"):  # the length its budget chose
        max_steps = recorded_max_steps(latest)
    if max_steps is not None and meta["step"] >= max_steps:
        raise UserError(
            f"nothing to do: {latest} is at step {meta['step']} and train.max_steps is "
            f"{max_steps}; raise train.max_steps to train on"
        )
    return latest


def without_checkpoint(run_dir: Path, held: list[str]) -> UserError:
    """The error for a run directory holding RUN_FILES (`held`) but no checkpoint to resume."""
    if "model.safetensors" not in held:
        return UserError(
            f"{run_dir} holds {', '.join(held)} but no model.safetensors and no checkpoint "
            f"(train_state/): nothing to resume or start from; delete {run_dir}, or choose "
            "another train.out_dir"
        )
    return UserError(
        f"{run_dir} already holds a run ({', '.join(held)}) but no checkpoint to resume "
        f"(train_state/): {NEW_RUN.format(run_dir=run_dir)}, or delete {run_dir} to start over "
        "there"
    )


def read_meta(checkpoint: Path) -> dict:
    """A checkpoint's meta.json, each value checked for its type (UserError naming the key)."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise TypeError(type(meta).__name__)
        for key, kind in (("step", int), ("world_size", int), ("tokenizer_sha256", str | None)):
            check_type(key, meta.get(key), kind)
        check_type("settings", meta.get("settings"), dict | None)
        saved_model_args(meta["model"])
    except UserError as e:
        raise unusable(checkpoint, f"meta.json: {e}") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise unusable(checkpoint, "meta.json is missing or corrupt") from None
    return meta


def recorded_max_steps(checkpoint: Path) -> int:
    """The step count a train.max_minutes run chose, as its checkpoint records it."""
    steps = (read_meta(checkpoint).get("settings") or {}).get("train.max_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UserError(
            f"{checkpoint} records no step count for train.max_minutes; "
            "resume with --train.max_steps=N"
        )
    return steps


def check_tokenizer(checkpoint: Path, tokenizer: Path):
    """UserError unless `tokenizer` (the dataset's) is the one the checkpoint was trained with, as
    its meta.json records, or as the run's tokenizer.model says for checkpoints that record none."""
    meta = read_meta(checkpoint)
    run_tokenizer = tokenizer_file(checkpoint.parent.parent)
    expected = meta.get("tokenizer_sha256")
    if not expected and run_tokenizer is not None:
        expected = tokenizer_sha256(run_tokenizer)
    if not same_tokenizer(expected, tokenizer):
        recorded, data_dir = recorded_data_dir(checkpoint.parent.parent), Path(tokenizer).parent
        other = recorded and resolved(recorded) != resolved(data_dir)
        hint = f" (--data.dir={recorded}, as its config.json records)" if other else ""
        raise UserError(
            f"cannot resume from {checkpoint}: it was trained with another tokenizer "
            f"(sha256 {expected[:12]}) than data.dir {data_dir} has "
            f"(sha256 {tokenizer_sha256(tokenizer)[:12]}); resume with the dataset it was trained "
            f"on{hint}, or train on {data_dir} in a new train.out_dir"
        )


def recorded_data_dir(run_dir: Path) -> str | None:
    """The data.dir a run's config.json records (None: none, or not readable)."""
    try:
        recorded = json.loads((run_dir / "config.json").read_text())["data"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return recorded if isinstance(recorded, str) else None
