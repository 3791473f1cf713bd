"""RoPE length extrapolation: switching a model's RoPE scaling, and how perplexity and retrieval hold up past the
training context with each method (the `python generate.py extrapolate` command)."""

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import load_run
from cli import ArgumentParser, UserError, atomic_output, check_writable
from data.loader import document_windows, load_meta
from device import pick_device, pick_dtype
from model import ROPE_SCALINGS, Transformer

SPAN, GIVEN = 32, 8  # retrieval: a 32-token span of real text; its repeat gives the first 8, the next 24 are scored


def set_rope(model: Transformer, method: str, factor: float, original_len: int):
    """Switch the model's RoPE to method/factor, stretching from original_len (the training context)."""
    model.args = dataclasses.replace(
        model.args, rope_scaling=method, rope_factor=factor, rope_original_max_seq_len=original_len
    )


def use_rope_for(model: Transformer, method: str, length: int, train_len: int):
    """RoPE `method` for sequences of `length` tokens: static methods stretch by length/train_len (none at 1×),
    dynamic gets factor 1 and scales itself from the current length."""
    factor = 1.0 if method in ("none", "dynamic") else max(1.0, length / train_len)
    set_rope(model, method, factor, train_len)


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def sliding_losses(model: Transformer, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """token_losses over (1, T) tokens seen through windows of `context` tokens moving by context/2: each token
    after the first window is scored with at least context/2 tokens before it."""
    length, stride = tokens.shape[1], max(context // 2, 1)
    pieces, start, scored = [], 0, 1  # scored: the next target position
    while scored < length:
        end = min(start + context, length)
        pieces.append(token_losses(model, tokens[:, start:end])[:, scored - start - 1 :])
        scored, start = end, start + stride
    return torch.cat(pieces, dim=1)


def retrieval_distances(longest: int) -> list[int]:
    """Span-to-repeat distances: 64, 128, ... and the farthest that fits a sequence of `longest` tokens."""
    distances, d = [], 64
    while d + SPAN <= longest:
        distances.append(d)
        d *= 2
    return sorted(set(distances) | ({longest - SPAN} if longest - SPAN >= 64 else set()))


def retrieval_score(model: Transformer, filler: np.ndarray, span: np.ndarray, distance: int, device):
    """(accuracy, mean log-probability) of continuing `span` when its repeat (first GIVEN tokens) comes `distance`
    tokens after it, with real text as filler between."""
    sequence = filler[: distance + SPAN].copy()
    sequence[:SPAN] = span
    sequence[distance:] = span
    tokens = torch.from_numpy(sequence)[None].to(device)
    logits = model(tokens[:, :-1])[0, distance + GIVEN - 1 :].float()
    targets = tokens[0, distance + GIVEN :]
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    logprob = -F.cross_entropy(logits, targets).item()
    return accuracy, logprob


def spread(values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    return {"mean": float(values.mean()), "std": float(values.std()), "n": len(values)}


def find_data_dir(config: dict, override: str | None) -> Path:
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = (config.get("data") or {}).get("dir")
        if not configured:
            raise UserError("config.json names no data.dir; pass --data DIR (a prepared dataset with val.bin)")
        candidates = [Path(configured), Path(__file__).resolve().parent / configured]
    for path in candidates:
        if (path / "val.bin").is_file() and (path / "meta.json").is_file():
            return path
    raise UserError(f"{candidates[0]} is not a prepared dataset with a val split; pass --data DIR")


def check_same_tokenizer(checkpoint: Path, data_dir: Path):
    """UserError when the dataset was tokenized by another tokenizer than the checkpoint's."""
    expected = load_meta(data_dir).get("tokenizer_sha256")
    ours = hashlib.sha256((checkpoint / "tokenizer.model").read_bytes()).hexdigest()
    if expected and expected != ours:
        raise UserError(f"{data_dir} was tokenized with another tokenizer than {checkpoint}/tokenizer.model")


def evaluate_extrapolation(model, data_dir, train_len, lengths, methods, protocol, num_windows, seed, device) -> dict:
    """All the numbers of the extrapolation report (see the `extrapolate` command)."""
    longest = max(lengths)
    score_tokens = min(64, train_len // 2)
    windows = document_windows(data_dir, "val", longest, num_windows, seed=seed)
    spans = document_windows(data_dir, "val", SPAN, num_windows, seed=seed + 1)
    if windows.max() >= model.args.vocab_size:
        raise UserError(f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another tokenizer")
    distances = retrieval_distances(longest)
    bins = np.linspace(0, longest - 1, min(32, longest - 1) + 1).round().astype(int)
    results = {"perplexity": {}, "per_position": {"bin_edges": bins.tolist()}, "retrieval": {}}
    work = len(methods) * (len(lengths) + len(distances)) * num_windows
    with tqdm(total=work, desc="extrapolation", unit="window") as bar:
        for method in methods:
            per_length, per_distance = {}, {}
            for length in lengths:
                use_rope_for(model, method, length, train_len)
                window_losses = []
                for window in windows:
                    tokens = torch.from_numpy(window)[None].to(device)
                    if protocol == "fixed-target":
                        losses = token_losses(model, tokens[:, -length:])[0]
                        targets = losses[-score_tokens:]
                    else:
                        losses = targets = sliding_losses(model, tokens, length)[0]
                    window_losses.append(targets.mean().item())
                    if length == longest:  # the whole window in one forward: its loss at every position
                        per_bin = [losses[a:b].mean().item() for a, b in zip(bins[:-1], bins[1:], strict=True)]
                        results["per_position"].setdefault(method, []).append(per_bin)
                    bar.update()
                loss = spread(window_losses)
                per_length[str(length)] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
            for distance in distances:
                use_rope_for(model, method, distance + SPAN, train_len)
                scores = [retrieval_score(model, w, s, distance, device) for w, s in zip(windows, spans, strict=True)]
                per_distance[str(distance)] = {
                    "accuracy": spread([a for a, _ in scores]),
                    "logprob": spread([p for _, p in scores]),
                }
                bar.update(num_windows)
            reference = per_length[str(train_len)]["perplexity"]
            for row in per_length.values():
                row["ratio"] = row["perplexity"] / reference
            results["perplexity"][method] = per_length
            results["retrieval"][method] = per_distance
            by_bin = np.asarray(results["per_position"][method])
            results["per_position"][method] = {"loss_mean": by_bin.mean(0).tolist(), "loss_std": by_bin.std(0).tolist()}
    results["retrieval"]["distances"] = distances
    results["score_tokens"] = score_tokens
    return results


def short_number(x: float) -> str:
    """3 significant digits; `>10^k` for blow-ups of 1000 and more."""
    if not math.isfinite(x):
        return "inf"
    return f">10^{int(math.log10(x))}" if x >= 1000 else f"{x:.3g}"


def ratio_text(x: float) -> str:
    return short_number(x) if x >= 1000 or not math.isfinite(x) else f"{x:.2f}×"


def markdown_report(report: dict) -> str:
    lengths, train_len = report["lengths"], report["train_context"]
    header = "| method | " + " | ".join(f"{n} ({n / train_len:g}×)" for n in lengths) + " |"
    rule = "|---" * (len(lengths) + 1) + "|"
    lines = [
        f"# RoPE extrapolation of {report['checkpoint']}",
        "",
        f"Training context {train_len} tokens. Protocol `{report['protocol']}`: "
        + (
            f"the last {report['score_tokens']} tokens of {report['num_windows']} validation windows of "
            f"{max(lengths)} tokens (each inside one document), scored with the last n tokens as context."
            if report["protocol"] == "fixed-target"
            else f"every token of {report['num_windows']} validation windows of {max(lengths)} tokens, scored through "
            "windows of n tokens moving by n/2."
        )
        + " Static methods use factor n/training context, `dynamic` factor 1.",
        "",
        "Perplexity (ratio to the training length):",
        "",
        header,
        rule,
    ]
    for method, row in report["perplexity"].items():
        cells = [f"{short_number(row[str(n)]['perplexity'])} ({ratio_text(row[str(n)]['ratio'])})" for n in lengths]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    distances = report["retrieval"]["distances"]
    lines += [
        "",
        f"Retrieval: accuracy of continuing a {SPAN}-token span of real text ({SPAN - GIVEN} tokens scored) when its "
        f"first {GIVEN} tokens repeat d tokens later:",
        "",
        "| method | " + " | ".join(f"d={d}" for d in distances) + " |",
        "|---" * (len(distances) + 1) + "|",
    ]
    for method in report["methods"]:
        row = report["retrieval"][method]
        lines.append(f"| {method} | " + " | ".join(f"{row[str(d)]['accuracy']['mean']:.0%}" for d in distances) + " |")
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    train_len, methods = report["train_context"], report["methods"]
    fig, (ppl_ax, pos_ax, ret_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = ["o-", "s--", "^-.", "D:", "v-", "x--"]  # distinct even where two methods' lines coincide
    lengths, distances = report["lengths"], report["retrieval"]["distances"]
    edges = np.asarray(report["per_position"]["bin_edges"])
    for method, style in zip(methods, styles, strict=False):
        ppl_ax.plot(lengths, [report["perplexity"][method][str(n)]["perplexity"] for n in lengths], style, label=method)
        pos_ax.plot((edges[:-1] + edges[1:]) / 2, report["per_position"][method]["loss_mean"], style[1:], label=method)
        ret_ax.plot(
            distances, [report["retrieval"][method][str(d)]["accuracy"]["mean"] for d in distances], style, label=method
        )
    ppl_ax.set(
        xscale="log",
        yscale="log",
        xlabel="context length (tokens)",
        ylabel="perplexity",
        title=f"perplexity ({report['protocol']})",
    )
    ppl_ax.set_xscale("log", base=2)
    pos_ax.set(
        xlabel="position in the window",
        ylabel="loss (nats)",
        title=f"loss by position, {max(report['lengths'])} tokens",
    )
    ret_ax.set(
        xscale="log",
        xlabel="distance to the repeat (tokens)",
        ylabel="accuracy",
        ylim=(-0.02, 1.02),
        title=f"retrieval: continue a {SPAN}-token span",
    )
    ret_ax.set_xscale("log", base=2)
    # ticks at 1, 1.5, 2, 3, 5, 7 per decade, labelled 90, 100, 150 rather than 9×10^1
    ppl_ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ppl_ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (ppl_ax, pos_ax, ret_ax):
        ax.axvline(train_len, color="gray", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    ppl_ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def parse_list(text: str, flag: str, convert=str) -> list:
    """The comma-separated items of a flag's value, each through convert; UserError naming a bad item."""
    values = []
    for item in filter(None, (item.strip() for item in text.split(","))):
        try:
            values.append(convert(item))
        except ValueError:
            raise UserError(
                f"{flag}: {item!r} is not a valid {convert.__name__} (expected a comma-separated list, got {text!r})"
            ) from None
    if not values:
        raise UserError(f"{flag} is empty")
    return values


def add_run_arguments(parser: ArgumentParser):
    """The options that choose a run directory and how to load it (here and in generate.py's sampling command)."""
    parser.add_argument(
        "--checkpoint", required=True, help="run directory (model.safetensors, config.json, tokenizer.model)"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on CPU)")


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python generate.py extrapolate",
        description="How perplexity and retrieval hold up past the training context, for each RoPE scaling method.",
    )
    add_run_arguments(parser)
    parser.add_argument("--lengths", help="comma-separated context lengths (default: 1,2,4,8 × the training context)")
    parser.add_argument(
        "--methods",
        default="none,linear,ntk,dynamic,yarn",
        help="comma-separated RoPE scaling methods (default none,linear,ntk,dynamic,yarn)",
    )
    parser.add_argument(
        "--protocol",
        choices=("fixed-target", "sliding"),
        default="fixed-target",
        help="fixed-target (default): the same last tokens scored with each context length; "
        "sliding: every token, through windows moving by half their length",
    )
    parser.add_argument("--num-windows", type=int, default=8, help="validation windows (default 8)")
    parser.add_argument("--data", help="prepared dataset (default: config.json's data.dir)")
    parser.add_argument("--seed", type=int, default=0, help="which windows (default 0)")
    parser.add_argument("--out", help="output directory (default CHECKPOINT/extrapolation)")
    return parser


def main(argv: list[str]) -> int:
    """The `extrapolate` command; argv is what follows `python generate.py extrapolate`."""
    args = parser().parse_args(argv)
    methods = parse_list(args.methods, "--methods")
    unknown = [m for m in methods if m not in ROPE_SCALINGS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(ROPE_SCALINGS)})")
    if args.num_windows < 1:
        raise UserError(f"--num-windows must be >= 1, not {args.num_windows}")
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, not {args.seed}")
    device = pick_device(args.device)
    model, config, _ = load_run(args.checkpoint, device, pick_dtype(args.dtype, device))
    train_len = int((config.get("train") or {}).get("seq_len") or model.args.original_seq_len)
    lengths = parse_list(args.lengths, "--lengths", int) if args.lengths else [train_len * k for k in (1, 2, 4, 8)]
    lengths = sorted(set(lengths) | {train_len})
    if min(lengths) <= min(64, train_len // 2):
        raise UserError(f"--lengths must all exceed {min(64, train_len // 2)} (the scored tokens)")
    data_dir = find_data_dir(config, args.data)
    check_same_tokenizer(Path(args.checkpoint), data_dir)
    out_dir = Path(args.out) if args.out else Path(args.checkpoint) / "extrapolation"
    check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
    model_args = model.args.to_dict()  # before the evaluation switches RoPE
    start = time.perf_counter()
    with torch.inference_mode():
        results = evaluate_extrapolation(
            model, data_dir, train_len, lengths, methods, args.protocol, args.num_windows, args.seed, device
        )
    report = {
        "checkpoint": str(args.checkpoint),
        "command": ["python", "generate.py", "extrapolate", *argv],
        "model": model_args,
        "data": str(data_dir),
        "train_context": train_len,
        "lengths": lengths,
        "methods": methods,
        "protocol": args.protocol,
        "num_windows": args.num_windows,
        "seed": args.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        **results,
    }
    markdown = markdown_report(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    # all three or none: each is renamed into place only once every one has been written
    with (
        atomic_output(out_dir / "extrapolation.json") as json_path,
        atomic_output(out_dir / "extrapolation.md") as md_path,
        atomic_output(out_dir / "extrapolation.png") as png_path,
    ):
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        md_path.write_text(markdown)
        plot_report(report, png_path)
    print(markdown)
    print(f"wrote {out_dir}/extrapolation.json, .md and .png ({report['seconds']} s)")
    return 0
