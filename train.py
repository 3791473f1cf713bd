"""Train picollama in one process or under torchrun with FSDP2:
python train.py [--config F.toml] [--section.key=value ...] [--resume]."""

import dataclasses
import gc
import math
import os
import random
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from data.loader import RandomBatches, eval_batches, load_meta, open_tokens
from data.prepare import prepare
from data.retrieval import RetrievalBatches, RetrievalTask, retrieval_metrics
from data.tokenizer import open_tokenizer, same_tokenizer, tokenizer_file, tokenizer_sha256
from model import Transformer
from picollama import REPO_ROOT
from picollama.budget import BudgetProbe
from picollama.checkpoint import (
    check_tokenizer,
    checkpoints,
    load_checkpoint,
    load_model,
    recorded_max_steps,
    resume_point,
    save_checkpoint,
    stopped,
)
from picollama.cli import Interrupted, UserError, check_type, check_writable, exclusive, run_command
from picollama.config import Config, check_config, parse_cli
from picollama.device import check_compiler, keep_freed_memory, peak_flops, pick_device, pick_dtype
from picollama.metrics import RunLog, Throughput, flops_per_token, memory_gb
from picollama.optim import build_optimizer, lr_at

# Devices whose tensors neither gloo nor nccl can hold, even in a group of one (Apple's MPS): one process trains there
# without a group, so without FSDP2 and its mixed precision
UNGROUPED = ("mps",)


class Dist:
    """Rank, world size, device, device mesh and the collectives training needs. A single process is a group of
    one (in-process, no port), so that it trains through the same FSDP2 code, mixed precision included."""

    def __init__(self, device_name: str):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = pick_device(device_name)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.mesh = None  # no group: a plain model, no FSDP2
        if self.device.type in UNGROUPED:
            if self.world_size > 1:
                raise UserError(
                    f"no collective backend serves {self.device.type} tensors: train there in one process"
                )
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:  # torchrun's
            torch_dist.init_process_group(backend)
        else:
            torch_dist.init_process_group(
                backend, store=torch_dist.HashStore(), rank=0, world_size=1
            )
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.mesh is not None:
            torch_dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            torch_dist.all_reduce(tensor)
        return tensor

    def mean(self, scalar: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor, as a Python number (a host sync)."""
        return self.all_reduce_sum(scalar).item() / self.world_size

    def close(self):
        """Destroy the process group once nothing references the model and optimizer (pytorch#190489: gloo can abort
        at exit otherwise): drop the mesh, collect the freed FSDP modules, then destroy."""
        self.mesh = None
        if torch_dist.is_initialized():
            gc.collect()  # a full collection costs ~0.2 s: only when there is a group to destroy
            torch_dist.destroy_process_group()


def parallelize(model: Transformer, cfg: Config, mesh, dtype: torch.dtype) -> Transformer:
    """Activation checkpointing, torch.compile and FSDP2 on the plain model, per block. Mixed precision is FSDP2's
    policy: fp32 master weights, sharded, gathered as `dtype` for the forward and backward, gradients reduced in
    fp32 (the same on any device and number of ranks)."""
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


def due(step: int, interval: int, last: int) -> bool:
    """Whether something done every `interval` steps (0: never) and after the last step is due after `step`."""
    return step == last or (interval > 0 and step % interval == 0)


def prepare_data(cfg: Config, dist: Dist) -> tuple[Path, dict]:
    """The dataset directory (prepared from data.source if missing) and its meta.json, checked against the config."""
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").is_file() and dist.main:
        print(f"{data_dir} is not prepared yet: preparing it from {cfg.data.source}")
        prepare(
            cfg.data.source,
            cfg.data.vocab_size or cfg.model.vocab_size,
            out_dir=data_dir,
            command=["train.py", "(auto-prepare)"],
        )
    dist.barrier()
    meta = load_meta(data_dir)
    check_meta_types(meta, data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer of {data_dir} "
            f"({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']}"
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


def check_meta_types(meta: dict, data_dir: Path):
    """UserError naming the key of the dataset's meta.json that training reads and that has the wrong type."""
    wanted = {"vocab_size": int, "bytes_per_token": float}
    try:
        for key, kind in wanted.items():
            check_type(f"{data_dir}/meta.json {key}", meta.get(key), kind)
        for split in ("train", "val"):
            check_type(
                f"{data_dir}/meta.json splits.{split}.tokens",
                meta["splits"][split].get("tokens"),
                int,
            )
    except (KeyError, TypeError, AttributeError):
        raise UserError(
            f"{data_dir}/meta.json lacks its splits; prepare the dataset again with --force"
        ) from None


def check_sample_fits(cfg: Config, data_dir: Path):
    """UserError, before training, when the end-of-run sample (prompt and train.sample_tokens) exceeds the context."""
    t = cfg.train
    if not t.sample_tokens:
        return
    tokenizer = open_tokenizer(tokenizer_file(data_dir) or data_dir / "tokenizer.model")
    prompt = 1 + len(
        tokenizer.encode(t.sample_prompt)
    )  # BOS and the prompt, as generate.py encodes them
    problem = cfg.model.length_problem(prompt + t.sample_tokens)
    if problem:
        raise UserError(
            f"train.sample_tokens ({t.sample_tokens}) and the prompt ({prompt} tokens): {problem}; lower "
            "train.sample_tokens"
        )


def evaluate(model, cfg: Config, data_dir: Path, meta: dict, dist: Dist) -> dict:
    """Validation loss over the fixed first eval.batches batches, split over ranks; loss, perplexity, bits/byte."""
    batches = list(
        eval_batches(data_dir, "val", cfg.eval.batch_size, cfg.train.seq_len, cfg.eval.batches)
    )
    per_rank = math.ceil(len(batches) / dist.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    with torch.no_grad():
        for i in range(per_rank):
            index = i * dist.world_size + dist.rank
            x, y = batches[
                min(index, len(batches) - 1)
            ]  # ranks without a batch still join FSDP's collectives
            loss = model(x.to(dist.device), y.to(dist.device))
            if index < len(batches):
                totals += torch.stack(
                    [loss.double() * y.numel(), torch.tensor(y.numel(), device=dist.device)]
                )
    loss_sum, count = dist.all_reduce_sum(totals).tolist()
    loss = loss_sum / count
    bits_per_byte = loss / math.log(2) / meta["bytes_per_token"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700)), "val_bpb": bits_per_byte}


@dataclasses.dataclass
class DataSource:
    loader: object  # next_batch(), state_dict(), load_state_dict()
    validate: object  # model -> {"val_loss": ..., ...}
    probe_batches: list  # a few validation (x, y) batches, which a budget probe times
    tokenizer: Path | None  # the tokenizer saved with the model (None: the task has none)
    line: str  # what the data is


def data_source(cfg: Config, dist: Dist) -> DataSource:
    """The training batches and validation of data.task: a prepared dataset, or the synthetic retrieval task."""
    t = cfg.train
    d = cfg.data
    e = cfg.eval
    if d.task == "retrieval":
        task = RetrievalTask(d.retrieval_keys, d.retrieval_values, d.retrieval_pairs)
        batches = task.fixed_batches(e.batches, e.batch_size, t.seq_len)
        loader = RetrievalBatches(
            task, t.batch_size, t.seq_len, seed=t.seed, filler=d.retrieval_filler
        )
        line = f"data: retrieval task ({task.pairs} pairs of {task.keys} keys and {task.values} values)"
        return DataSource(
            loader,
            lambda model: retrieval_metrics(model, batches, dist.device),
            batches[:3],
            None,
            line,
        )
    data_dir, meta = prepare_data(cfg, dist)
    check_sample_fits(cfg, data_dir)
    loader = RandomBatches(
        data_dir, "train", t.batch_size, t.seq_len, seed=t.seed, **d.copy_options()
    )
    probe = list(eval_batches(data_dir, "val", e.batch_size, t.seq_len, min(3, e.batches)))
    line = f"data {data_dir} ({meta['splits']['train']['tokens']:,} train tokens)"
    validate = lambda model: evaluate(model, cfg, data_dir, meta, dist)  # noqa: E731
    tokenizer = tokenizer_file(data_dir) or data_dir / "tokenizer.model"
    return DataSource(loader, validate, probe, tokenizer, line)


VALIDATION_FORMATS = {
    "val_ppl": "perplexity {:.2f}",
    "val_bpb": "{:.4f} bits/byte",
    "val_acc": "accuracy {:.1%}",
}


def random_positions(batch: int, seq_len: int, k: int) -> torch.Tensor:
    """Randomized positions (Ruoss et al. 2023), (batch, seq_len) int64: each row a sorted random subset of seq_len
    distinct positions from [0, k·seq_len), drawn from torch's global generator (seeded, and checkpointed)."""
    return torch.rand(batch, k * seq_len).topk(seq_len, dim=1).indices.sort(dim=1).values


def loss_terms(model, x, y, positions, z_loss: float) -> dict[str, torch.Tensor]:
    """One micro-batch's loss terms, summed for the gradient: the mean cross-entropy ("loss"), and with z_loss > 0
    z_loss·mean(logsumexp(logits)²) ("z_loss"; PaLM's, which keeps the softmax normaliser near 1)."""
    kwargs = {} if positions is None else {"positions": positions}
    if not z_loss:
        return {"loss": model(x, y, **kwargs)}
    logits = model(x, **kwargs).float()
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    return {"loss": loss, "z_loss": z_loss * logits.logsumexp(-1).square().mean()}


def train_step(model, optimizer, x, y, lr: float, cfg: Config, dist: Dist, positions=None):
    """One optimizer step on this rank's rows (x, y, and positions if given) of the global batch, in
    train.grad_accum micro-steps.

    Returns (losses, grad_norm, applied): each loss term (loss_terms) averaged over micro-steps and the global
    gradient norm, all left on the device, and whether the update was applied: it is not when a loss or the gradient
    norm is NaN or infinite."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    accum = cfg.train.grad_accum
    losses = {}
    chunks = [None] * accum if positions is None else positions.chunk(accum)
    for micro, (xm, ym, pm) in enumerate(zip(x.chunk(accum), y.chunk(accum), chunks, strict=True)):
        if hasattr(
            model, "set_requires_gradient_sync"
        ):  # FSDP2's: reduce gradients on the last micro-step only
            model.set_requires_gradient_sync(micro == accum - 1)
        terms = loss_terms(model, xm, ym, pm, cfg.optim.z_loss)
        (sum(terms.values()) / accum).backward()
        for name, term in terms.items():
            losses[name] = losses.get(name, 0) + term.detach() / accum
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), cfg.optim.grad_clip or float("inf")
    )
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # The one host sync of every step (free on CPU, a short stall on GPU). The gradient norm is global already; the
    # loss is this rank's, so it joins through a sum over ranks: all ranks skip the update together.
    applied = bool(torch.isfinite(dist.all_reduce_sum(sum(losses.values()).clone()) + grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm, applied


def build_model(
    cfg: Config, dist: Dist, init: dict | None = None
) -> tuple[Transformer, torch.optim.Optimizer, str]:
    """The parallelized model (the same initial weights on any device and world size, or `init`'s), its optimizer,
    and a line saying how many parameters it has, how many rank 0 stores, and the precision."""
    if cfg.train.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    model = Transformer(cfg.model).to(
        dist.device
    )  # initialised on the CPU generator first: same weights anywhere
    if init is not None:
        model.load_state_dict(init)
    num_params = model.num_params()
    dtype = pick_dtype(cfg.train.dtype, dist.device)
    if dist.mesh is None and dtype != torch.float32:
        problem = f"train.dtype {cfg.train.dtype} on {dist.device.type}"
        raise UserError(f"{problem}: mixed precision needs FSDP2's process group; use float32")
    model = parallelize(model, cfg, dist.mesh, dtype)
    local_params = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    sizes = f"{num_params:,} parameters, {local_params:,} stored on rank 0 of {dist.world_size}"
    precision = "fp32" if dtype == torch.float32 else f"{str(dtype)[6:]} with fp32 master weights"
    return model, build_optimizer(model, cfg, dist.device), f"{sizes}; {precision}"


# What a run started from train.init_from may change: the context and the RoPE scaling (context extension).
CONTEXT_KEYS = (
    "max_seq_len",
    "rope_scaling",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
)


def init_from_weights(cfg: Config) -> dict | None:
    """The weights of the run directory train.init_from (None without one), after checking that its model equals
    model.* but for CONTEXT_KEYS and that it shares data.dir's tokenizer. A run that stretches the source's context
    gets model.rope_original_max_seq_len = that context, so that RoPE scaling and extrapolate stretch from it."""
    source_dir = cfg.train.init_from
    if source_dir is None:
        return None
    try:
        source, _ = load_model(source_dir)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    saved, wanted = source.args.to_dict(), cfg.model.to_dict()
    key = next((k for k in wanted if k not in CONTEXT_KEYS and saved[k] != wanted[k]), None)
    if key is not None:
        raise UserError(
            f"train.init_from {source_dir} has model.{key} = {saved[key]!r}, this run {wanted[key]!r}; "
            f"only model.{', model.'.join(CONTEXT_KEYS)} may change"
        )
    theirs, ours = tokenizer_file(source_dir), tokenizer_file(cfg.data.dir)
    if theirs and ours and not same_tokenizer(tokenizer_sha256(theirs), ours):
        raise UserError(f"train.init_from {source_dir} has another tokenizer than {cfg.data.dir}")
    original = source.args.original_seq_len
    if cfg.model.rope_original_max_seq_len is None and cfg.model.max_seq_len > original:
        cfg.model = dataclasses.replace(cfg.model, rope_original_max_seq_len=original)
    return source.state_dict()


def seed_everything(seed: int):
    """Seed Python's, numpy's and torch's global generators (a resumed run then restores their states)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def budget_probe(cfg: Config, start: Path | None, started: float) -> BudgetProbe | None:
    """For a train.max_minutes run, set train.max_steps: unbounded while a new run's probe (returned) times its first
    steps, or the step count its checkpoint recorded when resuming. None when there is nothing to probe."""
    t = cfg.train
    if not t.max_minutes:
        return None
    if start is not None:
        t.max_steps = recorded_max_steps(start)
        return None
    t.max_steps = sys.maxsize  # until the probe has sized the run
    return BudgetProbe(cfg, started)


def next_rows(loader, cfg: Config, rows: slice, device: torch.device):
    """(x, y, positions): this rank's rows of the next global batch, and of its random positions (None when
    train.random_positions is off), on the device."""
    t = cfg.train
    x, y = (batch[rows].to(device) for batch in loader.next_batch())
    positions = None
    if (
        t.random_positions
    ):  # drawn for the global batch, as the data is: the same on any number of ranks
        positions = random_positions(t.batch_size, t.seq_len, t.random_positions)[rows].to(device)
    return x, y, positions


def log_step(
    log: RunLog,
    step: int,
    lr: float,
    losses: dict,
    grad_norm: torch.Tensor,
    clock: Throughput,
    dist,
):
    """Record the step's losses (averaged over ranks), learning rate, gradient norm, speed and memory."""
    entry = {
        "step": step,
        **{name: dist.mean(value) for name, value in losses.items()},
        "lr": lr,
        "grad_norm": grad_norm.item(),
        **clock.rates(),
        "mem_gb": memory_gb(dist.device),
    }
    log.record(entry)
    log.bar.set_postfix(
        loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:,.0f}", lr=f"{lr:.2e}"
    )


def validate(model, data: DataSource, log: RunLog, step: int, run_dir: Path):
    """Evaluate, record and say the validation metrics; stop the run if the loss is not finite."""
    result = data.validate(model)
    log.record({"step": step, **result})
    if not math.isfinite(result["val_loss"]):
        raise stopped(f"the validation loss is {result['val_loss']} at step {step}", run_dir)
    parts = [f.format(result[k]) for k, f in VALIDATION_FORMATS.items() if k in result]
    log.say(f"step {step}: val loss {result['val_loss']:.4f}, " + ", ".join(parts))


def save(model, optimizer, data: DataSource, cfg: Config, dist: Dist, log: RunLog, step: int):
    """Save the resumable checkpoint and the run directory's model export, with the run's settings and tokenizer."""
    run_dir = Path(cfg.train.out_dir)
    settings = {
        k: v for k, v in cfg.to_dict().items() if k != "model"
    }  # the model's own go beside them
    keep = cfg.checkpoint.keep
    save_checkpoint(
        run_dir, step, model, optimizer, data.loader, dist, settings, data.tokenizer, keep
    )
    log.say(f"step {step}: saved checkpoint {checkpoints(run_dir)[-1]}")


def train(cfg: Config, resume: bool, dist: Dist, started: float):
    """Train cfg from scratch or from the latest checkpoint in train.out_dir, logging, evaluating and saving."""
    t = cfg.train
    run_dir = Path(t.out_dir)
    init = init_from_weights(cfg)  # before resume_point, which checks the model it may adjust
    start = resume_point(run_dir, cfg.model, resume, cfg.to_dict())
    data = data_source(cfg, dist)
    if start is not None and data.tokenizer is not None:
        check_tokenizer(start, data.tokenizer)
    seed_everything(t.seed)
    model, optimizer, sizes = build_model(
        cfg, dist, None if start else init
    )  # a resumed run loads its checkpoint
    step = 0 if start is None else load_checkpoint(start, model, optimizer, data.loader, dist)
    probe = budget_probe(cfg, start, started)
    log = RunLog(cfg, run_dir, step, None if probe else t.max_steps, dist.main)
    log.say(
        f"model: {sizes}; {data.line}; device {dist.device}"
        + (f"; resuming at step {step}" if start else "")
    )
    peak = peak_flops(dist.device, t.peak_tflops)
    peak = peak * dist.world_size if peak else None
    clock = Throughput(
        t.batch_size * t.seq_len, flops_per_token(model, t.seq_len), peak, dist.device
    )
    # Every rank draws the same global batch and keeps its rows, so the data never depends on the world size.
    rows = slice(
        dist.rank * t.batch_size // dist.world_size,
        (dist.rank + 1) * t.batch_size // dist.world_size,
    )
    while step < t.max_steps:
        lr = lr_at(step, cfg)
        x, y, positions = next_rows(data.loader, cfg, rows, dist.device)
        losses, grad_norm, applied = train_step(model, optimizer, x, y, lr, cfg, dist, positions)
        if not applied:  # a NaN or infinity: every rank skipped the update; stop, naming the last good checkpoint
            problem = f"the loss is {dist.mean(losses['loss'])} (gradient norm {grad_norm.item()}) at step {step + 1}"
            raise stopped(f"{problem}; training stopped before applying that update", run_dir)
        step += 1
        clock.steps += 1
        log.bar.update()
        if probe is not None and probe.step_done():
            # A train.max_minutes run now knows its step time: it chooses its length, once, the same on every
            # rank. The probe's evaluation is not training time.
            with clock.paused():
                t.max_steps, line = probe.max_steps(model, data.probe_batches, dist)
            probe = None
            log.sized(step, t.max_steps, line)
        if due(step, t.log_interval, t.max_steps):
            log_step(log, step, lr, losses, grad_norm, clock, dist)
        evaluating = due(step, cfg.eval.interval, t.max_steps)
        saving = due(step, cfg.checkpoint.interval, t.max_steps)
        if evaluating or saving:
            with clock.paused():  # tokens/s and MFU count training time alone
                if evaluating:
                    validate(model, data, log, step, run_dir)
                if saving:
                    save(model, optimizer, data, cfg, dist, log, step)
    log.close()


def print_sample(cfg: Config, device: torch.device):
    """A sample from the saved run, by generate.py in a process of its own (no script imports another)."""
    t = cfg.train
    flags = f"--checkpoint {t.out_dir} --max-new-tokens {t.sample_tokens} --top-k 200 --seed {t.seed}".split()
    prompt = ["--prompt", t.sample_prompt] if t.sample_prompt else []
    command = [
        sys.executable,
        str(REPO_ROOT / "generate.py"),
        *flags,
        "--device",
        device.type,
        *prompt,
    ]
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
        problem = (
            errors[-1].removeprefix("error: ") if errors else f"exit status {result.returncode}"
        )
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
    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    run_dir = Path(cfg.train.out_dir)
    check_writable(
        run_dir, inputs=[cfg.data.dir], directory=True
    )  # before any work; never in the dataset
    if cfg.train.compile:
        check_compiler()
    keep_freed_memory()
    # one writer per run directory: rank 0 holds the lock for the whole job
    with exclusive(run_dir) if os.environ.get("RANK", "0") == "0" else nullcontext():
        dist = Dist(cfg.train.device)
        try:
            train(cfg, resume, dist, started)
        except BaseException as e:
            traceback.clear_frames(
                e.__traceback__
            )  # the failed frames' model and optimizer must go before close()
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
