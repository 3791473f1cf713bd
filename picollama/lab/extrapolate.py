"""Length extrapolation: switching a model's RoPE scaling, and how perplexity and a copy probe (runs trained on text)
or retrieval accuracy (runs trained on the retrieval task) hold up past the training context, for each scaling
method and each of several runs (the `python generate.py extrapolate` command)."""

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.loader import copy_vocabulary, document_windows, load_meta
from data.retrieval import RetrievalTask
from data.tokenizer import same_tokenizer, tokenizer_file, tokenizer_sha256
from model import ROPE_SCALINGS, Transformer
from picollama import REPO_ROOT
from picollama.checkpoint import load_model, load_run
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_device,
    add_out,
    add_run,
    add_seed,
    atomic_output,
    check_writable,
    comma_list,
    positive,
)
from picollama.convert import imported_run
from picollama.device import pick_device, pick_dtype
from picollama.lab.report import (
    BINS_PER_OCTAVE,
    MIN_BIN,
    effective_line,
    markdown_report,
    plot_report,
    retrieval_markdown,
    retrieval_plot,
)


def fits(model: Transformer, length: int) -> bool:
    """Whether the model can score a sequence of `length` tokens at all (the model's length policy)."""
    limit = model.args.position_limit
    return limit is None or length <= limit


def logits_and_losses(
    model: Transformer, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits (B, T-1, vocab) and cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it."""
    logits = model(tokens[:, :-1]).float()
    return logits, F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    return logits_and_losses(model, tokens)[1]


def sliding_losses(model: Transformer, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """token_losses over (1, T) tokens seen through windows of `context` tokens moving by context/2: each token
    after the first window is scored with at least context/2 tokens before it."""
    length = tokens.shape[1]
    stride = max(context // 2, 1)
    pieces = []
    start = 0
    scored = 1  # scored: the next target position
    while scored < length:
        end = min(start + context, length)
        pieces.append(token_losses(model, tokens[:, start:end])[:, scored - start - 1 :])
        scored = end
        start += stride
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
    return sorted(
        d for d in {train_len // 4, train_len // 2} | {n - span for n in lengths} if d >= span
    )


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


def probe_scores(
    model: Transformer, sequences: np.ndarray, distance: int, device
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of probe_sequences: top-1 accuracy on the repeat after its first token, and the loss drop in nats
    from the first occurrence to the repeat (over the same span-1 tokens of each)."""
    span = sequences.shape[1] - distance
    accuracy = []
    drop = []
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
        row = perplexity[str(length)]
        read = probe.get(str(length - span))
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


def evaluate_run(
    model,
    run: dict,
    text,
    probe_text,
    spans,
    lengths,
    distances,
    protocol,
    score_tokens,
    device,
    bar,
):
    """The perplexity, probe, loss-by-position and effective-context numbers of one run, for each of its methods.
    Lengths a learned-position model cannot reach are None ("n/a")."""
    longest = max(lengths)
    span = spans.shape[1]
    edges = position_bins(max(lengths))
    result = {"perplexity": {}, "probe": {}, "per_position": {}, "effective_context": {}}
    for method in run["methods"]:
        per_length = {}
        per_distance = {}
        per_position = []
        for length in lengths:
            per_length[str(length)] = None
            if fits(model, length):
                model.args = model.args.stretched(method, length)
                window_losses = []
                for tokens in row_blocks(
                    text[:, -length:] if protocol == "fixed-target" else text, length, device
                ):
                    if protocol == "fixed-target":
                        losses = token_losses(model, tokens)
                        targets = losses[:, -score_tokens:]
                    else:
                        losses = targets = sliding_losses(model, tokens, length)
                    window_losses += targets.mean(1).tolist()
                    if (
                        length == longest
                    ):  # the whole window in one forward: its loss at every position
                        per_position += [
                            [row[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])]
                            for row in losses
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
                accuracy, drop = probe_scores(
                    model, probe_sequences(probe_text, spans, distance), distance, device
                )
                per_distance[str(distance)] = {
                    "accuracy": spread(accuracy),
                    "loss_drop": spread(drop),
                }
            bar.update(len(probe_text))
        result["perplexity"][method] = per_length
        result["probe"][method] = per_distance
        if per_position:
            by_bin = np.asarray(per_position)
            result["per_position"][method] = {
                "loss_mean": by_bin.mean(0).tolist(),
                "loss_std": by_bin.std(0).tolist(),
            }
        result["effective_context"][method] = effective_context(
            per_length, per_distance, run["train_context"], span
        )
    return result


# ---------------------------------------------------------------- retrieval (runs trained on data.task = "retrieval")

RETRIEVAL_MULTIPLES = (1, 2, 4, 8, 16)  # the default lengths, × the training context
KEEPS = 0.5  # the effective context keeps at least this fraction of the in-context accuracy


def retrieval_task(config: dict) -> RetrievalTask:
    """The retrieval task a run was trained on, from its config.json's data section."""
    data = config.get("data") or {}
    defaults = RetrievalTask(
        64, 64, 8
    )  # config.py's defaults, for a config.json that leaves a key out
    return RetrievalTask(
        data.get("retrieval_keys", defaults.keys),
        data.get("retrieval_values", defaults.values),
        data.get("retrieval_pairs", defaults.pairs),
    )


def retrieval_distances(context: int, longest: int, pairs: int) -> list[int]:
    """Key-to-query distances, read in rows of the longest length: a quarter and half of the training context, and
    for each doubling of it up to the longest length the farthest that fits (even, at least 2·pairs)."""
    lengths = [context * 2**k for k in range(int(math.log2(longest / context)) + 1)] + [longest]
    wanted = {context // 4, context // 2} | {n - 2 * pairs for n in lengths}
    return sorted({d - d % 2 for d in wanted if 2 * pairs <= d - d % 2 <= longest - 2 * pairs})


def retrieval_scores(model: Transformer, batches, device) -> np.ndarray:
    """Per row of the (x, y) batches: the fraction of its queries whose value is the argmax of the logits."""
    scores = []
    for x, y in batches:
        logits = model(x.to(device))
        y = y.to(device)
        mask = y != -100
        hits = (logits.argmax(-1) == y) & mask
        scores.append((hits.sum(1) / mask.sum(1)).float())
    return torch.cat(scores).cpu().numpy()


def retrieval_effective(accuracy: dict, train_len: int) -> dict:
    """The longest tested length up to which every tested length keeps >= KEEPS of the in-context accuracy (at the
    training length); n/a (a learned table's end) stops it. None where the run retrieves under KEEPS in context."""
    reference = accuracy[str(train_len)]["mean"]
    if reference < KEEPS:
        return {"tokens": None, "in_context": reference}
    tokens = train_len
    for length in sorted(int(n) for n in accuracy if int(n) > train_len):
        cell = accuracy[str(length)]
        if cell is None or cell["mean"] < KEEPS * reference:
            break
        tokens = length
    return {"tokens": tokens, "in_context": reference}


def evaluate_retrieval(model: Transformer, run: dict, rows: dict, device, bar) -> dict:
    """Retrieval accuracy of one run by length and by key-query distance, for each of its methods, on the shared
    evaluation rows ({"length": {n: batches}, "distance": {d: batches}}, the latter in rows of the longest length)."""
    longest = max(rows["length"])
    result = {"accuracy": {}, "by_distance": {}, "effective_context": {}}
    for method in run["methods"]:
        cells = {}
        for kind, key_length in (("length", lambda n: n), ("distance", lambda d: longest)):
            cells[kind] = {}
            for key, batches in rows[kind].items():
                cells[kind][str(key)] = None
                if fits(model, key_length(key)):
                    model.args = model.args.stretched(method, key_length(key))
                    cells[kind][str(key)] = spread(retrieval_scores(model, batches, device))
                bar.update(sum(len(x) for x, _ in batches))
        result["accuracy"][method], result["by_distance"][method] = (
            cells["length"],
            cells["distance"],
        )
        result["effective_context"][method] = retrieval_effective(
            cells["length"], run["train_context"]
        )
    return result


def retrieval_study(loaded: list, args, argv: list[str], device) -> dict:
    """The retrieval report of runs trained on one retrieval task: the same seeded rows for every run and method."""
    tasks = {
        (task.keys, task.values, task.pairs)
        for task in (retrieval_task(run["config"]) for _, run in loaded)
    }
    if len(tasks) > 1:
        raise UserError(
            "--run: the runs were trained on different retrieval tasks (keys, values or pairs)"
        )
    task = retrieval_task(loaded[0][1]["config"])
    context = min(run["train_context"] for _, run in loaded)
    lengths = args.lengths or [context * k for k in RETRIEVAL_MULTIPLES]
    lengths = sorted(set(lengths) | {run["train_context"] for _, run in loaded})
    if min(lengths) < task.min_length():
        raise UserError(
            f"--lengths must all be at least {task.min_length()} (a row with every key and its query)"
        )
    distances = retrieval_distances(context, max(lengths), task.pairs)
    count = max(1, args.retrieval_rows // 64)
    size = min(64, args.retrieval_rows)
    rows = {
        "length": {n: task.fixed_batches(count, size, n, seed=args.seed + 1) for n in lengths},
        "distance": {
            d: task.fixed_batches(count, size, max(lengths), d, seed=args.seed + 2)
            for d in distances
        },
    }
    start = time.perf_counter()
    work = (
        sum(len(run["methods"]) for _, run in loaded)
        * count
        * size
        * (len(lengths) + len(distances))
    )
    with torch.inference_mode(), tqdm(total=work, desc="retrieval", unit="row") as bar:
        for model, run in loaded:
            run.update(evaluate_retrieval(model, run, rows, device, bar))
    return {
        "kind": "retrieval",
        "command": ["python", "generate.py", *argv],
        "task": {
            "keys": task.keys,
            "values": task.values,
            "pairs": task.pairs,
            "chance": 1 / task.values,
        },
        "lengths": lengths,
        "distances": distances,
        "rows": count * size,
        "keeps": KEEPS,
        "seed": args.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for _, run in loaded],
    }


# ---------------------------------------------------------------- the command


def find_data_dir(config: dict, override: str | None) -> Path:
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = (config.get("data") or {}).get("dir")
        if not configured:
            raise UserError(
                "config.json names no data.dir; pass --data DIR (a prepared dataset with a val split)"
            )
        candidates = [Path(configured), REPO_ROOT / configured]
    for path in candidates:
        if any(path.glob("val*.bin")) and (path / "meta.json").is_file():
            return path
    raise UserError(f"{candidates[0]} is not a prepared dataset with a val split; pass --data DIR")


def check_same_tokenizer(checkpoint: Path, data_dir: Path):
    """UserError when the dataset was tokenized by another tokenizer than the checkpoint's."""
    tokenizer = tokenizer_file(checkpoint)
    if tokenizer is not None and not same_tokenizer(
        load_meta(data_dir).get("tokenizer_sha256"), tokenizer
    ):
        raise UserError(f"{data_dir} was tokenized with another tokenizer than {tokenizer}")


def add_arguments(parser: ArgumentParser):
    """The flags of `python generate.py extrapolate` (generate.py builds the parser)."""
    parser.description = (
        "How perplexity and a copy probe (runs trained on text) or retrieval accuracy (runs trained on the retrieval "
        "task) hold up past the training context, for each RoPE scaling method, on one run or side by side on "
        "several (--run a,b,c --out DIR)."
    )
    add_run(parser, several=True)
    add_device(parser)
    parser.add_argument(
        "--lengths",
        type=comma_list(positive()),
        help="context lengths (default: 1,2,4,8 × the training context; 1,2,4,8,16 × for retrieval-task runs)",
    )
    parser.add_argument(
        "--methods",
        type=comma_list(choices=ROPE_SCALINGS),
        help="RoPE scaling methods, comma-separated (default: every one of model.ROPE_SCALINGS for RoPE runs, none for "
        "other position encodings)",
    )
    parser.add_argument(
        "--protocol",
        choices=("fixed-target", "sliding"),
        default="fixed-target",
        help="fixed-target (default): the same last tokens scored with each context length; "
        "sliding: every token, through windows moving by half their length",
    )
    parser.add_argument(
        "--num-windows", type=positive(), default=8, help="validation windows (default 8)"
    )
    parser.add_argument(
        "--probes", type=positive(), default=16, help="copy-probe spans per distance (default 16)"
    )
    parser.add_argument(
        "--probe-span", type=int, default=16, help="random tokens in each probe span (default 16)"
    )
    parser.add_argument("--data", help="prepared dataset (default: the first run's data.dir)")
    add_seed(parser, "which windows and probe spans")
    parser.add_argument(
        "--retrieval-rows",
        type=positive(),
        default=256,
        help="retrieval-task runs: evaluation rows per length and per distance (default 256)",
    )
    add_out(parser, "output directory (default RUN/extrapolation; required with several runs)")


def trained_task(name: str) -> str:
    """data.task in a run directory's config.json ("text" where it names none or cannot be read: loading says why)."""
    try:
        return (json.loads((Path(name) / "config.json").read_text()).get("data") or {}).get(
            "task", "text"
        )
    except (OSError, ValueError, AttributeError):
        return "text"


def load_runs(
    names: list[str], methods: list[str] | None, device, dtype
) -> list[tuple[Transformer, dict]]:
    """(model, run description) for each run directory, all sharing one tokenizer; UserError otherwise, or where
    a RoPE scaling method is named for a model without RoPE."""
    runs = []
    tokenizers = {}
    tasks = {}
    for name in names:
        tasks.setdefault(trained_task(name), name)
    if len(tasks) > 1:
        raise UserError(
            f"{' and '.join(tasks.values())} were trained on different tasks (data.task {' and '.join(tasks)}); "
            "compare runs of one task together"
        )
    for name in names:
        if "retrieval" in tasks:  # the retrieval task has no tokenizer
            model, config = load_model(name, device)
            model = model.to(dtype).eval()
        else:
            model, config, _ = load_run(name, device, dtype)
            tokenizers.setdefault(tokenizer_sha256(tokenizer_file(name)), name)
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
            "task": trained_task(name),
            "position": position,
            "train_context": int(
                (config.get("train") or {}).get("seq_len") or model.args.original_seq_len
            ),
            "original_context": model.args.original_seq_len,  # what RoPE scaling stretches from
            "methods": methods or (list(ROPE_SCALINGS) if position == "rope" else ["none"]),
            "model": model.args.to_dict(),  # before the evaluation switches RoPE
            "config": config,
        }
        runs.append((model, run))
    return runs


def text_study(loaded: list, args, argv: list[str], device, out_dir: Path) -> dict:
    """The perplexity, copy-probe and loss-by-position report of runs trained on text, on the same windows."""
    runs = [run for _, run in loaded]
    contexts = [run["train_context"] for run in runs]
    lengths = args.lengths or [min(contexts) * k for k in (1, 2, 4, 8)]
    lengths = sorted(set(lengths) | set(contexts))
    score_tokens = min(64, min(contexts) // 2)
    if min(lengths) <= score_tokens:
        raise UserError(f"--lengths must all exceed {score_tokens} (the scored tokens)")
    data_dir = find_data_dir(runs[0]["config"], args.data)
    check_same_tokenizer(Path(runs[0]["name"]), data_dir)
    check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
    text = document_windows(data_dir, "val", max(lengths), args.num_windows, seed=args.seed)
    probe_text = document_windows(data_dir, "val", max(lengths), args.probes, seed=args.seed + 1)
    if text.max() >= min(model.args.vocab_size for model, _ in loaded):
        raise UserError(
            f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another tokenizer"
        )
    spans = probe_spans(load_meta(data_dir), args.probes, args.probe_span, args.seed)
    distances = probe_distances(min(contexts), lengths, args.probe_span)
    edges = position_bins(max(lengths))
    start = time.perf_counter()
    work = sum(
        len(run["methods"]) * (len(lengths) * len(text) + len(distances) * len(spans))
        for run in runs
    )
    with torch.inference_mode(), tqdm(total=work, desc="extrapolation", unit="sequence") as bar:
        for model, run in loaded:
            run.update(
                evaluate_run(
                    model,
                    run,
                    text,
                    probe_text,
                    spans,
                    lengths,
                    distances,
                    args.protocol,
                    score_tokens,
                    device,
                    bar,
                )
            )
    return {
        "command": ["python", "generate.py", *argv],
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


def run(args, argv: list[str]) -> int:
    """The `extrapolate` command, on generate.py's parsed flags; argv: generate.py's, for the report."""
    names = [str(path) for path in args.run]
    if len({path.resolve() for path in args.run}) < len(names):
        raise UserError(f"--run names a run twice: {','.join(names)}")
    if len(names) > 1 and args.out is None:
        raise UserError(
            "--out is required with several runs: the directory the comparison is written to"
        )
    methods = args.methods
    if args.probe_span < 2:
        raise UserError(f"--probe-span must be >= 2, not {args.probe_span}")
    names = [str(imported_run(Path(name))) for name in names]  # a .gguf file, an HF directory
    device = pick_device(args.device)
    loaded = load_runs(names, methods, device, pick_dtype(args.dtype, device))
    out_dir = Path(args.out) if args.out else Path(names[0]) / "extrapolation"
    if loaded[0][1]["task"] == "retrieval":
        check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
        report = retrieval_study(loaded, args, argv, device)
        markdown = retrieval_markdown(report)
        plot = retrieval_plot
    else:
        report = text_study(loaded, args, argv, device, out_dir)
        markdown = markdown_report(report)
        plot = plot_report
    out_dir.mkdir(parents=True, exist_ok=True)
    # all three or none: each is renamed into place only once every one has been written
    with (
        atomic_output(out_dir / "extrapolation.json") as json_path,
        atomic_output(out_dir / "extrapolation.md") as md_path,
        atomic_output(out_dir / "extrapolation.png") as png_path,
    ):
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        md_path.write_text(markdown)
        plot(report, png_path)
    print(markdown)
    print(effective_line(report))
    print(f"wrote {out_dir}/extrapolation.json, .md and .png ({report['seconds']} s)")
    return 0
