"""Supervised fine-tuning throughput, ours vs HF's LlamaForCausalLM.

A step is forward, backward and AdamW on packed conversations. Both get the same fp32 weights
and the same rows, and their steps are interleaved. Positions restart per conversation, the
mask is block-causal, and only assistant tokens are targets. It runs in float32, or both under
bf16 autocast as train.py's mixed precision does (--dtype bfloat16). It also records each
first step's peak memory."""

import ctypes
import ctypes.util
import gc
import math
import sys
from contextlib import nullcontext

import torch
from tqdm import tqdm

from data.packing import Documents, PackedBatches, document_mask
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.device import keep_freed_memory
from picollama.lab.bench import common
from picollama.lab.bench.memory import proc_status_bytes, reset_cpu_peak
from picollama.run_files import load_model

MODELS = ("ours", "hf")


def smoke_rows(vocab: int, batch: int, seq_len: int) -> tuple:
    """(x, y, positions) of --smoke's rows: random tokens, three conversations a row, the first
    half of each a prompt (no targets)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    y = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    third = seq_len // 3
    lengths = [third, third, seq_len - 2 * third]
    y[:, torch.cat([torch.arange(n) < n // 2 for n in lengths])] = -100
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(batch, seq_len).contiguous()
    return x, y, positions


def dataset_rows(data_dir: str, batch: int, seq_len: int) -> tuple:
    """(x, y, positions): the first batch train.py draws from a conversations dataset (seed 0)."""
    documents = Documents(data_dir, "train", seq_len + 1, conversations=True)
    return PackedBatches(documents, batch, seq_len).next_batch()


def loss_functions(ours, hf, positions, mask, autocast):
    """Each model's loss on (x, y), the mean over the targets, with the rows' positions and mask,
    under `autocast`."""

    def ours_loss(x, y):
        with autocast:
            return ours(x, y, positions=positions, mask=mask)

    def hf_loss(x, y):
        with autocast:
            out = hf(
                input_ids=x, labels=y, shift_labels=y, position_ids=positions, attention_mask=mask
            )
        return out.loss

    return {"ours": ours_loss, "hf": hf_loss}


def training_step(model, loss_fn, x, y):
    """One AdamW training step of the model on (x, y): what interleaved_medians times."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss_fn(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def first_step_peak(step) -> int | None:
    """The resident memory a model's first step adds at its peak (activations, gradients, AdamW's
    state) over what is resident before it, freed memory given back to the OS first (Linux, before
    keep_freed_memory); None where the peak cannot be reset."""
    gc.collect()
    if (name := ctypes.util.find_library("c")) is not None:
        ctypes.CDLL(name).malloc_trim(0)
    if not reset_cpu_peak():
        return None
    before = proc_status_bytes("VmRSS")
    step()
    return proc_status_bytes("VmHWM") - before


def build_models(cli, device):
    """(our model, HF's with its weights), fp32, from --run or --smoke's random tiny model."""
    if cli.smoke:
        ours = common.build_ours(common.model_args("smoke"), device, torch.float32)
    else:
        ours = load_model(cli.run)[0].to(device=device, dtype=torch.float32)
    return ours.train(), common.build_hf(ours).train()


def bench(cli, device, dtype, progress) -> dict:
    """Both models' losses on the same rows (checked equal), step times and step peaks."""
    ours, hf = build_models(cli, device)
    vocab, seq_len, batch = ours.args.vocab_size, cli.seq_len, cli.batch_size
    if cli.smoke:
        x, y, positions = smoke_rows(vocab, batch, seq_len)
    else:
        x, y, positions = dataset_rows(cli.data, batch, seq_len)
    x, y, positions = x.to(device), y.to(device), positions.to(device)
    mask = document_mask(positions)[:, None]
    bf16 = dtype != torch.float32
    autocast = torch.autocast(device.type, dtype=dtype) if bf16 else nullcontext()
    losses = loss_functions(ours, hf, positions, mask, autocast)
    with torch.no_grad():
        initial = {who: losses[who](x, y).item() for who in MODELS}
    if not math.isclose(initial["ours"], initial["hf"], rel_tol=1e-2 if bf16 else 1e-4):
        raise UserError(f"our loss {initial['ours']:.5f} != HF's {initial['hf']:.5f} on the rows")
    models = {"ours": ours, "hf": hf}
    steps = {who: training_step(models[who], losses[who], x, y) for who in MODELS}
    cpu = device.type == "cpu"
    peaks = {who: first_step_peak(steps[who]) if cpu else None for who in MODELS}
    keep_freed_memory()  # As train.py does, for both models' timed steps.
    seconds = common.interleaved_medians(steps, device, cli.warmup, cli.steps, progress)
    targets = int((y != -100).sum())
    result = {
        "params": ours.num_params(),
        "batch_size": batch,
        "seq_len": seq_len,
        "targets": targets,
        "precision": "bf16 autocast" if bf16 else "float32",
        "initial_loss": initial,
    }
    for who in MODELS:
        result[who] = {
            "step_seconds": seconds[who],
            "tokens_per_second": batch * seq_len / seconds[who],
            "first_step_peak_mib": None if peaks[who] is None else peaks[who] / 2**20,
        }
    result["ratio_ours_over_hf"] = seconds["hf"] / seconds["ours"]
    return result


def parse_args(argv: list[str]):
    """The flags, with --smoke's tiny run filled in; --run and --data needed otherwise."""
    p = common.parser(__doc__, "sft")
    p.add_argument("--run", help="a run directory to fine-tune (an imported SmolLM2-135M)")
    p.add_argument("--data", help="a conversations dataset made with that run's tokenizer")
    p.add_argument("--batch-size", type=positive(), default=8, help="rows per step (default 8)")
    p.add_argument("--seq-len", type=positive(), default=512, help="tokens a row (default 512)")
    p.add_argument(
        "--warmup", type=positive(zero=True), default=2, help="untimed steps per model (default 2)"
    )
    p.add_argument(
        "--steps", type=positive(), default=5, help="timed steps per model, interleaved (default 5)"
    )
    cli = common.parse(p, argv)
    if cli.smoke:
        cli.warmup, cli.steps, cli.batch_size, cli.seq_len = 1, 2, 2, 30
    elif not (cli.run and cli.data):
        raise UserError("give --run RUN and --data DIR (a conversations dataset), or --smoke")
    return cli


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, dtype = common.setup(cli)
    total = cli.warmup + cli.steps
    with tqdm(total=total, desc="sft steps (ours+hf)", disable=None) as progress:
        result = bench(cli, device, dtype, progress)
    peaks = [result[who]["first_step_peak_mib"] for who in MODELS]
    rows = [
        [
            result["precision"],
            f"{result['batch_size']}x{result['seq_len']}",
            result["targets"],
            result["ours"]["tokens_per_second"],
            result["hf"]["tokens_per_second"],
            result["ratio_ours_over_hf"],
            *(f"{peak:,.0f}" if peak is not None else "-" for peak in peaks),
        ]
    ]
    headers = [
        "precision",
        "rows",
        "targets",
        "ours tok/s",
        "HF tok/s",
        "ours/HF",
        "ours step MiB",
        "HF step MiB",
    ]
    common.print_table(headers, rows)
    common.write_results(cli, {"run": cli.run, "data": cli.data, "results": [result]})
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
