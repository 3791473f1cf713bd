"""Length extrapolation: switching a model's RoPE scaling, and how perplexity and a copy probe hold up past the
training context, for each scaling method and each of several runs (the `python generate.py extrapolate` command)."""

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
from data.loader import copy_vocabulary, document_windows, load_meta
from data.tokenizer import same_tokenizer, tokenizer_sha256
from device import pick_device, pick_dtype
from extrapolation_report import BINS_PER_OCTAVE, DEFAULT_METHODS, MIN_BIN, effective_line, markdown_report, plot_report
from model import ROPE_SCALINGS, Transformer


def fits(model: Transformer, length: int) -> bool:
    """Whether the model can score a sequence of `length` tokens at all (the model's length policy)."""
    limit = model.args.position_limit
    return limit is None or length <= limit


def logits_and_losses(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits (B, T-1, vocab) and cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it."""
    logits = model(tokens[:, :-1]).float()
    return logits, F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    return logits_and_losses(model, tokens)[1]


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


def row_blocks(array: np.ndarray, length: int, device):
    """The rows of array in consecutive blocks, as tensors on device, of about 8192 tokens of forwards `length` long
    (which bounds the (rows, length, vocab) logits)."""
    rows = max(1, 8192 // length)
    for start in range(0, len(array), rows):
        yield torch.from_numpy(array[start : start + rows]).to(device)


# ---------------------------------------------------------------- the copy probe


def probe_distances(train_len: int, lengths: list[int], span: int) -> list[int]:
    """Span-to-repeat distances: train_len/4, train_len/2, and for each tested length n the farthest that fits n
    tokens, n - span (so that the probe reads at every length); never below span (no overlap)."""
    return sorted(d for d in {train_len // 4, train_len // 2} | {n - span for n in lengths} if d >= span)


def probe_spans(meta: dict, count: int, span: int, seed: int) -> np.ndarray:
    """(count, span) random token ids, uniform over the non-special vocabulary: no language prior predicts them."""
    vocabulary = copy_vocabulary(meta)
    return vocabulary[np.random.default_rng(seed).integers(0, len(vocabulary), size=(count, span))]


def probe_sequences(text: np.ndarray, spans: np.ndarray, distance: int) -> np.ndarray:
    """Rows of real text, distance + span tokens long, with each row's span at its start and again `distance`
    tokens later."""
    span = spans.shape[1]
    sequences = text[:, : distance + span].copy()
    sequences[:, :span] = spans
    sequences[:, distance:] = spans
    return sequences


def probe_scores(model: Transformer, sequences: np.ndarray, distance: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Per row of probe_sequences: top-1 accuracy on the repeat after its first token, and the loss drop in nats
    from the first occurrence to the repeat (over the same span-1 tokens of each)."""
    span = sequences.shape[1] - distance
    accuracy, drop = [], []
    for tokens in row_blocks(sequences, sequences.shape[1], device):
        logits, losses = logits_and_losses(model, tokens)
        hits = logits[:, distance : distance + span - 1].argmax(-1) == tokens[:, distance + 1 :]
        accuracy.append(hits.float().mean(1))
        drop.append((losses[:, : span - 1] - losses[:, distance : distance + span - 1]).mean(1))
    return torch.cat(accuracy).cpu().numpy(), torch.cat(drop).cpu().numpy()


# ---------------------------------------------------------------- the evaluation


def spread(values) -> dict:
    """Mean, standard deviation, standard error of the mean and count."""
    values = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "sem": float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def position_bins(longest: int) -> np.ndarray:
    """Edges of the loss-by-position bins over a window's longest-1 predictions (index i has i+1 tokens of context):
    BINS_PER_OCTAVE per doubling of the position, and at least MIN_BIN positions wide, so that every point averages
    several tokens and later ones, where the curve changes slowly, many."""
    edges = [0]
    while edges[-1] < longest - 1:
        grown = round((edges[-1] + 1) * 2 ** (1 / BINS_PER_OCTAVE)) - 1
        edges.append(min(max(grown, edges[-1] + MIN_BIN), longest - 1))
    return np.array(edges)


def effective_context(perplexity: dict, probe: dict, train_len: int, span: int) -> dict:
    """The longest tested length up to which every tested length keeps perplexity within 5% of its training-length
    value and the probe (at the farthest distance that fits the length) within 10 points of its accuracy at the
    training length; perplexity alone where the probe reads under 20% there."""
    in_context = probe.get(str(train_len - span))
    accuracy = in_context["accuracy"]["mean"] if in_context else None
    use_probe = accuracy is not None and accuracy >= 0.2
    tokens = train_len
    for length in sorted(int(n) for n in perplexity if int(n) > train_len):
        row, read = perplexity[str(length)], probe.get(str(length - span))
        holds = row is not None and row["ratio"] <= 1.05
        if use_probe:
            holds = holds and read is not None and read["accuracy"]["mean"] >= accuracy - 0.10
        if not holds:
            break
        tokens = length
    if use_probe:
        basis = "perplexity and probe"
    elif accuracy is None:
        basis = "perplexity only: no probe fits the training context"
    else:
        basis = f"perplexity only: the probe reads {accuracy:.0%} in context"
    return {"tokens": tokens, "basis": basis, "probe_in_context": accuracy}


def evaluate_run(model, run: dict, text, probe_text, spans, lengths, distances, protocol, score_tokens, device, bar):
    """The perplexity, probe, loss-by-position and effective-context numbers of one run, for each of its methods.
    Lengths a learned-position model cannot reach are None ("n/a")."""
    longest, span, edges = max(lengths), spans.shape[1], position_bins(max(lengths))
    result = {"perplexity": {}, "probe": {}, "per_position": {}, "effective_context": {}}
    for method in run["methods"]:
        per_length, per_distance, per_position = {}, {}, []
        for length in lengths:
            per_length[str(length)] = None
            if fits(model, length):
                model.args = model.args.stretched(method, length)
                window_losses = []
                for tokens in row_blocks(text[:, -length:] if protocol == "fixed-target" else text, length, device):
                    if protocol == "fixed-target":
                        losses = token_losses(model, tokens)
                        targets = losses[:, -score_tokens:]
                    else:
                        losses = targets = sliding_losses(model, tokens, length)
                    window_losses += targets.mean(1).tolist()
                    if length == longest:  # the whole window in one forward: its loss at every position
                        per_position += [
                            [row[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])] for row in losses
                        ]
                    bar.update(len(tokens))
                loss = spread(window_losses)
                per_length[str(length)] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
            else:
                bar.update(len(text))
        reference = per_length[str(run["train_context"])]["perplexity"]
        for row in filter(None, per_length.values()):
            row["ratio"] = row["perplexity"] / reference
        for distance in distances:
            per_distance[str(distance)] = None
            if fits(model, distance + span):
                model.args = model.args.stretched(method, distance + span)
                accuracy, drop = probe_scores(model, probe_sequences(probe_text, spans, distance), distance, device)
                per_distance[str(distance)] = {"accuracy": spread(accuracy), "loss_drop": spread(drop)}
            bar.update(len(probe_text))
        result["perplexity"][method], result["probe"][method] = per_length, per_distance
        if per_position:
            by_bin = np.asarray(per_position)
            result["per_position"][method] = {"loss_mean": by_bin.mean(0).tolist(), "loss_std": by_bin.std(0).tolist()}
        result["effective_context"][method] = effective_context(per_length, per_distance, run["train_context"], span)
    return result


# ---------------------------------------------------------------- the report


def find_data_dir(config: dict, override: str | None) -> Path:
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = (config.get("data") or {}).get("dir")
        if not configured:
            raise UserError("config.json names no data.dir; pass --data DIR (a prepared dataset with a val split)")
        candidates = [Path(configured), Path(__file__).resolve().parent / configured]
    for path in candidates:
        if any(path.glob("val*.bin")) and (path / "meta.json").is_file():
            return path
    raise UserError(f"{candidates[0]} is not a prepared dataset with a val split; pass --data DIR")


def check_same_tokenizer(checkpoint: Path, data_dir: Path):
    """UserError when the dataset was tokenized by another tokenizer than the checkpoint's."""
    if not same_tokenizer(load_meta(data_dir).get("tokenizer_sha256"), checkpoint / "tokenizer.model"):
        raise UserError(f"{data_dir} was tokenized with another tokenizer than {checkpoint}/tokenizer.model")


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


def add_run_arguments(parser: ArgumentParser, several: bool = False):
    """The options that choose a run directory (or several, comma-separated) and how to load it (here and in
    generate.py's sampling command)."""
    what = "run directory (model.safetensors, config.json, tokenizer.model)"
    parser.add_argument("--checkpoint", required=True, help=what + (", or several, comma-separated" if several else ""))
    parser.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on CPU)")


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python generate.py extrapolate",
        description="How perplexity and a copy probe hold up past the training context, for each RoPE scaling "
        "method, on one run or side by side on several (--checkpoint a,b,c --out DIR).",
    )
    add_run_arguments(parser, several=True)
    parser.add_argument("--lengths", help="comma-separated context lengths (default: 1,2,4,8 × the training context)")
    parser.add_argument(
        "--methods",
        help="comma-separated RoPE scaling methods (default: none,linear,ntk,dynamic,yarn for RoPE runs, none for "
        "other position encodings)",
    )
    parser.add_argument(
        "--protocol",
        choices=("fixed-target", "sliding"),
        default="fixed-target",
        help="fixed-target (default): the same last tokens scored with each context length; "
        "sliding: every token, through windows moving by half their length",
    )
    parser.add_argument("--num-windows", type=int, default=8, help="validation windows (default 8)")
    parser.add_argument("--probes", type=int, default=16, help="copy-probe spans per distance (default 16)")
    parser.add_argument("--probe-span", type=int, default=16, help="random tokens in each probe span (default 16)")
    parser.add_argument("--data", help="prepared dataset (default: the first run's data.dir)")
    parser.add_argument("--seed", type=int, default=0, help="which windows and probe spans (default 0)")
    parser.add_argument("--out", help="output directory (default CHECKPOINT/extrapolation; required with several runs)")
    return parser


def load_runs(names: list[str], methods: list[str] | None, device, dtype) -> list[tuple[Transformer, dict]]:
    """(model, run description) for each run directory, all sharing one tokenizer; UserError otherwise, or where
    a RoPE scaling method is named for a model without RoPE."""
    runs, tokenizers = [], {}
    for name in names:
        model, config, _ = load_run(name, device, dtype)
        tokenizers.setdefault(tokenizer_sha256(Path(name) / "tokenizer.model"), name)
        if len(tokenizers) > 1:
            first, other = tokenizers.values()
            raise UserError(
                f"{first} and {other} have different tokenizers (tokenizer.model); runs compared together must share "
                "one, so that they score the same tokens"
            )
        position = model.args.position
        scaling = [m for m in methods or () if m != "none"]
        if position != "rope" and scaling:
            raise UserError(
                f"--methods {','.join(scaling)}: RoPE scaling applies to RoPE models only, and {name} uses {position} "
                "positions (leave --methods out, or pass --methods none)"
            )
        run = {
            "name": name,
            "position": position,
            "train_context": int((config.get("train") or {}).get("seq_len") or model.args.original_seq_len),
            "original_context": model.args.original_seq_len,  # what RoPE scaling stretches from
            "methods": methods or (list(DEFAULT_METHODS) if position == "rope" else ["none"]),
            "model": model.args.to_dict(),  # before the evaluation switches RoPE
            "config": config,
        }
        runs.append((model, run))
    return runs


def main(argv: list[str]) -> int:
    """The `extrapolate` command; argv is what follows `python generate.py extrapolate`."""
    args = parser().parse_args(argv)
    names = [name.rstrip("/") or name for name in parse_list(args.checkpoint, "--checkpoint")]
    if len({Path(name).resolve() for name in names}) < len(names):
        raise UserError(f"--checkpoint names a run twice: {args.checkpoint}")
    if len(names) > 1 and args.out is None:
        raise UserError("--out is required with several runs: the directory the comparison is written to")
    methods = parse_list(args.methods, "--methods") if args.methods else None
    unknown = [m for m in methods or () if m not in ROPE_SCALINGS]
    if unknown:
        raise UserError(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(ROPE_SCALINGS)})")
    for flag, value, least in (("--num-windows", args.num_windows, 1), ("--probes", args.probes, 1)):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, not {value}")
    if args.probe_span < 2:
        raise UserError(f"--probe-span must be >= 2, not {args.probe_span}")
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, not {args.seed}")
    device = pick_device(args.device)
    loaded = load_runs(names, methods, device, pick_dtype(args.dtype, device))
    runs = [run for _, run in loaded]
    contexts = [run["train_context"] for run in runs]
    lengths = parse_list(args.lengths, "--lengths", int) if args.lengths else [min(contexts) * k for k in (1, 2, 4, 8)]
    lengths = sorted(set(lengths) | set(contexts))
    score_tokens = min(64, min(contexts) // 2)
    if min(lengths) <= score_tokens:
        raise UserError(f"--lengths must all exceed {score_tokens} (the scored tokens)")
    data_dir = find_data_dir(runs[0]["config"], args.data)
    check_same_tokenizer(Path(names[0]), data_dir)
    out_dir = Path(args.out) if args.out else Path(names[0]) / "extrapolation"
    check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
    text = document_windows(data_dir, "val", max(lengths), args.num_windows, seed=args.seed)
    probe_text = document_windows(data_dir, "val", max(lengths), args.probes, seed=args.seed + 1)
    if text.max() >= min(model.args.vocab_size for model, _ in loaded):
        raise UserError(f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another tokenizer")
    spans = probe_spans(load_meta(data_dir), args.probes, args.probe_span, args.seed)
    distances = probe_distances(min(contexts), lengths, args.probe_span)
    edges = position_bins(max(lengths))
    start = time.perf_counter()
    work = sum(len(run["methods"]) * (len(lengths) * len(text) + len(distances) * len(spans)) for run in runs)
    with torch.inference_mode(), tqdm(total=work, desc="extrapolation", unit="sequence") as bar:
        for model, run in loaded:
            run.update(
                evaluate_run(
                    model, run, text, probe_text, spans, lengths, distances, args.protocol, score_tokens, device, bar
                )
            )
    report = {
        "command": ["python", "generate.py", "extrapolate", *argv],
        "data": str(data_dir),
        "lengths": lengths,
        "protocol": args.protocol,
        "num_windows": args.num_windows,
        "score_tokens": score_tokens,
        "probe": {"span": args.probe_span, "count": args.probes, "distances": distances},
        "per_position_edges": edges.tolist(),
        "per_position_tokens": (np.diff(edges) * args.num_windows).tolist(),
        "seed": args.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for run in runs],
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
    print(effective_line(report))
    print(f"wrote {out_dir}/extrapolation.json, .md and .png ({report['seconds']} s)")
    return 0
