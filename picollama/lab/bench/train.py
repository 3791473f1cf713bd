"""Training throughput (forward + backward + AdamW), ours vs HF's LlamaForCausalLM.

Both get the same weights, and their steps are interleaved. It runs in fp32 and in bf16. In bf16
both models run under the same torch.autocast, with fp32 weights."""

import math
import sys
from contextlib import nullcontext

import torch
from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import add_compile, comma_list, positive
from picollama.device import keep_freed_memory
from picollama.lab.bench import common
from picollama.training.metrics import flops_per_token

PRECISIONS = ("float32", "bfloat16")  # With bfloat16, both autocast over fp32 weights.


def train_step(model, optimizer, loss_fn, x, y, autocast):
    """One training step of the model on (x, y): what interleaved_medians times."""

    def step():
        with autocast:
            loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def initial_losses(name: str, ours, hf, x, y, autocast, bf16: bool) -> tuple[float, float]:
    """Both models' loss on the batch; UserError unless they agree (same weights, same batch)
    before anything is timed."""
    with torch.no_grad(), autocast:
        loss_ours = common.ours_loss(ours, x, y).item()
        loss_hf = common.hf_loss(hf, x, y).item()
    if not math.isclose(loss_ours, loss_hf, rel_tol=1e-2 if bf16 else 1e-4):
        raise UserError(
            f"{name}: our loss {loss_ours:.5f} != Hugging Face's {loss_hf:.5f}; "
            "the comparison is off"
        )
    return loss_ours, loss_hf


def bench_config(name, margs, batch, seq_len, device, dtype, precision, cli, progress):
    """Time our model's and HF's training steps, interleaved, on one config in one precision."""
    ours = common.build_ours(margs, device, dtype).train()
    hf = common.build_hf(ours).train()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, margs.vocab_size, (batch, seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ours_c, hf_c = common.maybe_compile(ours, cli.compile), common.maybe_compile(hf, cli.compile)
    bf16 = dtype == torch.bfloat16 or precision == "bfloat16"
    autocast = nullcontext()
    if precision == "bfloat16":
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    loss_ours, loss_hf = initial_losses(name, ours_c, hf_c, x, y, autocast, bf16)
    steps = {
        "ours": train_step(
            ours_c, torch.optim.AdamW(ours.parameters(), lr=1e-4), common.ours_loss, x, y, autocast
        ),
        "hf": train_step(
            hf_c, torch.optim.AdamW(hf.parameters(), lr=1e-4), common.hf_loss, x, y, autocast
        ),
    }
    seconds = common.interleaved_medians(steps, device, cli.warmup, cli.steps, progress)
    tokens_per_step = batch * seq_len
    peak = common.mfu_peak_flops(cli, device, torch.bfloat16 if bf16 else dtype)
    result = {
        "config": name,
        "model_args": margs.to_dict(),
        "params": ours.num_params(),
        "batch_size": batch,
        "seq_len": seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "autocast": precision == "bfloat16",
        "compile": cli.compile,
        "initial_loss": {"ours": loss_ours, "hf": loss_hf},
    }
    for who, s in seconds.items():
        result[who] = {"step_seconds": s, "tokens_per_second": tokens_per_step / s}
        if peak:
            result[who]["mfu"] = flops_per_token(ours, seq_len) * tokens_per_step / s / peak
    result["ratio_ours_over_hf"] = seconds["hf"] / seconds["ours"]
    return result


def parse_args(argv: list[str]):
    """The flags, with --smoke's short runs filled in."""
    p = common.parser(__doc__, "train")
    add_compile(p, "both models (for GPU runs)")
    p.add_argument(
        "--peak-tflops",
        type=positive(float),
        help="the device's peak for MFU (default: a matmul measured in the run's dtype on CPU, "
        "a table of GPUs)",
    )
    common.add_configs(p, "small,default")
    p.add_argument("--batch-size", type=positive(), help="sequences per step (default 16)")
    p.add_argument(
        "--seq-len", type=positive(), help="tokens per sequence (default: the config's max_seq_len)"
    )
    p.add_argument(
        "--precisions",
        type=comma_list(choices=PRECISIONS),
        default=",".join(PRECISIONS),
        help="comma-separated: float32, bfloat16 (= both models autocast to bf16); default both",
    )
    p.add_argument(
        "--warmup", type=positive(zero=True), default=2, help="untimed steps per model (default 2)"
    )
    p.add_argument(
        "--steps", type=positive(), default=7, help="timed steps per model, interleaved (default 7)"
    )
    cli = common.parse(p, argv)
    if cli.smoke:
        cli.warmup = 1
        cli.steps = 2
    return cli


def cases(cli) -> list[tuple]:
    """(config name, ModelArgs, batch size, sequence length) of each --config, or of --smoke's
    tiny model."""
    if cli.smoke:
        return [("smoke", common.model_args("smoke"), 2, 32)]
    found = []
    for name in cli.config:
        try:
            margs = common.model_args(name)
        except UserError as e:
            if name != "default":
                raise
            # The training engineer writes configs/default.toml.
            print(f"skipping default: {e}")
            continue
        found.append((name, margs, cli.batch_size or 16, cli.seq_len or margs.max_seq_len))
    return found


def report(results: list[dict]):
    rows = [
        [
            r["config"],
            "bf16 autocast" if r["autocast"] else r["dtype"],
            r["params"] / 1e6,
            f"{r['batch_size']}x{r['seq_len']}",
            r["ours"]["tokens_per_second"],
            r["hf"]["tokens_per_second"],
            r["ratio_ours_over_hf"],
            f"{100 * r['ours']['mfu']:.1f}%" if "mfu" in r["ours"] else "-",
        ]
        for r in results
    ]
    headers = [
        "config",
        "precision",
        "params (M)",
        "batch",
        "ours tok/s",
        "HF tok/s",
        "ours/HF",
        "ours MFU",
    ]
    common.print_table(headers, rows)


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, dtype = common.setup(cli)
    keep_freed_memory()  # As train.py does, for both models.
    todo = cases(cli)
    results = []
    total = len(todo) * len(cli.precisions) * (cli.warmup + cli.steps)
    with tqdm(total=total, desc="train steps (ours+hf)", disable=None) as progress:
        for case in todo:
            for precision in cli.precisions:
                results.append(bench_config(*case, device, dtype, precision, cli, progress))
    report(results)
    common.write_results(cli, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
