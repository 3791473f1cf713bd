"""Shared by bench/: flags, model configs, our model + the same HF Llama, interleaved timing, tables, JSON."""
import argparse
import json
import os
import platform
import statistics
import sys
import time
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as `python bench/NAME.py`: make `import model` work
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from model import ModelArgs, Transformer  # noqa: E402

RESULTS_DIR = REPO_ROOT / "bench" / "results"
CPU_PEAK_FLOPS_PER_THREAD = 95e9  # fp32 matmul peak on the 2-core dev machine: 190 GFLOP/s; else --peak-tflops


class BenchError(Exception):
    """Bad input to a bench script: printed as one `error:` line."""


def parser(description: str, models: bool = True) -> argparse.ArgumentParser:
    """The flags every bench script takes; models=True adds the device/threads ones of the model benchmarks."""
    p = argparse.ArgumentParser(description=description)
    if models:
        p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
        p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="a tiny, seconds-long run to check the script works")
    p.add_argument("--out", help="JSON output path (default bench/results/<script>.json)")
    return p


def setup(args) -> tuple[torch.device, torch.dtype]:
    """Device and dtype (fp32 on CPU, bf16 on GPU) for the parsed flags; BenchError if unusable."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise BenchError(f"unknown device {args.device!r} (use cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA GPU is available here")
    if device.type not in ("cpu", "cuda"):
        raise BenchError(f"device {args.device!r} is not supported (use cpu or cuda)")
    if args.threads is not None:
        if args.threads < 1:
            raise BenchError("--threads must be positive")
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def model_args(name: str) -> ModelArgs:
    """ModelArgs of configs/NAME.toml or of a .toml path (its [model] section)."""
    path = Path(name) if name.endswith(".toml") else REPO_ROOT / "configs" / f"{name}.toml"
    if not path.is_file():
        raise BenchError(f"no config {name!r}: no {path}")
    try:
        section = tomllib.loads(path.read_text()).get("model")
        if not isinstance(section, dict):
            raise BenchError(f"{path} has no [model] section")
        return ModelArgs.from_dict(section)
    except (tomllib.TOMLDecodeError, ValueError, TypeError) as e:
        raise BenchError(f"{path}: {e}") from None


def build_ours(args: ModelArgs, device, dtype, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args).to(device=device, dtype=dtype)


def build_hf(ours: Transformer):
    """Hugging Face's LlamaForCausalLM with the same config and the same weights as ours (SDPA attention)."""
    import transformers
    from convert import hf_config, to_hf_state_dict

    weight = ours.output.weight
    config = transformers.LlamaConfig(**hf_config(ours.args), attn_implementation="sdpa")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()}
    hf.load_state_dict(state, strict=False, assign=True)
    if ours.args.tie_embeddings:
        hf.tie_weights()
    with torch.device(weight.device):  # its RoPE buffers were built on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    return hf.to(device=weight.device, dtype=weight.dtype)


def maybe_compile(module, enabled: bool):
    return torch.compile(module) if enabled else module


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(steps: dict, device, warmup: int, repeats: int, progress=None) -> dict[str, float]:
    """Median seconds per call of each step, measured A B A B … after `warmup` calls of each."""
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
    return {name: statistics.median(t) for name, t in times.items()}


def peak_flops(args, device) -> float | None:
    """Peak FLOP/s of the device for MFU: --peak-tflops, the CPU constant, or train.py's GPU table (None if unknown)."""
    if getattr(args, "peak_tflops", None) is not None:
        return args.peak_tflops * 1e12
    if torch.device(device).type == "cpu":
        return CPU_PEAK_FLOPS_PER_THREAD * torch.get_num_threads()
    from train import GPU_BF16_PEAK_TFLOPS

    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for gpu, tflops in GPU_BF16_PEAK_TFLOPS if gpu in name), None)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device) -> dict:
    import transformers

    device = torch.device(device)
    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def print_table(headers: list[str], rows: list[list]):
    cells = [[f"{c:,.2f}" if isinstance(c, float) else str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_results(args, script: str, payload: dict) -> Path:
    """Write payload + machine info as JSON (temp file, then rename) and say where."""
    path = Path(args.out) if args.out else RESULTS_DIR / f"{script}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": script, "command": " ".join([f"bench/{script}.py", *sys.argv[1:]]),
               "machine": machine_info(getattr(args, "device", "cpu")), **payload}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)
    print(f"results written to {path}")
    return path


def run_main(main):
    """Call main(); BenchError and bad flags become one `error:` line on stderr and exit status 2."""
    try:
        main()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(2)
