"""Checkpoints in train_state/step_N, which --resume reads: DCP model and optimizer shards, and
each rank's loader and RNG state. A save is whole or absent."""

import json
import os
import random
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from data.tokenizer import tokenizer_sha256
from picollama.chat_template import write_default_template
from picollama.cli import UserError
from picollama.cli.command import held_signals, one_line
from picollama.cli.outputs import check_free_space, remove, replace, write_failure
from picollama.run_files import model_bytes, model_files, model_from_state_dict, non_finite
from picollama.training.resume import EXACT_KEYS, NEW_RUN, checkpoints, setting, unusable
from picollama.training.weight_average import averaged

# Every rank calls these. `dist` is train.py's Dist (rank, world_size, main, device, barrier).


@contextmanager
def single_process_quiet():
    """Silence DCP's warning that it runs without a process group. A single process has none."""
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


def save_checkpoint(
    run_dir,
    step: int,
    model,
    optimizer,
    loader,
    dist,
    config: dict,
    tokenizer,
    keep: int,
    average=None,
):
    """Save train_state/step_N and the model export together, or neither.

    step_N holds DCP shards of the model, the optimizer and, once begun, the WeightAverage
    `average`. It also holds each rank's loader and RNG state, and meta.json. The export is
    save_model's, with `config` and `tokenizer`. Both get temporary names, renamed only when all
    is written. So a failed save, such as a full disk (checked first), leaves the previous
    checkpoint and model, consistent. SIGINT and SIGTERM wait for the save to end. A second signal
    stops it, removing what it wrote. The last `keep` checkpoints are kept."""
    check_finite(model, optimizer, dist, f"at step {step}", run_dir)
    state_dir = Path(run_dir) / "train_state"
    final = state_dir / f"step_{step:06d}"
    # One name on every rank, all writing into it, so not atomic_output's.
    tmp = state_dir / f".{final.name}.tmp"
    needed = dist.world_size * local_state_bytes(model, optimizer) + model_bytes(model)
    with held_signals() as received:
        try:
            if dist.main:
                remove_temporaries(state_dir)  # Left by a crash.
                check_free_space(run_dir, needed, f"checkpoint {final} and the model export")
                tmp.mkdir(parents=True)
            dist.barrier()
            write_checkpoint(
                tmp, final, step, model, optimizer, loader, dist, config, tokenizer, average
            )
            if dist.main:
                for old in checkpoints(run_dir)[:-keep]:  # Hidden first: never half a checkpoint.
                    hidden = old.with_name(f".{old.name}.tmp")
                    os.replace(old, hidden)
                    remove(hidden)
        except BaseException as e:
            if dist.main:
                remove_temporaries(state_dir)
            cause = cause_of(e)
            # A second signal, or DCP or torch.save wrapping a Ctrl-C. Else torch.save's
            # "unexpected pos" would read as a full disk.
            if received or isinstance(cause, KeyboardInterrupt) and cause is not e:
                raise KeyboardInterrupt from None
            if isinstance(cause, UserError):  # Already one line, such as another rank's failure.
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
    tmp: Path,
    final: Path,
    step: int,
    model,
    optimizer,
    loader,
    dist,
    config: dict,
    tokenizer,
    average,
):
    """save_checkpoint's writes. Every rank writes its part into `tmp`. Then rank 0's model export
    (the WeightAverage `average`, once begun) is renamed into place, with `tmp` to `final`."""

    def write():
        write_train_state(tmp, step, model, optimizer, loader, dist, config, tokenizer, average)

    def export():
        if dist.main:
            exported = model_from_state_dict(model.args, {k: v.float() for k, v in full.items()})
            with model_files(exported, final.parent.parent, config, tokenizer):
                replace(tmp, final)
            if tokenizer is not None:  # Its dataset's chat template (copied), else the default.
                write_default_template(final.parent.parent)

    together(dist, write, final)
    # The export is the average where there is one. The train state keeps the weights. The
    # average stays applied until written, as the full state dict may share their storage.
    with averaged(average):
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        together(dist, export, final)


def cause_of(e: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException (the first failing rank's), else e."""
    return next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e


def together(dist, work, final: Path):
    """Run work() on this rank, then the ranks agree. If it failed on any, every rank raises: the
    failing rank its own exception, the others a UserError naming that rank and its reason. So no
    rank waits in a collective for one that gave up, as with a full disk on rank 1 only. And rank
    0, which prints, says why."""
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
    tmp: Path, step: int, model, optimizer, loader, dist, config: dict, tokenizer, average=None
):
    """Write this rank's part of a checkpoint in `tmp`: DCP shards and rank{R}.json. Rank 0 also
    writes meta.json. It records the model, the tokenizer and the settings a resume must keep."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if average is not None and average.average is not None:
        state["average"] = average.state_dict()
    # One process saves without DCP's collectives. After a save with them, training ran ~25%
    # slower ever after. The cores sat idle in OpenMP barrier waits. Most likely gloo's threads
    # start a second OpenMP team. libgomp then sees more threads than cores and stops spinning.
    with single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=dist.world_size == 1)
    extra = {"step": step, "loader": loader.state_dict(), "rng": rng_state(dist.device)}
    extra["averaged"] = "average" in state
    (tmp / f"rank{dist.rank}.json").write_text(json.dumps(extra))
    if dist.main:
        meta = {"step": step, "world_size": dist.world_size, "model": model.args.to_dict()}
        # What a resume must keep, and the run's length, which a train.max_minutes budget decides.
        # Also the wall seconds spent, which the budget goes on from until it decides.
        recorded = (*EXACT_KEYS, "train.init_from", "train.max_steps", "optim.decay_start")
        recorded += ("train.spent_s",)
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
    """Stop every rank when any shard of the weights or optimizer state holds a NaN or infinity.
    Such a state is never saved."""
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


def load_checkpoint(path: Path, model, optimizer, loader, dist, average=None) -> int:
    """Restore a checkpoint save_checkpoint wrote, with any number of ranks, and return its step.
    The WeightAverage `average`'s state comes back too, where it holds one."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        own = path / f"rank{dist.rank}.json"
        extra = json.loads((own if own.is_file() else path / "rank0.json").read_text())
        if average is not None and extra.get("averaged"):
            state["average"] = average.template()
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if "average" in state:
            average.load_state_dict(state["average"])
        loader.load_state_dict(extra["loader"])
        set_rng_state(extra["rng"], dist.device)
    except (Exception, CheckpointException) as e:  # DCP and torch raise many kinds. Say one line.
        e = cause_of(e)
        message = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        if any(words in str(e) for words in MISMATCHES):  # Readable, but saved by another setup.
            raise UserError(
                f"cannot resume from {path}: it holds the state of another optimizer or model "
                f"({message}), e.g. saved with another optim.name; resume with the settings it was "
                f"saved with, or {NEW_RUN.format(run_dir=path.parent.parent)}"
            ) from None
        raise unusable(path, f"the checkpoint is corrupt or incomplete ({message})") from None
    return int(extra["step"])


# How DCP and torch.optim say a readable checkpoint holds other state than the run's. It is not
# corrupt, so every checkpoint of the run would say the same.
MISMATCHES = (
    "Missing key in checkpoint state_dict",
    "Size mismatch between saved",
    "parameter group",
)
