"""Validation perplexity of a trained run with fp32, bf16 and int8 weights.

These are generate.py's --dtype and --quantize. It scores the whole validation split."""

import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from data.loader import eval_batches, load_meta
from model import Transformer
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import add_run, positive
from picollama.convert.main import imported_run
from picollama.kernels.quantize import int8_dtype, quantize
from picollama.lab.bench import common
from picollama.lab.text_track import check_same_tokenizer
from picollama.run_files import load_model

PRECISIONS = {
    "fp32": (torch.float32, "none"),
    "bf16": (torch.bfloat16, "none"),
    "int8": (None, "int8"),
    "int4": (torch.float32, "int4"),  # CPU only.
}


@torch.inference_mode()
def mean_loss(model: Transformer, batches: list) -> float:
    """Mean cross-entropy per target token over the batches."""
    total = 0.0
    count = 0
    for x, y in batches:
        total += model(x, y).double().item() * y.numel()
        count += y.numel()
    return total / count


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "quantize")
    add_run(p, required=False)  # Required but in --smoke. evaluation_data checks it.
    p.add_argument(
        "--seq-len", type=positive(), help="window length (default: the run's train.seq_len)"
    )
    p.add_argument(
        "--batch-size", type=positive(), default=16, help="windows per forward (default 16)"
    )
    p.add_argument("--data", type=Path, help="prepared dataset (default: the run's data.dir)")
    return common.parse(p, argv)


def run_and_data(cli, device) -> tuple[Transformer, dict, Path]:
    """(the model of --run, its config.json, --data or the dataset it was trained on), checked to
    share a tokenizer."""
    if cli.run is None:
        raise UserError("--run RUN_DIR is required (a trained run)")
    run = imported_run(cli.run)  # A .gguf file or HF directory is imported once.
    model, config = load_model(run, device)
    data_dir = cli.data or config.get("data", {}).get("dir")
    if data_dir is None:
        raise UserError(
            f"{cli.run} records no dataset (an imported model): pass --data DIR, one prepared "
            f"with its tokenizer (python data/prepare.py --tokenizer {cli.run} --out DIR)"
        )
    data_dir = Path(data_dir) if Path(data_dir).is_absolute() else common.REPO_ROOT / data_dir
    check_same_tokenizer(run, data_dir)
    return model, config, data_dir


def evaluation_data(cli, device) -> tuple:
    """(the fp32 model, its (x, y) batches, bytes per token or None, window length, where from):
    the trained run's whole validation split, or for --smoke the tiny model on random tokens."""
    if cli.smoke:
        torch.manual_seed(0)
        original = Transformer(common.model_args("smoke"))
        seq_len = 32
        vocab = original.args.vocab_size
        tokens = torch.randint(
            0, vocab, (4, seq_len + 1), generator=torch.Generator().manual_seed(0)
        )
        return original, [(tokens[:, :-1], tokens[:, 1:])], None, seq_len, "random tokens"
    original, config, data_dir = run_and_data(cli, device)
    bytes_per_token = load_meta(data_dir)["bytes_per_token"]
    seq_len = cli.seq_len or config.get("train", {}).get("seq_len") or original.args.max_seq_len
    batches = list(eval_batches(data_dir, "val", cli.batch_size, seq_len, device=device))
    return original, batches, bytes_per_token, seq_len, f"{data_dir}'s validation split"


def evaluate(original: Transformer, batches: list, bytes_per_token, device) -> dict:
    """{precision: its loss, perplexity (also over fp32's) and bits per byte where known}."""
    results = {}
    for name, (dtype, mode) in tqdm(PRECISIONS.items(), desc="precisions", disable=None):
        if mode == "int4" and device.type != "cpu":
            continue
        model = Transformer(original.args).eval()
        model.load_state_dict(original.state_dict())
        model = quantize(model, mode).to(device=device, dtype=dtype or int8_dtype(device))
        loss = mean_loss(model, batches)
        results[name] = {
            "dtype": str(dtype or int8_dtype(device))[6:],
            "weights": mode,
            "loss": loss,
        }
        results[name]["perplexity"] = math.exp(loss)
        if bytes_per_token:
            results[name]["bits_per_byte"] = loss / math.log(2) / bytes_per_token
    for r in results.values():
        r["perplexity_over_fp32"] = r["perplexity"] / results["fp32"]["perplexity"]
    return results


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, _ = common.setup(cli)
    original, batches, bytes_per_token, seq_len, where = evaluation_data(cli, device)
    results = evaluate(original, batches, bytes_per_token, device)
    targets = sum(y.numel() for _, y in batches)
    print(f"{targets:,} target tokens of {where}, windows of {seq_len}")
    common.print_table(
        ["weights", "activations", "loss", "perplexity", "vs fp32"],
        [
            [name, r["dtype"], r["loss"], r["perplexity"], r["perplexity_over_fp32"]]
            for name, r in results.items()
        ],
    )
    common.write_results(
        cli,
        {
            "checkpoint": None if cli.smoke else str(cli.run),
            "model_args": original.args.to_dict(),
            "seq_len": seq_len,
            "target_tokens": targets,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
