"""The held-out bits/byte of a trained run, measured two ways.

The headline is train.py's. It cuts the validation split into windows of the training context
that share only their ends. The second figure scores the same tokens through a sliding window.
Each token then has at least context - stride tokens before it."""

import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.loader import load_meta, open_tokens
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import add_run, positive
from picollama.lab.bench import common
from picollama.lab.measure.quantize import run_and_data
from picollama.lab.scoring import sliding_losses


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "heldout")
    add_run(p, required=False)  # Required but in --smoke. quantize.run_and_data checks it.
    p.add_argument("--data", type=Path, help="prepared dataset (default: the run's data.dir)")
    p.add_argument(
        "--stride",
        type=positive(),
        help="the sliding window's step, at most a quarter of the context (default: a quarter)",
    )
    return common.parse(p, argv)


def held_out(cli, device) -> tuple:
    """(the model, its validation tokens cut to whole windows, bytes per token or None, the
    training context, where from); for --smoke a tiny random model on random tokens."""
    if cli.smoke:
        torch.manual_seed(0)
        model = common.build_ours(common.model_args("smoke"), device, torch.float32)
        tokens = torch.randint(0, model.args.vocab_size, (1, 4 * 32 + 1), device=device)
        return model, tokens, None, 32, "random tokens"
    model, config, data_dir = run_and_data(cli, device)
    context = config.get("train", {}).get("seq_len") or model.args.max_seq_len
    tokens = np.asarray(open_tokens(data_dir, "val"), dtype=np.int64)
    windows = (len(tokens) - 1) // context  # Whole windows only, as train.py's eval_batches.
    if windows == 0:
        raise UserError(f"{data_dir}'s validation split is shorter than one window ({context})")
    tokens = torch.from_numpy(tokens[: windows * context + 1])[None].to(device)
    bytes_per_token = load_meta(data_dir)["bytes_per_token"]
    return model, tokens, bytes_per_token, context, f"{data_dir}'s validation split"


def figure(model, tokens, context: int, stride: int, dtype, bytes_per_token) -> dict:
    """The mean loss (and bits/byte) of the tokens seen through windows `stride` apart; under
    autocast to dtype as train.py validates (fp32 weights)."""
    autocast = torch.autocast(tokens.device.type, dtype, enabled=dtype != torch.float32)
    with torch.inference_mode(), autocast:
        loss = sliding_losses(model.eval(), tokens, context + 1, stride).double().mean().item()
    result = {"stride": stride, "loss": loss, "perplexity": math.exp(loss)}
    if bytes_per_token:
        result["bits_per_byte"] = loss / math.log(2) / bytes_per_token
    return result


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, dtype = common.setup(cli)
    model, tokens, bytes_per_token, context, where = held_out(cli, device)
    stride = cli.stride or max(context // 4, 1)
    if stride > max(context // 4, 1):
        raise UserError(f"--stride {stride} is over a quarter of the context ({context})")
    results = {}
    for name, step in tqdm([("windows", context), ("sliding", stride)], disable=None):
        results[name] = figure(model, tokens, context, step, dtype, bytes_per_token)
    print(f"{tokens.shape[1] - 1:,} target tokens of {where}, context {context}")
    key, label = ("bits_per_byte", "bits/byte") if bytes_per_token else ("loss", "loss")
    rows = [[name, r["stride"], f"{r[key]:.4f}"] for name, r in results.items()]
    common.print_table(["figure (windows: the headline)", "stride", label], rows)
    common.write_results(
        cli,
        {
            "checkpoint": None if cli.smoke else str(cli.run),
            "context": context,
            "dtype": str(dtype)[6:],
            "target_tokens": tokens.shape[1] - 1,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
