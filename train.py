"""Train picollama in one process or under torchrun with FSDP2: python train.py [--config F.toml] [--section.key=value ...] [--resume]."""
import argparse
import difflib
import gc
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time
import tomllib
import types
import typing
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data import DataError
from data.loader import RandomBatches, eval_batches, load_meta
from model import ModelArgs, Transformer

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.toml"
# Dense bf16 tensor-core peaks (TFLOP/s) by device-name substring; the first match wins.
GPU_BF16_PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
    ("A10G", 70.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
)


class UserError(Exception):
    """A problem the user fixes by changing the command, config, data or run directory; printed as one line."""


@dataclass
class DataConfig:
    dir: str = "data/shakespeare"  # a prepared dataset (data/prepare.py); prepared from `source` if missing
    source: str = "shakespeare"  # shakespeare | PATH | hf:NAME, as for data/prepare.py --source
    vocab_size: int | None = None  # tokenizer size when preparing; None: model.vocab_size


@dataclass
class TrainConfig:
    out_dir: str = "out/default"  # the run directory
    max_steps: int = 1000
    batch_size: int = 16  # sequences per optimizer step, over all ranks and micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step
    seq_len: int = 256
    seed: int = 1337
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    compile: bool = False  # torch.compile each block
    activation_checkpointing: bool = False
    log_interval: int = 10
    peak_tflops: float | None = None  # per device, for MFU; None: the GPU table (nothing on CPU)
    sample_tokens: int = 200  # a sample printed at the end (0: none)
    sample_prompt: str = ""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4  # the cosine decays to this at max_steps
    warmup_steps: int = 100
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0: no clipping


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


# ---------------------------------------------------------------- configuration


def section_types() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in fields(Config)}


def field_types(cls) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def unknown_key_error(key: str, valid: list[str]) -> UserError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(valid)})"
    return UserError(f"unknown config key {key}{hint}")


def check_value(key: str, value, annotation):
    """value converted to the field's type (int → float is allowed), or UserError naming the key."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None and type(None) in options:
        return None
    base = next(t for t in options if t is not type(None))
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    wanted = base.__name__ + (" or none" if type(None) in options else "")
    raise UserError(f"config key {key} must be {wanted}, not {type(value).__name__} {value!r}")


def parse_override(key: str, text: str, annotation):
    """A command-line string parsed per the field's type."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    base = next(t for t in options if t is not type(None))
    try:
        if base is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        return base(text)
    except (KeyError, ValueError):
        wanted = base.__name__ + (" or none" if type(None) in options else "")
        raise UserError(f"--{key}: expected {wanted}, got {text!r}") from None


def build_config(raw: dict, overrides: list[tuple[str, str]]) -> Config:
    """A Config from TOML sections plus (section.key, string) overrides; UserError names any bad key or value."""
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
            values[name][key] = check_value(f"{name}.{key}", value, types_[key])
    all_keys = [f"{name}.{k}" for name, cls in sections.items() for k in field_types(cls)]
    for dotted, text in overrides:
        name, _, key = dotted.partition(".")
        if name not in sections or key not in field_types(sections[name]):
            raise unknown_key_error(dotted, all_keys)
        values[name][key] = parse_override(dotted, text, field_types(sections[name])[key])
    built = {}
    for name, cls in sections.items():
        try:
            built[name] = cls(**values[name])
        except ValueError as e:
            raise UserError(f"[{name}] {e}") from None
    return Config(**built)


def parse_cli(argv: list[str]) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(
        prog="train.py", description=__doc__,
        epilog="Any config key can be overridden as --section.key=value (sections: "
        + ", ".join(section_types()) + "), e.g. --train.max_steps=200 --model.dim=128.",
    )
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a TOML config (default configs/default.toml)")
    parser.add_argument("--resume", action="store_true", help="continue the latest checkpoint in train.out_dir")
    args, rest = parser.parse_known_args(argv)
    overrides, i = [], 0
    while i < len(rest):
        match = re.fullmatch(r"--([A-Za-z_]\w*\.\w+)(?:=(.*))?", rest[i], re.S)
        if not match:
            raise UserError(f"unexpected argument {rest[i]!r}; overrides look like --section.key=value")
        if match[2] is None:
            if i + 1 >= len(rest):
                raise UserError(f"--{match[1]} needs a value")
            overrides.append((match[1], rest[i + 1]))
            i += 2
        else:
            overrides.append((match[1], match[2]))
            i += 1
    try:
        raw = tomllib.loads(Path(args.config).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read config {args.config}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{args.config} is not valid TOML: {e}") from None
    return build_config(raw, overrides), args.resume


def check_config(cfg: Config, world_size: int) -> None:
    """Refuse, before any work, configs whose batch or context does not fit."""
    t, m = cfg.train, cfg.model
    if min(t.max_steps, t.batch_size, t.grad_accum, t.seq_len, t.log_interval, cfg.eval.batches, cfg.eval.batch_size) < 1:
        raise UserError("train.max_steps, batch_size, grad_accum, seq_len, log_interval and eval.batches, "
                        "eval.batch_size must be positive")
    if t.batch_size % (t.grad_accum * world_size):
        raise UserError(f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum × ranks "
                        f"({t.grad_accum} × {world_size}); change batch_size or grad_accum")
    if t.seq_len > m.max_seq_len:
        raise UserError(f"train.seq_len ({t.seq_len}) exceeds the model's context model.max_seq_len ({m.max_seq_len}); "
                        "lower train.seq_len or raise model.max_seq_len")
    if cfg.checkpoint.keep < 1:
        raise UserError("checkpoint.keep must be at least 1")
    if t.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"train.device must be auto, cpu or cuda, not {t.device!r}")
    if cfg.optim.warmup_steps < 0 or cfg.optim.lr <= 0 or cfg.optim.min_lr < 0:
        raise UserError("optim.lr must be positive, optim.min_lr and optim.warmup_steps not negative")


def check_data(cfg: Config, data_dir: Path) -> dict:
    """The dataset's meta.json, after checking its vocabulary and size against the config."""
    meta = load_meta(data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise UserError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer of {data_dir} "
                        f"({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']}")
    for split in ("train", "val"):
        tokens = meta["splits"][split]["tokens"]
        if tokens < cfg.train.seq_len + 1:
            raise UserError(f"the {split} split of {data_dir} has {tokens} tokens, too few for train.seq_len "
                            f"{cfg.train.seq_len}; lower train.seq_len or use more text")
    return meta


# ---------------------------------------------------------------- model, parallelism, optimizer


def parallelize(model: Transformer, cfg: Config, mesh) -> Transformer:
    """Activation checkpointing, torch.compile and FSDP2 (when mesh is given) on the plain model, per block."""
    if cfg.train.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()  # in place: parameter names keep no _orig_mod. prefix
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        on_gpu = mesh.device_type == "cuda"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else None
        kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def build_optimizer(model, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, fused where the device supports it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=device.type in ("cuda", "cpu"))


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at max_steps (step counts from 0)."""
    o, total = cfg.optim, cfg.train.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def peak_flops(device: torch.device, cfg: Config) -> float | None:
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in GPU_BF16_PEAK_TFLOPS if key in name), None)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


# ---------------------------------------------------------------- checkpoints


class Dist:
    """Rank, world size, device mesh and the collectives this script needs; trivial without a process group."""

    def __init__(self, device_pref: str):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device_pref == "cuda" or device_pref == "auto" and torch.cuda.is_available()
        if device_pref == "cuda" and not torch.cuda.is_available():
            raise UserError("train.device is cuda but no CUDA device is available; use --train.device=cpu")
        self.device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
        self.mesh = None
        if self.world_size > 1:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            if use_cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if use_cuda else "gloo")
            self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.mesh is not None:
            torch.distributed.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            torch.distributed.all_reduce(tensor)
        return tensor

    def close(self):
        """Drop the mesh and collect freed FSDP modules before destroying the group: gloo can abort at exit otherwise."""
        self.mesh = None
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


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


def checkpoints(run_dir: Path) -> list[Path]:
    """Finished train_state/step_* directories, oldest first (unfinished *.tmp ones are ignored)."""
    state_dir = run_dir / "train_state"
    found = [p for p in state_dir.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(run_dir: Path, step: int, model, optimizer, loader, cfg: Config, dist: Dist):
    """train_state/step_N (DCP model+optimizer, per-rank RNG/loader state) and the exported model, all atomically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from convert import model_from_state_dict, save_model

    state_dir = run_dir / "train_state"
    final, tmp = state_dir / f"step_{step:06d}", state_dir / f"step_{step:06d}.tmp"
    if dist.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    extra = {"step": step, "loader": loader.state_dict(), "rng": rng_state(dist.device)}
    (tmp / f"rank{dist.rank}.json").write_text(json.dumps(extra))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    exported = None
    if dist.main:
        meta = {"step": step, "world_size": dist.world_size, "model": cfg.model.to_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    dist.barrier()
    if dist.main:
        os.replace(tmp, final)
        export_tmp = run_dir / ".export.tmp"
        shutil.rmtree(export_tmp, ignore_errors=True)
        exported = model_from_state_dict(cfg.model, {k: v.float() for k, v in full.items()})
        training_config = {k: v for k, v in cfg.to_dict().items() if k != "model"}
        save_model(exported, export_tmp, config=training_config, tokenizer=Path(cfg.data.dir) / "tokenizer.model")
        for name in ("model.safetensors", "config.json", "tokenizer.model"):
            os.replace(export_tmp / name, run_dir / name)
        export_tmp.rmdir()
        for old in checkpoints(run_dir)[: -cfg.checkpoint.keep]:
            shutil.rmtree(old)
        for stale in state_dir.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return exported


def load_checkpoint(path: Path, model, optimizer, loader, cfg: Config, dist: Dist) -> int:
    """Restore a checkpoint written by save_checkpoint (any world size); returns its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def resume_point(run_dir: Path, cfg: Config, resume: bool) -> Path | None:
    """The checkpoint to continue from, after checking it matches the config; None for a fresh run."""
    found = checkpoints(run_dir)
    if not resume:
        if found:
            raise UserError(f"{run_dir} already holds a run (checkpoint {found[-1].name}); pass --resume to continue "
                            "it, or choose another train.out_dir")
        return None
    if not found:
        raise UserError(f"nothing to resume: {run_dir / 'train_state'} holds no checkpoint; run without --resume")
    latest = found[-1]
    try:
        meta = json.loads((latest / "meta.json").read_text())
        saved = meta["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"cannot resume from {latest}: meta.json is missing or corrupt") from None
    differences = [f"model.{k} {saved.get(k)!r} → {v!r}" for k, v in cfg.model.to_dict().items() if saved.get(k) != v]
    if differences:
        raise UserError(f"cannot resume from {latest}: it was trained with a different model ({', '.join(differences)})")
    return latest


# ---------------------------------------------------------------- training


def evaluate(model, cfg: Config, data_dir: Path, meta: dict, dist: Dist, autocast) -> dict:
    """Validation loss over the fixed first eval.batches batches, split over ranks; loss, perplexity, bits/byte."""
    batches = list(eval_batches(data_dir, "val", cfg.eval.batch_size, cfg.train.seq_len, cfg.eval.batches))
    per_rank = math.ceil(len(batches) / dist.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    with torch.no_grad():
        for i in range(per_rank):
            index = i * dist.world_size + dist.rank
            x, y = batches[min(index, len(batches) - 1)]  # ranks without a batch still join FSDP's collectives
            with autocast:
                loss = model(x.to(dist.device), y.to(dist.device))
            if index < len(batches):
                totals += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), device=dist.device)])
    loss_sum, count = dist.all_reduce_sum(totals).tolist()
    loss = loss_sum / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700)), "val_bpb": loss / math.log(2) / meta["bytes_per_token"]}


def ensure_dataset(cfg: Config, dist: Dist) -> Path:
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").is_file() and dist.main:
        from data.prepare import prepare

        print(f"{data_dir} is not prepared yet: preparing it from {cfg.data.source}")
        prepare(cfg.data.source, cfg.data.vocab_size or cfg.model.vocab_size, out_dir=data_dir,
                command=["train.py", "(auto-prepare)"])
    dist.barrier()
    return data_dir


def print_sample(model: Transformer, cfg: Config, data_dir: Path, meta: dict):
    import sentencepiece as spm

    from generate import generate

    tokenizer = spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer.model"))
    prompt = [meta["bos_id"], *tokenizer.encode(cfg.train.sample_prompt)]
    new = generate(model.to(torch.device("cpu")), [prompt], cfg.train.sample_tokens, temperature=0.8, top_k=200,
                   eos_id=meta.get("eos_id"), seed=cfg.train.seed)[0]
    print("---- sample ----")
    print(tokenizer.decode(prompt[1:] + new))
    print("----------------")


def logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; inf for a line cut short by a crash."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def train(cfg: Config, resume: bool, dist: Dist):
    t = cfg.train
    run_dir = Path(t.out_dir)
    start = resume_point(run_dir, cfg, resume)
    data_dir = ensure_dataset(cfg, dist)
    meta = check_data(cfg, data_dir)
    if t.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".cache" / "inductor"))
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    # Every rank draws the same global batch and keeps its rows, so the data never depends on the world size.
    per_rank = t.batch_size // dist.world_size
    loader = RandomBatches(data_dir, "train", t.batch_size, t.seq_len, seed=t.seed)
    model = Transformer(cfg.model).to(dist.device)  # initialised on the CPU generator first: same weights anywhere
    num_params = model.num_params()
    model = parallelize(model, cfg, dist.mesh)
    local_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg, dist.device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dist.device.type == "cuda" and dist.mesh is None
                else nullcontext())
    step = 0
    if start is not None:
        step = load_checkpoint(start, model, optimizer, loader, cfg, dist)
    log = print if dist.main else (lambda *a, **k: None)
    log(f"model: {num_params:,} parameters, {local_params:,} stored on rank 0 of {dist.world_size}; "
        f"data {data_dir} ({meta['splits']['train']['tokens']:,} train tokens); device {dist.device}"
        + (f"; resuming at step {step}" if start else ""))
    metrics_path = run_dir / "metrics.jsonl"
    wandb_run = None
    if dist.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        kept = [line for line in metrics_path.read_text().splitlines() if logged_step(line) <= step] \
            if start and metrics_path.is_file() else []
        metrics_path.write_text("".join(line + "\n" for line in kept))  # drop steps the resumed run will redo
        if cfg.wandb.enabled:
            import wandb

            wandb_run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.run_name or run_dir.name,
                                   config=cfg.to_dict())

    def record(entry: dict):
        if dist.main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
            if wandb_run is not None:
                wandb_run.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    flops_per_token, peak = model.flops_per_token(t.seq_len), peak_flops(dist.device, cfg)
    tokens_per_step = t.batch_size * t.seq_len
    exported, interval_start, interval_steps = None, time.perf_counter(), 0
    bar = tqdm(total=t.max_steps, initial=step, desc="training", unit="step", disable=not dist.main or None)
    while step < t.max_steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = loader.next_batch()
        rows = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
        x, y = x[rows].to(dist.device), y[rows].to(dist.device)
        loss_sum = torch.zeros((), device=dist.device)
        for micro, (xm, ym) in enumerate(zip(x.chunk(t.grad_accum), y.chunk(t.grad_accum))):
            if dist.mesh is not None:
                model.set_requires_gradient_sync(micro == t.grad_accum - 1)
            with autocast:
                loss = model(xm, ym) / t.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        loss_value = dist.all_reduce_sum(loss_sum).item() / dist.world_size
        if not math.isfinite(loss_value):
            last = checkpoints(run_dir)
            raise UserError(f"the loss is {loss_value} at step {step + 1}; training stopped. "
                            + (f"The last good checkpoint is {last[-1]} (--resume continues it); " if last else "")
                            + "try a lower optim.lr or a smaller model")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        interval_steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}")
        if step % t.log_interval == 0 or step == t.max_steps:
            elapsed = time.perf_counter() - interval_start
            tokens_per_s = tokens_per_step * interval_steps / elapsed
            entry = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                     "tokens_per_s": tokens_per_s, "mem_gb": memory_gb(dist.device)}
            if peak:
                entry["mfu"] = flops_per_token * tokens_per_s / (peak * dist.world_size)
            record(entry)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}")
            interval_start, interval_steps = time.perf_counter(), 0
        if cfg.eval.interval and step % cfg.eval.interval == 0 or step == t.max_steps:
            result = evaluate(model, cfg, data_dir, meta, dist, autocast)
            record({"step": step, **result})
            if dist.main:
                bar.write(f"step {step}: val loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}, "
                          f"{result['val_bpb']:.4f} bits/byte", file=sys.stdout)
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 or step == t.max_steps:
            exported = save_checkpoint(run_dir, step, model, optimizer, loader, cfg, dist)
            if dist.main:
                bar.write(f"step {step}: saved checkpoint {run_dir / 'train_state' / f'step_{step:06d}'}",
                          file=sys.stdout)
            interval_start = time.perf_counter()  # saving and evaluating are not training time
        elif cfg.eval.interval and step % cfg.eval.interval == 0:
            interval_start = time.perf_counter()
    bar.close()
    if wandb_run is not None:
        wandb_run.finish()
    if dist.main and exported is not None and t.sample_tokens > 0:
        print_sample(exported, cfg, data_dir, meta)
    if dist.main:
        print(f"done: the model is in {run_dir} (model.safetensors, config.json, tokenizer.model); "
              f"metrics in {metrics_path}; resumable state in {run_dir / 'train_state'}")


def main(argv=None) -> int:
    rank, dist = int(os.environ.get("RANK", "0")), None
    try:
        cfg, resume = parse_cli(sys.argv[1:] if argv is None else argv)
        check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        dist = Dist(cfg.train.device)
        train(cfg, resume, dist)  # returns only after its model and optimizer are unreferenced
    except (UserError, DataError) as e:
        if rank == 0:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print("error: interrupted; the last checkpoint in train.out_dir is intact (--resume continues it)",
                  file=sys.stderr)
        return 130
    finally:
        if dist is not None:
            dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
