"""Train picollama in one process or under torchrun with FSDP2:
python train.py [--config F.toml] [--section.key=value ...] [--resume]."""

import gc
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm

from checkpoint import checkpoints, load_checkpoint, resume_point, save_checkpoint
from cli import UserError, run_command
from config import Config, check_config, parse_cli
from data.loader import RandomBatches, eval_batches, load_meta
from data.prepare import prepare
from device import peak_flops, pick_device, pick_dtype
from model import Transformer

REPO_ROOT = Path(__file__).resolve().parent


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
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:  # torchrun's
            torch_dist.init_process_group(backend)
        else:
            torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        torch_dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        torch_dist.all_reduce(tensor)
        return tensor

    def mean(self, scalar: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor, as a Python number (a host sync)."""
        return self.all_reduce_sum(scalar).item() / self.world_size

    def close(self):
        """Destroy the process group once nothing references the model and optimizer (pytorch#190489: gloo can abort
        at exit otherwise): drop the mesh, collect the freed FSDP modules, then destroy."""
        self.mesh = None
        gc.collect()
        if torch_dist.is_initialized():
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
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_optimizer(model, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, fused where the device supports it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=device.type in ("cuda", "cpu"))


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at max_steps (step counts from 0)."""
    o, total = cfg.optim, cfg.train.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def due(step: int, interval: int, last: int) -> bool:
    """Whether something done every `interval` steps (0: never) and after the last step is due after `step`."""
    return step == last or (interval > 0 and step % interval == 0)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class Throughput:
    """Tokens/s and MFU over training time alone: the clock stops while evaluating and checkpointing."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None, device: torch.device):
        """peak: the FLOP/s of all devices together, None if unknown."""
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.device = device
        self.steps, self.seconds, self.since = 0, 0.0, time.perf_counter()

    @contextmanager
    def paused(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps' queued GPU work is training time
        self.seconds += time.perf_counter() - self.since
        yield
        self.since = time.perf_counter()

    def rates(self) -> dict:
        """tokens_per_s (and mfu when the peak is known) of the steps since the last call."""
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * self.steps / (self.seconds + now - self.since)
        self.steps, self.seconds, self.since = 0, 0.0, now
        mfu = {"mfu": self.flops_per_token * tokens_per_s / self.peak} if self.peak else {}
        return {"tokens_per_s": tokens_per_s, **mfu}


def logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a line cut short by a crash."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class RunLog:
    """What rank 0 reports: metrics.jsonl (a resumed run first drops the steps it will redo), wandb, a progress bar."""

    def __init__(self, cfg: Config, run_dir: Path, step: int, main: bool):
        self.main, self.path, self.wandb = main, run_dir / "metrics.jsonl", None
        self.bar = tqdm(total=cfg.train.max_steps, initial=step, desc="training", unit="step", disable=not main or None)
        if not main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text().splitlines() if step and self.path.is_file() else []
        self.path.write_text("".join(line + "\n" for line in lines if logged_step(line) <= step))
        if cfg.wandb.enabled:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb.project, name=cfg.wandb.run_name or run_dir.name, config=cfg.to_dict()
            )

    def record(self, entry: dict):
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def say(self, text: str):
        if self.main:
            self.bar.write(text, file=sys.stdout)

    def close(self):
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


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
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer of {data_dir} "
            f"({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']}"
        )
    for split in ("train", "val"):
        tokens = meta["splits"][split]["tokens"]
        if tokens < cfg.train.seq_len + 1:
            raise UserError(
                f"the {split} split of {data_dir} has {tokens} tokens, too few for train.seq_len "
                f"{cfg.train.seq_len}; lower train.seq_len or use more text"
            )
    return data_dir, meta


def evaluate(model, cfg: Config, data_dir: Path, meta: dict, dist: Dist) -> dict:
    """Validation loss over the fixed first eval.batches batches, split over ranks; loss, perplexity, bits/byte."""
    batches = list(eval_batches(data_dir, "val", cfg.eval.batch_size, cfg.train.seq_len, cfg.eval.batches))
    per_rank = math.ceil(len(batches) / dist.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    with torch.no_grad():
        for i in range(per_rank):
            index = i * dist.world_size + dist.rank
            x, y = batches[min(index, len(batches) - 1)]  # ranks without a batch still join FSDP's collectives
            loss = model(x.to(dist.device), y.to(dist.device))
            if index < len(batches):
                totals += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), device=dist.device)])
    loss_sum, count = dist.all_reduce_sum(totals).tolist()
    loss = loss_sum / count
    bits_per_byte = loss / math.log(2) / meta["bytes_per_token"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700)), "val_bpb": bits_per_byte}


def train_step(model, optimizer, x, y, lr: float, cfg: Config, dist: Dist):
    """One optimizer step on this rank's rows (x, y) of the global batch, in train.grad_accum micro-steps.

    Returns (loss, grad_norm, applied): the loss summed over micro-steps and the global gradient norm, both left on
    the device, and whether the update was applied: it is not when the gradient norm is NaN or infinite."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    accum = cfg.train.grad_accum
    loss_sum = torch.zeros((), device=dist.device)
    for micro, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
        model.set_requires_gradient_sync(micro == accum - 1)
        loss = model(xm, ym) / accum
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # The one host sync of every step (free on CPU, a short stall on GPU). A NaN or infinite loss on any rank makes
    # the global gradient norm non-finite on every rank, so all ranks skip the update together.
    applied = bool(torch.isfinite(grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, applied


def build_model(cfg: Config, dist: Dist) -> tuple[Transformer, torch.optim.AdamW, str]:
    """The parallelized model (the same initial weights on any device and world size), its optimizer, and a line
    saying how many parameters it has, how many rank 0 stores, and the precision."""
    if cfg.train.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    model = Transformer(cfg.model).to(dist.device)  # initialised on the CPU generator first: same weights anywhere
    num_params = model.num_params()
    dtype = pick_dtype(cfg.train.dtype, dist.device)
    model = parallelize(model, cfg, dist.mesh, dtype)
    local_params = sum(p.to_local().numel() for p in model.parameters())
    sizes = f"{num_params:,} parameters, {local_params:,} stored on rank 0 of {dist.world_size}"
    precision = "fp32" if dtype == torch.float32 else f"{str(dtype)[6:]} with fp32 master weights"
    return model, build_optimizer(model, cfg, dist.device), f"{sizes}; {precision}"


def diverged(loss: float, grad_norm: float, step: int, run_dir: Path) -> UserError:
    """The error that stops a run whose loss or gradients are no longer finite."""
    last = checkpoints(run_dir)
    resume = f"The last good checkpoint is {last[-1]} (--resume continues it); " if last else ""
    return UserError(
        f"the loss is {loss} (gradient norm {grad_norm}) at step {step}; training stopped before "
        f"applying that update. {resume}try a lower optim.lr or a smaller model"
    )


def train(cfg: Config, resume: bool, dist: Dist):
    """Train cfg from scratch or from the latest checkpoint in train.out_dir, logging, evaluating and saving."""
    t = cfg.train
    run_dir = Path(t.out_dir)
    start = resume_point(run_dir, cfg.model, resume)
    data_dir, meta = prepare_data(cfg, dist)
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    # Every rank draws the same global batch and keeps its rows, so the data never depends on the world size.
    loader = RandomBatches(data_dir, "train", t.batch_size, t.seq_len, seed=t.seed)
    rows = slice(dist.rank * t.batch_size // dist.world_size, (dist.rank + 1) * t.batch_size // dist.world_size)
    model, optimizer, sizes = build_model(cfg, dist)
    step = 0 if start is None else load_checkpoint(start, model, optimizer, loader, dist)
    log = RunLog(cfg, run_dir, step, dist.main)
    log.say(
        f"model: {sizes}; data {data_dir} ({meta['splits']['train']['tokens']:,} train tokens); "
        f"device {dist.device}" + (f"; resuming at step {step}" if start else "")
    )
    peak = peak_flops(dist.device, t.peak_tflops)
    peak = peak * dist.world_size if peak else None
    clock = Throughput(t.batch_size * t.seq_len, model.flops_per_token(t.seq_len), peak, dist.device)
    export_config = {k: v for k, v in cfg.to_dict().items() if k != "model"}  # config.json's, beside the model's
    keep = cfg.checkpoint.keep
    while step < t.max_steps:
        lr = lr_at(step, cfg)
        x, y = (batch[rows].to(dist.device) for batch in loader.next_batch())
        loss_sum, grad_norm, applied = train_step(model, optimizer, x, y, lr, cfg, dist)
        if not applied:
            raise diverged(dist.mean(loss_sum), grad_norm.item(), step + 1, run_dir)
        step += 1
        clock.steps += 1
        log.bar.update()
        if due(step, t.log_interval, t.max_steps):
            entry = {
                "step": step,
                "loss": dist.mean(loss_sum),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                **clock.rates(),
                "mem_gb": memory_gb(dist.device),
            }
            log.record(entry)
            log.bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:,.0f}", lr=f"{lr:.2e}")
        evaluating, saving = due(step, cfg.eval.interval, t.max_steps), due(step, cfg.checkpoint.interval, t.max_steps)
        if evaluating or saving:
            with clock.paused():
                if evaluating:
                    result = evaluate(model, cfg, data_dir, meta, dist)
                    log.record({"step": step, **result})
                    log.say(
                        f"step {step}: val loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}, "
                        f"{result['val_bpb']:.4f} bits/byte"
                    )
                if saving:
                    tokenizer = data_dir / "tokenizer.model"
                    save_checkpoint(run_dir, step, model, optimizer, loader, dist, export_config, tokenizer, keep)
                    log.say(f"step {step}: saved checkpoint {checkpoints(run_dir)[-1]}")
    log.close()


def print_sample(cfg: Config, device: torch.device):
    """A sample from the saved run, by generate.py in a process of its own (no script imports another)."""
    t = cfg.train
    flags = f"--checkpoint {t.out_dir} --max-new-tokens {t.sample_tokens} --top-k 200 --seed {t.seed}".split()
    prompt = ["--prompt", t.sample_prompt] if t.sample_prompt else []
    command = [sys.executable, str(REPO_ROOT / "generate.py"), *flags, "--device", device.type, *prompt]
    print("---- sample ----", flush=True)
    status = subprocess.run(command).returncode
    print("----------------")
    if status:
        raise UserError(f"generate.py could not sample from {t.out_dir} (exit status {status}); the run is complete")


def main(argv: list[str]) -> int:
    cfg, resume = parse_cli(argv, __doc__)
    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    dist = Dist(cfg.train.device)
    try:
        train(cfg, resume, dist)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # the failed frames' model and optimizer must go before close()
        raise
    finally:
        dist.close()
    if dist.main:
        if cfg.train.sample_tokens:
            print_sample(cfg, dist.device)
        run_dir = Path(cfg.train.out_dir)
        print(
            f"done: the model is in {run_dir} (model.safetensors, config.json, tokenizer.model); metrics in "
            f"{run_dir / 'metrics.jsonl'}; resumable state in {run_dir / 'train_state'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
