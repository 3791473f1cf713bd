"""Train picollama in one process or under torchrun with FSDP2:
python train.py [--config F.toml] [--section.key=value ...] [--resume]."""

import math
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from data.loader import RandomBatches, checked_meta, eval_batches, open_tokens
from data.prepare import prepare
from data.retrieval import RetrievalBatches, RetrievalTask, retrieval_metrics
from data.tokenizer import open_tokenizer, tokenizer_file, tokenizer_sha256
from model import ModelArgs, Transformer
from picollama import REPO_ROOT
from picollama.budget import Budget, run_length
from picollama.checkpoint import (
    check_tokenizer,
    checkpoints,
    load_checkpoint,
    load_model,
    resume_point,
    save_checkpoint,
    stopped,
)
from picollama.cli import (
    Interrupted,
    UserError,
    check_writable,
    exclusive,
    listed,
    resolved,
    run_command,
)
from picollama.config import (
    Config,
    DataConfig,
    check_config,
    check_init_model,
    length_problem,
    parse_cli,
)
from picollama.device import (
    Dist,
    check_compiler,
    gib,
    keep_freed_memory,
    memory_bytes,
    peak_flops,
    pick_device,
    pick_dtype,
)
from picollama.metrics import RunLog, Throughput, flops_per_token, memory_gb
from picollama.optim import build_optimizer, lr_at

VALIDATION_FORMATS = {
    "val_ppl": "perplexity {:.2f}",
    "val_bpb": "{:.4f} bits/byte",
    "val_acc": "accuracy {:.1%}",
}

# ---------------------------------------------------------------- the run's settings


def init_from_weights(cfg: Config) -> tuple[dict | None, ModelArgs]:
    """The weights of the run directory train.init_from (None without one), whose model must equal
    model.* (which config.py took from it) but for the context keys and share data.dir's
    tokenizer, and the model this run trains: model.*, where a run that stretches the source's
    context gets rope_original_max_seq_len = that context, so that RoPE scaling and extrapolate
    stretch from it."""
    source_dir = cfg.train.init_from
    if source_dir is None:
        return None, cfg.model
    try:
        source, _ = load_model(source_dir)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    check_init_model(source_dir, source.args.to_dict(), cfg.model.to_dict())
    theirs, ours = tokenizer_file(source_dir), tokenizer_file(cfg.data.dir)
    if theirs and ours and tokenizer_sha256(theirs) != tokenizer_sha256(ours):
        raise UserError(f"train.init_from {source_dir} has another tokenizer than {cfg.data.dir}")
    original = source.args.original_seq_len
    if cfg.model.rope_original_max_seq_len is None and cfg.model.max_seq_len > original:
        return source.state_dict(), replace(cfg.model, rope_original_max_seq_len=original)
    return source.state_dict(), cfg.model


def with_length(cfg: Config, max_steps: int, decay_start: int | None) -> Config:
    """cfg, running for max_steps steps, a wsd schedule decaying from decay_start."""
    train, optim = (
        replace(cfg.train, max_steps=max_steps),
        replace(cfg.optim, decay_start=decay_start),
    )
    return replace(cfg, train=train, optim=optim)


def check_memory(cfg: Config, world_size: int):
    """UserError, before any work, for a model or batch that cannot fit in the device's memory, by
    a lower bound: 12 bytes a parameter (fp32 weights, gradients and one optimizer moment; sharded
    over the ranks) and, per token of a rank's micro-step, the logits and their gradient in fp32
    and, in training, each block's input (all that activation checkpointing keeps)."""
    device = pick_device(cfg.train.device)
    memory = memory_bytes(device)
    if memory is None:
        return
    m, t, e = cfg.model, cfg.train, cfg.eval
    with torch.device("meta"):  # sizes only, no memory
        params = Transformer(m).num_params()
    state = 12 * params // world_size
    logits = 8 * m.vocab_size
    blocks = m.n_layers * m.dim * pick_dtype(t.dtype, device).itemsize
    ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
    train_rows = t.batch_size // (t.grad_accum * world_size)
    for key, size, rows, per_token in [
        ("train.batch_size", t.batch_size, train_rows, logits + blocks),
        ("eval.batch_size", e.batch_size, e.batch_size, logits),
    ]:
        activations = rows * t.seq_len * per_token
        if state + activations <= memory:
            continue
        fits = (memory - state) // (t.seq_len * per_token)
        if fits < 1:
            raise UserError(
                f"the model ({params:,} parameters) cannot fit in memory: its weights, gradients "
                f"and optimizer state and one sequence of {t.seq_len} tokens need at least "
                f"{gib(state + t.seq_len * per_token)}{ranks}, and {device.type} memory is "
                f"{gib(memory)}; choose a smaller model or train.seq_len"
            )
        more = " or raise train.grad_accum" if key.startswith("train") else ""
        raise UserError(
            f"{key} {size:,} cannot fit in memory: {rows:,} sequences of {t.seq_len} tokens at "
            f"once{ranks} need at least {gib(activations)} for their logits and activations, "
            f"beside {gib(state)} for the weights and optimizer state, and {device.type} memory "
            f"is {gib(memory)}: at most {fits:,} fit; lower {key}{more}"
        )


# ---------------------------------------------------------------- data


def check_dataset(cfg: Config):
    """UserError, before any work, unless data.dir is a prepared dataset (a folder with meta.json)
    or a missing (absent or empty) folder that train.py prepares from data.source: the default
    source's own folder (data/shakespeare, from the current directory or the repository), or any
    folder for a data.source given (so that a mistyped --data.dir is never filled with
    Shakespeare)."""
    d = cfg.data
    data_dir = Path(d.dir)
    if d.task != "text" or (data_dir / "meta.json").is_file():
        return
    if data_dir.is_file():
        problem = "it is a file"
    elif data_dir.is_dir() and any(data_dir.iterdir()):
        held = listed(sorted(p.name + "/" * p.is_dir() for p in data_dir.iterdir()))
        problem = f"no meta.json; it holds {held}"
    else:
        own = {resolved(DataConfig.dir), resolved(REPO_ROOT / DataConfig.dir)}
        if d.source != DataConfig.source or resolved(data_dir) in own:
            return
        problem = "it is empty" if data_dir.is_dir() else "it does not exist"
        raise UserError(
            f"data.dir {data_dir} is not a prepared dataset ({problem}); make one with python "
            f"data/prepare.py --source YOUR_TEXT --out {data_dir}, or give --data.source=YOUR_TEXT "
            f"to prepare it here (only {DataConfig.dir} is prepared by itself, with Shakespeare)"
        )
    raise UserError(
        f"data.dir {data_dir} is not a prepared dataset ({problem}); make one with python "
        "data/prepare.py --source YOUR_TEXT --out DIR and train with --data.dir=DIR"
    )


def prepare_data(cfg: Config, dist: Dist) -> tuple[Path, dict]:
    """data.dir (prepared from data.source if missing, as check_dataset allows) and its meta.json,
    checked against cfg."""
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").is_file() and dist.main:
        print(f"{data_dir} is not prepared yet: preparing it from {cfg.data.source}")
        vocab_size = cfg.data.vocab_size or cfg.model.vocab_size
        command = ["train.py", "(auto-prepare)"]
        prepare(cfg.data.source, vocab_size, out_dir=data_dir, command=command)
    dist.barrier()
    meta = checked_meta(data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer of "
            f"{data_dir} ({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']}"
        )
    for split in ("train", "val"):
        open_tokens(data_dir, split)  # checks the shard against meta.json
        tokens = meta["splits"][split]["tokens"]
        if tokens < cfg.train.seq_len + 1:
            raise UserError(
                f"the {split} split of {data_dir} has {tokens} tokens, too few for train.seq_len "
                f"{cfg.train.seq_len}; lower train.seq_len or use more text"
            )
    return data_dir, meta


def check_sample_fits(cfg: Config, data_dir: Path):
    """UserError, before training, if the final sample (prompt and sample_tokens) is too long."""
    t = cfg.train
    if not t.sample_tokens:
        return
    tokenizer = open_tokenizer(tokenizer_file(data_dir) or data_dir / "tokenizer.model")
    prompt = 1 + len(tokenizer.encode(t.sample_prompt))  # BOS and the prompt, as generate.py does
    problem = length_problem(cfg.model, prompt + t.sample_tokens)
    if problem:
        raise UserError(
            f"train.sample_tokens ({t.sample_tokens}) and the prompt ({prompt} tokens): {problem}; "
            "lower train.sample_tokens"
        )


def evaluate(model, cfg: Config, data_dir: Path, meta: dict, dist: Dist) -> dict:
    """Validation loss, perplexity and bits/byte over the first eval.batches batches, over ranks."""
    batches = list(
        eval_batches(data_dir, "val", cfg.eval.batch_size, cfg.train.seq_len, cfg.eval.batches)
    )
    per_rank = math.ceil(len(batches) / dist.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    with torch.no_grad():
        for i in range(per_rank):
            index = i * dist.world_size + dist.rank
            # ranks without a batch still join FSDP's collectives
            x, y = batches[min(index, len(batches) - 1)]
            loss = model(x.to(dist.device), y.to(dist.device))
            if index < len(batches):
                count = torch.tensor(y.numel(), device=dist.device)
                totals += torch.stack([loss.double() * y.numel(), count])
    loss_sum, count = dist.all_reduce_sum(totals).tolist()
    loss = loss_sum / count
    bits_per_byte = loss / math.log(2) / meta["bytes_per_token"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700)), "val_bpb": bits_per_byte}


@dataclass
class DataSource:
    loader: object  # next_batch(), state_dict(), load_state_dict()
    validate: Callable[..., dict]  # model -> {"val_loss": ..., ...}
    probe_batches: list  # a few validation (x, y) batches, which a budget probe times
    tokenizer: Path | None  # the tokenizer saved with the model (None: the task has none)
    line: str  # what the data is


def data_source(cfg: Config, dist: Dist) -> DataSource:
    """The batches and validation of data.task: a prepared dataset, or the retrieval task."""
    t, d, e = cfg.train, cfg.data, cfg.eval
    if d.task == "retrieval":
        task = RetrievalTask(d.retrieval_keys, d.retrieval_values, d.retrieval_pairs)
        batches = task.fixed_batches(e.batches, e.batch_size, t.seq_len)
        loader = RetrievalBatches(
            task, t.batch_size, t.seq_len, seed=t.seed, filler=d.retrieval_filler
        )
        validate = partial(retrieval_metrics, batches=batches, device=dist.device)
        sizes = f"{task.pairs} pairs of {task.keys} keys and {task.values} values"
        line = f"data: retrieval task ({sizes})"
        return DataSource(loader, validate, batches[:3], None, line)
    data_dir, meta = prepare_data(cfg, dist)
    check_sample_fits(cfg, data_dir)
    loader = RandomBatches(
        data_dir, "train", t.batch_size, t.seq_len, seed=t.seed, **d.copy_options()
    )
    probe = list(eval_batches(data_dir, "val", e.batch_size, t.seq_len, min(3, e.batches)))
    validate = partial(evaluate, cfg=cfg, data_dir=data_dir, meta=meta, dist=dist)
    line = f"data {data_dir} ({meta['splits']['train']['tokens']:,} train tokens)"
    tokenizer = tokenizer_file(data_dir) or data_dir / "tokenizer.model"
    return DataSource(loader, validate, probe, tokenizer, line)


def random_positions(batch: int, seq_len: int, k: int) -> torch.Tensor:
    """Randomized positions (Ruoss et al. 2023), (batch, seq_len) int64: each row a sorted random
    subset of seq_len distinct positions from [0, k·seq_len), drawn from torch's global generator
    (seeded, and checkpointed)."""
    return torch.rand(batch, k * seq_len).topk(seq_len, dim=1).indices.sort(dim=1).values


def next_rows(loader, cfg: Config, rows: slice, device: torch.device):
    """(x, y, positions): this rank's rows of the next global batch, and of its random positions
    (None when train.random_positions is off), on the device."""
    t = cfg.train
    x, y = (batch[rows].to(device) for batch in loader.next_batch())
    if not t.random_positions:
        return x, y, None
    # drawn for the global batch, as the data is: the same on any number of ranks
    positions = random_positions(t.batch_size, t.seq_len, t.random_positions)
    return x, y, positions[rows].to(device)


# ---------------------------------------------------------------- model and step


def parallelize(model: Transformer, cfg: Config, mesh, dtype: torch.dtype) -> Transformer:
    """Activation checkpointing, torch.compile and FSDP2 on the plain model, per block. Mixed
    precision is FSDP2's policy: fp32 master weights, sharded, gathered as `dtype` for the forward
    and backward, gradients reduced in fp32 (the same on any device and number of ranks)."""
    if cfg.train.activation_checkpointing:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()  # in place: parameter names keep no _orig_mod. prefix
    if mesh is None:  # a device without collectives (UNGROUPED): the plain model, in its own dtype
        return model
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_model(
    cfg: Config, dist: Dist, init: dict | None = None
) -> tuple[Transformer, torch.optim.Optimizer, str]:
    """The parallelized model (the same initial weights on any device and world size, or `init`'s),
    its optimizer, and a line saying how many parameters it has, how many rank 0 stores, and the
    precision."""
    if cfg.train.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    # initialised on the CPU generator first: the same weights anywhere
    model = Transformer(cfg.model).to(dist.device)
    if init is not None:
        model.load_state_dict(init)
    num_params = model.num_params()
    dtype = pick_dtype(cfg.train.dtype, dist.device)
    if dist.mesh is None and dtype != torch.float32:
        problem = f"train.dtype {cfg.train.dtype} on {dist.device.type}"
        raise UserError(f"{problem}: mixed precision needs FSDP2's process group; use float32")
    model = parallelize(model, cfg, dist.mesh, dtype)
    local_params = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
    )
    sizes = f"{num_params:,} parameters, {local_params:,} stored on rank 0 of {dist.world_size}"
    precision = "fp32" if dtype == torch.float32 else f"{str(dtype)[6:]} with fp32 master weights"
    return model, build_optimizer(model, cfg, dist.device), f"{sizes}; {precision}"


def seed_everything(seed: int):
    """Seed Python's, numpy's and torch's generators (a resumed run restores their states)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def loss_terms(model, x, y, positions, z_loss: float) -> dict[str, torch.Tensor]:
    """One micro-batch's loss terms, summed for the gradient: the mean cross-entropy ("loss"), and
    with z_loss > 0 z_loss·mean(logsumexp(logits)²) ("z_loss"; PaLM's, which keeps the softmax
    normaliser near 1)."""
    kwargs = {} if positions is None else {"positions": positions}
    if not z_loss:
        return {"loss": model(x, y, **kwargs)}
    logits = model(x, **kwargs).float()
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    return {"loss": loss, "z_loss": z_loss * logits.logsumexp(-1).square().mean()}


def train_step(model, optimizer, x, y, lr: float, cfg: Config, dist: Dist, positions=None):
    """One optimizer step on this rank's rows (x, y, and positions if given) of the global batch,
    in train.grad_accum micro-steps.

    Returns (losses, grad_norm, applied): each loss term (loss_terms) averaged over micro-steps and
    the global gradient norm, all left on the device, and whether the update was applied: it is not
    when a loss or the gradient norm is NaN or infinite."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    accum = cfg.train.grad_accum
    losses = {}
    chunks = [None] * accum if positions is None else positions.chunk(accum)
    for micro, (xm, ym, pm) in enumerate(zip(x.chunk(accum), y.chunk(accum), chunks, strict=True)):
        if hasattr(model, "set_requires_gradient_sync"):
            # FSDP2's: reduce gradients on the last micro-step only
            model.set_requires_gradient_sync(micro == accum - 1)
        terms = loss_terms(model, xm, ym, pm, cfg.optim.z_loss)
        (sum(terms.values()) / accum).backward()
        for name, term in terms.items():
            losses[name] = losses.get(name, 0) + term.detach() / accum
    max_norm = cfg.optim.grad_clip or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # The one host sync of every step (free on CPU, a short stall on GPU). The gradient norm is
    # global already; the loss is this rank's, so it joins through a sum over ranks: all ranks skip
    # the update together.
    applied = bool(torch.isfinite(dist.all_reduce_sum(sum(losses.values()).clone()) + grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm, applied


# ---------------------------------------------------------------- the run


def due(step: int, interval: int, last: int) -> bool:
    """Whether a thing done every `interval` steps (0: never) and at the last is due at `step`."""
    return step == last or (interval > 0 and step % interval == 0)


def log_step(log: RunLog, step: int, lr: float, losses: dict, grad_norm, clock: Throughput, dist):
    """Record the step's losses (mean over ranks), learning rate, gradient norm, speed, memory."""
    entry = {
        "step": step,
        **{name: dist.mean(value) for name, value in losses.items()},
        "lr": lr,
        "grad_norm": grad_norm.item(),
        **clock.rates(),
        "mem_gb": memory_gb(dist.device),
    }
    log.record(entry)
    tokens_per_s = f"{entry['tokens_per_s']:,.0f}"
    log.bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=tokens_per_s, lr=f"{lr:.2e}")


def validate(model, data: DataSource, log: RunLog, step: int, run_dir: Path):
    """Evaluate, record and say the validation metrics; stop the run if the loss is not finite."""
    result = data.validate(model)
    log.record({"step": step, **result})
    if not math.isfinite(result["val_loss"]):
        raise stopped(f"the validation loss is {result['val_loss']} at step {step}", run_dir)
    parts = [f.format(result[k]) for k, f in VALIDATION_FORMATS.items() if k in result]
    log.say(f"step {step}: val loss {result['val_loss']:.4f}, " + ", ".join(parts))


def save(
    model, optimizer, data: DataSource, cfg: Config, dist: Dist, log: RunLog, step: int, budget
):
    """Save the resumable checkpoint and the model export, with the run's settings and tokenizer,
    and in a train.max_minutes run the wall seconds its Budget `budget` has spent (over all its
    processes), which a resumed budget goes on from."""
    run_dir = Path(cfg.train.out_dir)
    # the model's own settings go beside them
    settings = {k: v for k, v in cfg.to_dict().items() if k != "model"}
    if cfg.train.max_minutes:
        settings["train"]["spent_s"] = round(budget.spent(), 3)
    keep = cfg.checkpoint.keep
    save_checkpoint(
        run_dir, step, model, optimizer, data.loader, dist, settings, data.tokenizer, keep
    )
    log.say(f"step {step}: saved checkpoint {checkpoints(run_dir)[-1]}")


def train(cfg: Config, resume: bool, dist: Dist, started: float):
    """Train cfg from scratch or from train.out_dir's latest checkpoint: log, evaluate and save."""
    run_dir = Path(cfg.train.out_dir)
    # The config that runs: the model as train.init_from leaves it (resume_point checks that one),
    # for as many steps as a train.max_minutes budget allows.
    init, model_args = init_from_weights(cfg)
    cfg = replace(cfg, model=model_args)
    start = resume_point(run_dir, cfg.model, resume, cfg.to_dict())
    max_steps, decay_start, budget = run_length(cfg, start, started)
    cfg = with_length(cfg, max_steps, decay_start)
    data = data_source(cfg, dist)
    if start is not None and data.tokenizer is not None:
        check_tokenizer(start, data.tokenizer)
    seed_everything(cfg.train.seed)
    # a resumed run loads its checkpoint instead
    model, optimizer, sizes = build_model(cfg, dist, None if start else init)
    step = 0 if start is None else load_checkpoint(start, model, optimizer, data.loader, dist)
    log = RunLog(cfg, run_dir, step, max_steps if budget.decided else None, dist.main)
    resuming = f"; resuming at step {step}" if start else ""
    log.say(f"model: {sizes}; {data.line}; device {dist.device}{resuming}")
    run_steps(cfg, model, optimizer, data, log, dist, step, budget)
    log.close()


def decide_length(
    cfg: Config, budget: Budget, step: int, model, data: DataSource, log: RunLog, dist: Dist, clock
) -> Config:
    """cfg, with the train.max_steps (and optim.decay_start) its budget decides at `step` if it does
    (the same on every rank)."""
    if budget.eval_steps is None:
        with clock.paused():  # the budget's estimate of an evaluation is not training time
            budget.time_evaluation(model, data.probe_batches, dist)
    decision = budget.decide(step, model, dist)
    if decision is None:
        return cfg
    max_steps, decay_start, line = decision
    log.sized(step, max_steps, line)
    return with_length(cfg, max_steps, decay_start)


def run_steps(
    cfg: Config, model, optimizer, data: DataSource, log: RunLog, dist: Dist, step: int, budget
):
    """Train on from `step` to train.max_steps, logging, evaluating and saving when due; until the
    Budget `budget` has decided train.max_steps, it may at any step."""
    t = cfg.train  # the settings that stay; train.max_steps may change
    run_dir = Path(t.out_dir)
    peak = peak_flops(dist.device, t.peak_tflops)
    peak = peak * dist.world_size if peak else None
    tokens = t.batch_size * t.seq_len
    clock = Throughput(tokens, flops_per_token(model, t.seq_len), peak, dist.device)
    # Every rank draws the same global batch and keeps its rows, so the data never depends on the
    # world size.
    rows = slice(
        dist.rank * t.batch_size // dist.world_size,
        (dist.rank + 1) * t.batch_size // dist.world_size,
    )
    while step < cfg.train.max_steps:
        lr = lr_at(step, cfg)
        x, y, positions = next_rows(data.loader, cfg, rows, dist.device)
        losses, grad_norm, applied = train_step(model, optimizer, x, y, lr, cfg, dist, positions)
        if not applied:
            # a NaN or infinity: every rank skipped the update; stop, naming the last checkpoint
            loss = dist.mean(losses["loss"])
            problem = f"the loss is {loss} (gradient norm {grad_norm.item()}) at step {step + 1}"
            raise stopped(f"{problem}; training stopped before applying that update", run_dir)
        step += 1
        clock.steps += 1
        log.bar.update()
        if budget.step_done(step):
            cfg = decide_length(cfg, budget, step, model, data, log, dist, clock)
        last = cfg.train.max_steps
        if due(step, t.log_interval, last):
            log_step(log, step, lr, losses, grad_norm, clock, dist)
        evaluating = due(step, cfg.eval.interval, last)
        saving = due(step, cfg.checkpoint.interval, last)
        if evaluating or saving:
            with clock.paused():  # tokens/s and MFU count training time alone
                if evaluating:
                    with budget.timed("eval"):
                        validate(model, data, log, step, run_dir)
                if saving:
                    with budget.timed("save"):
                        save(model, optimizer, data, cfg, dist, log, step, budget)


# ---------------------------------------------------------------- the command


def print_sample(cfg: Config, device: torch.device):
    """A sample from the saved run, by generate.py in its own process (no script imports one)."""
    t = cfg.train
    flags = f"--run {t.out_dir} --max-new-tokens {t.sample_tokens} --top-k 200 --seed {t.seed}"
    prompt = ["--prompt", t.sample_prompt] if t.sample_prompt else []
    generate = [sys.executable, str(REPO_ROOT / "generate.py")]
    command = [*generate, *flags.split(), "--device", device.type, *prompt]
    print("---- sample ----", flush=True)
    try:
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted while sampling; the run is complete in {t.out_dir}"
        ) from None
    print("----------------")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if result.returncode:
        status = f"exit status {result.returncode}"
        problem = errors[-1].removeprefix("error: ") if errors else status
        raise UserError(
            f"generate.py could not sample from {t.out_dir} ({problem}); the run is complete"
        )
    print(result.stderr, end="", file=sys.stderr)


def interruption(run_dir: Path) -> str:
    """What an interrupted training says: where --resume continues, if anywhere."""
    found = checkpoints(run_dir)
    if not found:
        return (
            "interrupted before the first checkpoint; nothing to resume (run again to start over)"
        )
    return f"interrupted; --resume continues from step {int(found[-1].name[5:])} ({found[-1]})"


def main(argv: list[str]) -> int:
    started = time.perf_counter()  # a train.max_minutes budget counts from here
    cfg, resume = parse_cli(argv, __doc__)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_config(cfg, world_size)
    check_dataset(cfg)
    check_memory(cfg, world_size)
    run_dir = Path(cfg.train.out_dir)
    # before any work; never in the dataset
    check_writable(run_dir, inputs=[cfg.data.dir], directory=True)
    if cfg.train.compile:
        check_compiler()
    keep_freed_memory()
    # one writer per run directory: rank 0 holds the lock for the whole job
    with exclusive(run_dir) if os.environ.get("RANK", "0") == "0" else nullcontext():
        dist = Dist(cfg.train.device)
        try:
            train(cfg, resume, dist, started)
        except BaseException as e:
            # the failed frames' model and optimizer must go before close()
            traceback.clear_frames(e.__traceback__)
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
                raise Interrupted(interruption(run_dir)) from None
            raise
        finally:
            dist.close()
    if dist.main:
        tokenizer = tokenizer_file(run_dir) if cfg.data.task == "text" else None
        files = f", {tokenizer.name}" if tokenizer else ""
        if cfg.train.sample_tokens:
            print_sample(cfg, dist.device)
        print(
            f"done: the model is in {run_dir} (model.safetensors, config.json{files}); metrics in "
            f"{run_dir / 'metrics.jsonl'}; resumable state in {run_dir / 'train_state'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
