"""Peak memory of training steps (forward + backward + AdamW), ours vs HF's Llama.

Each runs in a fresh process, so one peak cannot leak into the next."""

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.lab.bench import common

# (batch, seq_len). The base model at B=4, T=512 fits 24 GB easily.
DEFAULT_SHAPES = {"small": (16, 256), "base": (4, 512)}
MIB = 2**20


def proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # From kB.
    raise UserError(f"/proc/self/status has no {field}: CPU memory needs Linux")


def reset_cpu_peak() -> bool:
    """Reset VmHWM (the peak resident set) to the current resident set (Linux >= 4.0); False if not
    allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_child(cli, device, dtype) -> dict:
    """In this (fresh) process: the model's resident/allocated bytes, then the extra peak of two
    training steps."""
    (name,) = cli.config
    margs = common.model_args(name)
    ours = common.build_ours(margs, device, dtype).train()
    model = ours
    if cli.child == "hf":
        model = common.build_hf(ours).train()
        del ours
    gc.collect()
    tokens = torch.randint(0, margs.vocab_size, (cli.batch_size, cli.seq_len + 1)).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        common.sync(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        peak_reset = True
    else:
        baseline = proc_status_bytes("VmRSS")
        # Without a reset, the peak may include building the model and overestimate.
        peak_reset = reset_cpu_peak()
    loss_fn = common.ours_loss if cli.child == "ours" else common.hf_loss
    for _ in range(2):  # Step 2 holds AdamW's state, activations and gradients.
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    common.sync(device)
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else proc_status_bytes("VmHWM")
    )
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "step_peak_bytes": peak - baseline,
        "peak_reset_after_building": peak_reset,
    }


def run_case(config: str, who: str, batch: int, seq_len: int, cli) -> dict:
    command = [
        sys.executable,
        "-m",
        "picollama.lab.bench.memory",
        "--child",
        who,
        "--config",
        config,
        "--batch-size",
        str(batch),
        "--seq-len",
        str(seq_len),
        "--device",
        cli.device,
        "--dtype",
        cli.dtype,
    ]
    if cli.threads:
        command += ["--threads", str(cli.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(
            f"measuring {who} at {config} failed: {done.stderr.strip().splitlines()[-1:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "memory")
    common.add_configs(p, "small,base")
    p.add_argument(
        "--batch-size",
        type=positive(),
        help="sequences per step (default: small 16, base 4, else 8)",
    )
    p.add_argument(
        "--seq-len", type=positive(), help="tokens per sequence (default: small 256, base 512)"
    )
    # Internal: measure in this process.
    p.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    return common.parse(p, argv)


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, dtype = common.setup(cli)
    if cli.child:
        print(json.dumps(measure_child(cli, device, dtype)))
        return 0
    cases = []
    for name in ["smoke"] if cli.smoke else cli.config:
        margs = common.model_args(name)
        batch, seq_len = (
            (2, 32) if name == "smoke" else DEFAULT_SHAPES.get(name, (8, margs.max_seq_len))
        )
        cases.append((name, cli.batch_size or batch, cli.seq_len or seq_len))
    results = []
    for name, batch, seq_len in tqdm(cases, desc="memory cases (fresh processes)", disable=None):
        measured = {who: run_case(name, who, batch, seq_len, cli) for who in ("ours", "hf")}
        results.append(
            {
                "config": name,
                "batch_size": batch,
                "seq_len": seq_len,
                **measured,
                "ratio_ours_over_hf": measured["ours"]["step_peak_bytes"]
                / measured["hf"]["step_peak_bytes"],
            }
        )
    what = "peak allocated (CUDA)" if device.type == "cuda" else "peak resident set (VmHWM)"
    print(f"{what} during two training steps, minus the memory after building the model")
    rows = [
        [
            r["config"],
            f"{r['batch_size']}x{r['seq_len']}",
            r["ours"]["baseline_bytes"] / MIB,
            r["ours"]["step_peak_bytes"] / MIB,
            r["hf"]["step_peak_bytes"] / MIB,
            r["ratio_ours_over_hf"],
        ]
        for r in results
    ]
    common.print_table(
        ["config", "batch", "RSS before MiB", "ours step MiB", "HF step MiB", "ours/HF"], rows
    )
    common.write_results(
        cli, {"measure": what, "dtype": str(dtype).removeprefix("torch."), "results": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
