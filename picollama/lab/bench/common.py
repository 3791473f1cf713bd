"""What the benchmarks share: flags, configs, our model and the same HF Llama, timing, JSON.

By default, results go to docs/results/NAME.json."""

import contextlib
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

import torch

from model import ModelArgs, Transformer
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.flags import ArgumentParser, add_device, add_out, comma_list, positive
from picollama.cli.outputs import atomic_output, check_own_result, check_writable, exclusive
from picollama.cli.user_files import read_small_text
from picollama.config.model_args import model_args_from_dict
from picollama.convert.hf import hf_config, to_hf_state_dict
from picollama.device import cpu_has_bf16, peak_flops, pick_device, pick_dtype

RESULTS_DIR = REPO_ROOT / "docs" / "results"
# --smoke's model, as model_args("smoke") gives it.
SMOKE = dict(dim=64, n_layers=2, n_heads=4, max_seq_len=32, vocab_size=128)
HOLDERS = []  # Lock holders (ExitStack) of the running one_writer mains, the latest last.


def parser(description: str, script: str, models: bool = True) -> ArgumentParser:
    """The flags of every benchmark; models=True adds the model benchmarks' --device/--threads."""
    p = ArgumentParser(description=description)
    if models:
        add_device(p)
        p.add_argument(
            "--threads", type=positive(), help="torch CPU threads (default: torch's choice)"
        )
    p.add_argument(
        "--smoke", action="store_true", help="a tiny, seconds-long run to check the script works"
    )
    add_out(
        p, f"JSON output path (default docs/results/{script}.json; with --smoke a temporary file)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --out that another benchmark wrote (never a file picollama did not write)",
    )
    p.set_defaults(benchmark=script, temporary_out=False)
    return p


def add_configs(p: ArgumentParser, default: str):
    """--config NAME,...: the model configs to measure, comma-separated."""
    p.add_argument(
        "--config",
        type=comma_list(),
        default=default,
        help=f"comma-separated: small, base, configs/NAME.toml names (default {default})",
    )
    p.set_defaults(smoke_model=True)  # --smoke measures its own model. Parse refuses --config.


def check_smoke_config(p: ArgumentParser, args):
    """UserError for --smoke with a --config given where --smoke measures its own tiny model in
    place of the configs (it was silently ignored, even a nonexistent one)."""
    if args.smoke and getattr(args, "smoke_model", False) and "config" in p.given:
        raise UserError(
            "--smoke measures its own tiny model, not --config: give --smoke or --config"
        )


def parse(p: ArgumentParser, argv: list[str]):
    """The parsed flags, with --out defaulted and claimed before anything is measured: writable,
    absent or this benchmark's result (the ownership rule, outputs.check_own_result), and, in a
    one_writer main, locked against a second benchmark writing it (outputs.exclusive)."""
    args = p.parse_args(argv)
    check_smoke_config(p, args)
    if args.out is None:
        args.out = default_out(args.benchmark, args.smoke)
        args.temporary_out = args.smoke
    check_writable(args.out)
    check_own_result(args.out, module_of(args.benchmark), benchmark_of, args.force)
    # A memory benchmark's child measures for its parent, which holds the lock.
    if HOLDERS and not getattr(args, "child", None):
        HOLDERS[-1].enter_context(exclusive(args.out))
    return args


def benchmark_of(result: dict) -> str | None:
    """Which benchmark wrote a result (write_results' JSON): its module_of, or None."""
    name = result.get("benchmark")
    return module_of(name) if isinstance(name, str) and "machine" in result else None


def module_of(name: str) -> str:
    """The module of the benchmark or measurement NAME: picollama.lab.measure.NAME where lab/measure
    holds it, else picollama.lab.bench.NAME."""
    wing = (
        "measure" if (Path(__file__).parents[1] / "measure" / f"{name}.py").is_file() else "bench"
    )
    return f"picollama.lab.{wing}.{name}"


def one_writer(main):
    """A benchmark's main(argv) that holds its --out's lock (taken by parse) until it returns."""

    @functools.wraps(main)
    def locked(argv):
        with contextlib.ExitStack() as stack:
            HOLDERS.append(stack)
            try:
                return main(argv)
            finally:
                HOLDERS.remove(stack)

    return locked


def default_out(script: str, smoke: bool) -> Path:
    """docs/results/SCRIPT.json; for --smoke a new temporary file: its figures (random tokens, a
    tiny model) must never replace the committed results."""
    if smoke:
        return Path(tempfile.mkdtemp(prefix=f"picollama-{script}-smoke-")) / f"{script}.json"
    return RESULTS_DIR / f"{script}.json"


def setup(args) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the parsed flags (auto: cuda, else cpu; bf16 where the device computes it
    natively, else fp32); UserError if unusable."""
    device = bench_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device, pick_dtype(args.dtype, device)


def bench_device(name: str) -> torch.device:
    """A benchmark's --device: as pick_device, but auto never picks mps (the benchmarks skip it)."""
    device = pick_device(name)
    if device.type == "mps" and name == "auto":
        return torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported by the benchmarks: use cpu or cuda")
    return device


def model_args(name: str) -> ModelArgs:
    """ModelArgs of configs/NAME.toml or of a .toml path ([model]); "smoke": the SMOKE model."""
    if name == "smoke":
        return ModelArgs(**SMOKE)
    path = Path(name) if name.endswith(".toml") else REPO_ROOT / "configs" / f"{name}.toml"
    if not path.exists():
        raise UserError(f"no config {name!r}: no {path}")
    text = read_small_text(path, "--config")
    try:
        section = tomllib.loads(text).get("model")
        if not isinstance(section, dict):
            raise UserError(f"{path} has no [model] section")
        return model_args_from_dict(section)
    except (tomllib.TOMLDecodeError, ValueError, TypeError) as e:
        raise UserError(f"{path}: {e}") from None


def build_ours(args: ModelArgs, device, dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args).to(device=device, dtype=dtype)


def build_hf(ours: Transformer):
    """Hugging Face's LlamaForCausalLM with our model's config and weights (SDPA attention)."""
    import transformers

    weight = ours.output.weight
    config = transformers.LlamaConfig(**hf_config(ours.args), attn_implementation="sdpa")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()}
    hf.load_state_dict(state, strict=False, assign=True)
    if ours.args.tie_embeddings:
        hf.tie_weights()
    with torch.device(weight.device):  # Its RoPE buffers were built on meta.
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    return hf.to(device=weight.device, dtype=weight.dtype)


def ours_loss(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, targets=y)


def hf_loss(hf, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """HF's loss on our targets: y is x shifted already (shift_labels), as our model takes it."""
    return hf(input_ids=x, labels=y, shift_labels=y).loss


def maybe_compile(module, enabled: bool):
    return torch.compile(module) if enabled else module


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(
    steps: dict, device, warmup: int, repeats: int, progress=None
) -> dict[str, float]:
    """Median seconds per call of each step, measured A B A B … after `warmup` calls of each."""
    times = interleaved_times(steps, device, warmup, repeats, progress)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_times(
    steps: dict, device, warmup: int, repeats: int, progress=None
) -> dict[str, list[float]]:
    """The seconds of each call of each step (interleaved_medians' samples)."""
    times = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
        if progress is not None:
            progress.update(1)
    return times


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` n×n matrix products in `dtype`: the CPU's MFU peak, which
    no table gives (bf16 runs ~5× faster than fp32 on a CPU with AMX)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def mfu_peak_flops(args, device: torch.device, dtype: torch.dtype = torch.float32) -> float | None:
    """Peak FLOP/s for MFU: --peak-tflops, a measured CPU matmul in the dtype the arithmetic runs
    in, or device.py's GPU table (None if unknown). A CPU without bf16 units computes bf16 through
    its fp32 units (converting, ~50-100× slower in a large matmul), so its bf16 peak is its fp32
    one. --smoke measures a small matmul: seconds anywhere."""
    if device.type == "cpu" and args.peak_tflops is None:
        native = dtype == torch.float32 or cpu_has_bf16()
        return matmul_flops(dtype if native else torch.float32, n=256 if args.smoke else 2048)
    return peak_flops(device, args.peak_tflops)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def machine_info(device) -> dict:
    device = torch.device(device)
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def print_table(headers: list[str], rows: list[list]):
    cells = [
        [f"{c:,.2f}" if isinstance(c, float) else str(c) for c in row] for row in [headers, *rows]
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_results(args, payload: dict) -> Path:
    """Write payload + machine info as JSON to --out (atomically) and say where."""
    payload = {
        "benchmark": args.benchmark,
        "command": " ".join(["python -m", module_of(args.benchmark), *sys.argv[1:]]),
        "machine": machine_info(bench_device(getattr(args, "device", "cpu"))),
        **payload,
    }
    with atomic_output(args.out) as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")
    if args.temporary_out:
        print(f"(--smoke writes a temporary file, never docs/results/{args.benchmark}.json)")
    return args.out
