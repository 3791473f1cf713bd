"""Length extrapolation (`python generate.py extrapolate`): how perplexity and a copy probe (runs
trained on text) or retrieval accuracy (runs trained on the retrieval task) hold up past the
training context, for each RoPE scaling method and each of several runs."""

import json
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.loader import copy_vocabulary, document_windows, load_meta
from data.retrieval import RetrievalTask
from data.tokenizer import same_tokenizer, tokenizer_sha256
from model import ROPE_SCALINGS, ModelArgs, Transformer
from picollama import REPO_ROOT, cli
from picollama.checkpoint import load_model, load_run
from picollama.cli import UserError, atomic_output, check_writable, comma_list, positive
from picollama.config import DataConfig
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

TEXT_MULTIPLES = (1, 2, 4, 8)  # the default lengths of a text report, × the training context
RETRIEVAL_MULTIPLES = (1, 2, 4, 8, 16)  # and of a retrieval report
KEEPS = 0.5  # retrieval's effective context keeps at least this fraction of the in-context accuracy


@dataclass
class Options:
    """What `python generate.py extrapolate` measures and how: its flags (add_arguments), with
    their defaults."""

    lengths: list[int] | None = None  # None: TEXT_MULTIPLES or RETRIEVAL_MULTIPLES × the context
    methods: list[str] | None = None  # None: every scaling each run can run with
    protocol: str = "fixed-target"
    num_windows: int = 8
    probes: int = 16
    probe_span: int = 16
    data: str | None = None  # None: the first run's data.dir
    seed: int = 0
    retrieval_rows: int = 256
    device: str = "auto"
    dtype: str = "auto"

    @classmethod
    def from_args(cls, args) -> "Options":
        return cls(**{option.name: getattr(args, option.name) for option in fields(cls)})

    def command(self, runs: list[Path], out: Path | None) -> list[str]:
        """The `python generate.py extrapolate` command line of these options (for a report to
        record; flags at their defaults left out)."""
        command = ["python", "generate.py", "extrapolate", "--run", ",".join(map(str, runs))]
        command += ["--out", str(out)] if out is not None else []
        for option in fields(self):
            value = getattr(self, option.name)
            if value != option.default:
                text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
                command += ["--" + option.name.replace("_", "-"), text]
        return command


def fits(model: Transformer, length: int) -> bool:
    """Whether the model can score `length` tokens at all (the model's length policy)."""
    limit = model.args.position_limit
    return limit is None or length <= limit


def scalings(args: ModelArgs) -> list[str]:
    """The methods of model.ROPE_SCALINGS a model runs with: those its ModelArgs accept (every one
    for RoPE; "none" alone for positions with nothing to scale)."""
    usable = []
    for method in ROPE_SCALINGS:
        try:
            args.stretched(method, args.max_seq_len)
        except ValueError:
            continue
        usable.append(method)
    return usable


def logits_and_losses(
    model: Transformer, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits (B, T-1, vocab) and cross-entropy (B, T-1) of each of tokens[:, 1:] given
    everything before it."""
    logits = model(tokens[:, :-1]).float()
    return logits, F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    return logits_and_losses(model, tokens)[1]


def sliding_losses(model: Transformer, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """token_losses over (1, T) tokens seen through windows of `context` tokens moving by
    context/2: each token after the first window is scored with at least context/2 before it."""
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
    """The rows of array in consecutive blocks, as tensors on device, of about 8192 tokens of
    forwards `length` long (which bounds the (rows, length, vocab) logits)."""
    rows = max(1, 8192 // length)
    for start in range(0, len(array), rows):
        yield torch.from_numpy(array[start : start + rows]).to(device)


# ---------------------------------------------------------------- the copy probe


def probe_distances(train_len: int, lengths: list[int], span: int) -> list[int]:
    """Span-to-repeat distances: train_len/4, train_len/2, and for each tested length n the
    farthest that fits n tokens, n - span (so that the probe reads at every length); never below
    span (no overlap)."""
    wanted = {train_len // 4, train_len // 2} | {n - span for n in lengths}
    return sorted(d for d in wanted if d >= span)


def probe_spans(meta: dict, count: int, span: int, seed: int) -> np.ndarray:
    """(count, span) random token ids, uniform over the non-special vocabulary: no language prior
    predicts them."""
    vocabulary = copy_vocabulary(meta)
    return vocabulary[np.random.default_rng(seed).integers(0, len(vocabulary), size=(count, span))]


def probe_sequences(text: np.ndarray, spans: np.ndarray, distance: int) -> np.ndarray:
    """Rows of real text, distance + span tokens long, with each row's span at its start and again
    `distance` tokens later."""
    span = spans.shape[1]
    sequences = text[:, : distance + span].copy()
    sequences[:, :span] = spans
    sequences[:, distance:] = spans
    return sequences


def probe_scores(
    model: Transformer, sequences: np.ndarray, distance: int, device
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of probe_sequences: top-1 accuracy on the repeat after its first token, and the loss
    drop in nats from the first occurrence to the repeat (over the same span-1 tokens of each)."""
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
    """Edges of the loss-by-position bins over a window's longest-1 predictions (index i has i+1
    tokens of context): BINS_PER_OCTAVE per doubling of the position, and at least MIN_BIN
    positions wide, so that every point averages several tokens and later ones, where the curve
    changes slowly, many."""
    edges = [0]
    while edges[-1] < longest - 1:
        grown = round((edges[-1] + 1) * 2 ** (1 / BINS_PER_OCTAVE)) - 1
        edges.append(min(max(grown, edges[-1] + MIN_BIN), longest - 1))
    return np.array(edges)


def effective_context(perplexity: dict, probe: dict, train_len: int, span: int) -> dict:
    """The longest tested length up to which every tested length keeps perplexity within 5% of its
    training-length value and the probe (at the farthest distance that fits the length) within 10
    points of its accuracy at the training length; perplexity alone where the probe reads under
    20% there."""
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


@dataclass
class TextRows:
    """What every run of a text report is scored on: validation windows (`text`) at each length,
    probe rows (`probe_text` with `spans`) at each distance, and the loss-by-position bins."""

    text: np.ndarray
    probe_text: np.ndarray
    spans: np.ndarray
    lengths: list[int]
    distances: list[int]
    protocol: str
    score_tokens: int
    edges: np.ndarray


def length_losses(model, method: str, rows: TextRows, device, bar) -> tuple[dict, list]:
    """The loss and perplexity at each length under `method` (None where the model cannot reach
    it), and each window's mean loss in each position bin at the longest length."""
    longest = max(rows.lengths)
    fixed = rows.protocol == "fixed-target"
    per_length = {}
    per_position = []
    for length in rows.lengths:
        per_length[str(length)] = None
        if not fits(model, length):
            bar.update(len(rows.text))
            continue
        model.args = model.args.stretched(method, length)
        window_losses = []
        for tokens in row_blocks(rows.text[:, -length:] if fixed else rows.text, length, device):
            if fixed:
                losses = token_losses(model, tokens)
                targets = losses[:, -rows.score_tokens :]
            else:
                losses = targets = sliding_losses(model, tokens, length)
            window_losses += targets.mean(1).tolist()
            if length == longest:  # the whole window in one forward: its loss at every position
                bins = list(zip(rows.edges[:-1], rows.edges[1:]))
                per_position += [[row[a:b].mean().item() for a, b in bins] for row in losses]
            bar.update(len(tokens))
        loss = spread(window_losses)
        per_length[str(length)] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
    return per_length, per_position


def probe_reads(model, method: str, rows: TextRows, device, bar) -> dict:
    """The copy probe's accuracy and loss drop at each distance under `method` (None where the
    model cannot reach it)."""
    span = rows.spans.shape[1]
    per_distance = {}
    for distance in rows.distances:
        per_distance[str(distance)] = None
        if fits(model, distance + span):
            model.args = model.args.stretched(method, distance + span)
            sequences = probe_sequences(rows.probe_text, rows.spans, distance)
            accuracy, drop = probe_scores(model, sequences, distance, device)
            per_distance[str(distance)] = {"accuracy": spread(accuracy), "loss_drop": spread(drop)}
        bar.update(len(rows.probe_text))
    return per_distance


def evaluate_run(model, run: dict, rows: TextRows, device, bar) -> dict:
    """The perplexity, probe, loss-by-position and effective-context numbers of one run, for each
    of its methods. Lengths a learned-position model cannot reach are None ("n/a")."""
    context = run["train_context"]
    result = {"perplexity": {}, "probe": {}, "per_position": {}, "effective_context": {}}
    for method in run["methods"]:
        per_length, per_position = length_losses(model, method, rows, device, bar)
        reference = per_length[str(context)]["perplexity"]
        for row in filter(None, per_length.values()):
            row["ratio"] = row["perplexity"] / reference
        per_distance = probe_reads(model, method, rows, device, bar)
        result["perplexity"][method] = per_length
        result["probe"][method] = per_distance
        if per_position:
            by_bin = np.asarray(per_position)
            result["per_position"][method] = {
                "loss_mean": by_bin.mean(0).tolist(),
                "loss_std": by_bin.std(0).tolist(),
            }
        span = rows.spans.shape[1]
        result["effective_context"][method] = effective_context(
            per_length, per_distance, context, span
        )
    return result


# ---------------------------------------------------------------- retrieval (data.task "retrieval")


def retrieval_task(config: dict) -> RetrievalTask:
    """The retrieval task a run was trained on, from its config.json's data section (config.py's
    defaults for the keys it leaves out)."""
    data = config.get("data") or {}
    defaults = DataConfig()
    return RetrievalTask(
        data.get("retrieval_keys", defaults.retrieval_keys),
        data.get("retrieval_values", defaults.retrieval_values),
        data.get("retrieval_pairs", defaults.retrieval_pairs),
    )


def retrieval_distances(context: int, longest: int, pairs: int) -> list[int]:
    """Key-to-query distances, read in rows of the longest length: a quarter and half of the
    training context, and for each doubling of it up to the longest length the farthest that fits
    (even, at least 2·pairs)."""
    lengths = [context * 2**k for k in range(int(math.log2(longest / context)) + 1)] + [longest]
    wanted = {context // 4, context // 2} | {n - 2 * pairs for n in lengths}
    return sorted({d - d % 2 for d in wanted if 2 * pairs <= d - d % 2 <= longest - 2 * pairs})


def retrieval_scores(model: Transformer, batches, device) -> np.ndarray:
    """Per row of the (x, y) batches: the fraction of its queries whose value is the argmax of the
    logits."""
    scores = []
    for x, y in batches:
        logits = model(x.to(device))
        y = y.to(device)
        mask = y != -100
        hits = (logits.argmax(-1) == y) & mask
        scores.append((hits.sum(1) / mask.sum(1)).float())
    return torch.cat(scores).cpu().numpy()


def retrieval_effective(accuracy: dict, train_len: int) -> dict:
    """The longest tested length up to which every tested length keeps >= KEEPS of the in-context
    accuracy (at the training length); n/a (a learned table's end) stops it. None where the run
    retrieves under KEEPS in context."""
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


def retrieval_cells(model, method: str, rows: dict, row_length: int | None, device, bar) -> dict:
    """Accuracy under `method` for each key of rows ({length or distance: batches}), in rows
    `row_length` long (None: the key is the length); None where the model cannot reach it."""
    cells = {}
    for key, batches in rows.items():
        length = row_length or key
        cells[str(key)] = None
        if fits(model, length):
            model.args = model.args.stretched(method, length)
            cells[str(key)] = spread(retrieval_scores(model, batches, device))
        bar.update(sum(len(x) for x, _ in batches))
    return cells


def evaluate_retrieval(model: Transformer, run: dict, rows: dict, device, bar) -> dict:
    """Retrieval accuracy of one run by length and by key-query distance, for each of its methods,
    on the shared evaluation rows ({"length": {n: batches}, "distance": {d: batches}}, the latter
    in rows of the longest length)."""
    longest = max(rows["length"])
    result = {"accuracy": {}, "by_distance": {}, "effective_context": {}}
    for method in run["methods"]:
        accuracy = retrieval_cells(model, method, rows["length"], None, device, bar)
        by_distance = retrieval_cells(model, method, rows["distance"], longest, device, bar)
        result["accuracy"][method] = accuracy
        result["by_distance"][method] = by_distance
        result["effective_context"][method] = retrieval_effective(accuracy, run["train_context"])
    return result


def retrieval_rows(
    task: RetrievalTask, lengths: list[int], context: int, count: int, size: int, seed
):
    """The rows every run and method is scored on, `count` batches of `size`: {"length": {n:
    batches}, "distance": {d: batches in rows of the longest length}} (retrieval_distances)."""
    longest = max(lengths)
    distances = retrieval_distances(context, longest, task.pairs)
    return {
        "length": {n: task.fixed_batches(count, size, n, seed=seed + 1) for n in lengths},
        "distance": {
            d: task.fixed_batches(count, size, longest, d, seed=seed + 2) for d in distances
        },
    }


def retrieval_study(loaded: list, options: Options, command: list[str], device) -> dict:
    """The retrieval report of runs trained on one retrieval task: the same seeded rows for every
    run and method."""
    tasks = {(t.keys, t.values, t.pairs) for t in (retrieval_task(r["config"]) for _, r in loaded)}
    if len(tasks) > 1:
        raise UserError(
            "--run: the runs were trained on different retrieval tasks (keys, values or pairs)"
        )
    task = retrieval_task(loaded[0][1]["config"])
    contexts = {run["train_context"] for _, run in loaded}
    lengths = options.lengths or [min(contexts) * k for k in RETRIEVAL_MULTIPLES]
    lengths = sorted(set(lengths) | contexts)
    if min(lengths) < task.min_length():
        raise UserError(
            f"--lengths must all be at least {task.min_length()} (a row with every key and its "
            "query)"
        )
    count = max(1, options.retrieval_rows // 64)
    size = min(64, options.retrieval_rows)
    rows = retrieval_rows(task, lengths, min(contexts), count, size, options.seed)
    distances = list(rows["distance"])
    start = time.perf_counter()
    methods = sum(len(run["methods"]) for _, run in loaded)
    work = methods * count * size * (len(lengths) + len(distances))
    with torch.inference_mode(), tqdm(total=work, desc="retrieval", unit="row") as bar:
        for model, run in loaded:
            run.update(evaluate_retrieval(model, run, rows, device, bar))
    return {
        "kind": "retrieval",
        "command": command,
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
        "seed": options.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for _, run in loaded],
    }


# ---------------------------------------------------------------- text (data.task "text")


def find_data_dir(config: dict, override: str | None) -> Path:
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = (config.get("data") or {}).get("dir")
        if not configured:
            raise UserError(
                "config.json names no data.dir; pass --data DIR (a prepared dataset with a val "
                "split)"
            )
        candidates = [Path(configured), REPO_ROOT / configured]
    for path in candidates:
        if any(path.glob("val*.bin")) and (path / "meta.json").is_file():
            return path
    raise UserError(f"{candidates[0]} is not a prepared dataset with a val split; pass --data DIR")


def check_same_tokenizer(checkpoint: Path, data_dir: Path):
    """UserError when the dataset was tokenized by another tokenizer than the checkpoint's."""
    meta = load_meta(data_dir)
    if not same_tokenizer(meta.get("tokenizer_sha256"), checkpoint / "tokenizer.model"):
        raise UserError(
            f"{data_dir} was tokenized with another tokenizer than {checkpoint}/tokenizer.model"
        )


def text_rows(loaded: list, options: Options, out_dir: Path) -> tuple[TextRows, Path]:
    """The windows and probe rows every run and method is scored on, and the dataset they come
    from; UserError, before any evaluation, for lengths, data or an output that cannot serve."""
    runs = [run for _, run in loaded]
    contexts = [run["train_context"] for run in runs]
    lengths = options.lengths or [min(contexts) * k for k in TEXT_MULTIPLES]
    lengths = sorted(set(lengths) | set(contexts))
    score_tokens = min(64, min(contexts) // 2)
    if min(lengths) <= score_tokens:
        raise UserError(f"--lengths must all exceed {score_tokens} (the scored tokens)")
    data_dir = find_data_dir(runs[0]["config"], options.data)
    check_same_tokenizer(Path(runs[0]["name"]), data_dir)
    check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
    longest, seed = max(lengths), options.seed
    text = document_windows(data_dir, "val", longest, options.num_windows, seed=seed)
    probe_text = document_windows(data_dir, "val", longest, options.probes, seed=seed + 1)
    if text.max() >= min(model.args.vocab_size for model, _ in loaded):
        raise UserError(
            f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another "
            "tokenizer"
        )
    spans = probe_spans(load_meta(data_dir), options.probes, options.probe_span, seed)
    distances = probe_distances(min(contexts), lengths, options.probe_span)
    protocol, edges = options.protocol, position_bins(longest)
    rows = TextRows(text, probe_text, spans, lengths, distances, protocol, score_tokens, edges)
    return rows, data_dir


def text_study(loaded: list, options: Options, command: list[str], device, out_dir: Path) -> dict:
    """The perplexity, copy-probe and loss-by-position report of runs trained on text, on the same
    windows."""
    rows, data_dir = text_rows(loaded, options, out_dir)
    start = time.perf_counter()
    reads = len(rows.lengths) * len(rows.text) + len(rows.distances) * len(rows.spans)
    work = sum(len(run["methods"]) * reads for _, run in loaded)
    with torch.inference_mode(), tqdm(total=work, desc="extrapolation", unit="sequence") as bar:
        for model, run in loaded:
            run.update(evaluate_run(model, run, rows, device, bar))
    return {
        "command": command,
        "data": str(data_dir),
        "lengths": rows.lengths,
        "protocol": options.protocol,
        "num_windows": options.num_windows,
        "score_tokens": rows.score_tokens,
        "probe": {"span": options.probe_span, "count": options.probes, "distances": rows.distances},
        "per_position_edges": rows.edges.tolist(),
        "per_position_tokens": (np.diff(rows.edges) * options.num_windows).tolist(),
        "seed": options.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for _, run in loaded],
    }


# ---------------------------------------------------------------- the runs


def trained_task(name: str) -> str:
    """data.task in a run directory's config.json ("text" where it names none or cannot be read:
    loading says why)."""
    try:
        config = json.loads((Path(name) / "config.json").read_text())
        return (config.get("data") or {}).get("task", "text")
    except (OSError, ValueError, AttributeError):
        return "text"


def describe(name: str, model: Transformer, config: dict, methods: list[str] | None) -> dict:
    """A run's entry in the report, before its numbers; UserError where `methods` names a RoPE
    scaling the model cannot run with (scalings)."""
    position = model.args.position
    usable = scalings(model.args)
    refused = [m for m in methods or () if m not in usable]
    if refused:
        raise UserError(
            f"--methods {','.join(refused)}: RoPE scaling applies to RoPE models only, and {name} "
            f"uses {position} positions (leave --methods out, or pass --methods "
            f"{','.join(usable)})"
        )
    return {
        "name": name,
        "task": trained_task(name),
        "position": position,
        "train_context": int(
            (config.get("train") or {}).get("seq_len") or model.args.original_seq_len
        ),
        "original_context": model.args.original_seq_len,  # what RoPE scaling stretches from
        "methods": methods or usable,
        "model": model.args.to_dict(),  # before the evaluation switches RoPE
        "config": config,
    }


def load_runs(
    names: list[str], methods: list[str] | None, device, dtype
) -> list[tuple[Transformer, dict]]:
    """(model, run description) for each run directory, all of one task and sharing one tokenizer;
    UserError otherwise, or where a RoPE scaling method is named for a model without RoPE."""
    tasks = {}
    for name in names:
        tasks.setdefault(trained_task(name), name)
    if len(tasks) > 1:
        raise UserError(
            f"{' and '.join(tasks.values())} were trained on different tasks (data.task "
            f"{' and '.join(tasks)}); compare runs of one task together"
        )
    runs = []
    tokenizers = {}
    for name in names:
        if "retrieval" in tasks:  # the retrieval task has no tokenizer
            model, config = load_model(name, device)
            model = model.to(dtype).eval()
        else:
            model, config, _ = load_run(name, device, dtype)
            tokenizers.setdefault(tokenizer_sha256(Path(name) / "tokenizer.model"), name)
        if len(tokenizers) > 1:
            first, other = tokenizers.values()
            raise UserError(
                f"{first} and {other} have different tokenizers (tokenizer.model); runs compared "
                "together must share one, so that they score the same tokens"
            )
        runs.append((model, describe(name, model, config, methods)))
    return runs


# ---------------------------------------------------------------- the command


def add_arguments(parser: cli.ArgumentParser):
    """The flags of `python generate.py extrapolate` (generate.py builds the parser)."""
    parser.description = (
        "How perplexity and a copy probe (runs trained on text) or retrieval accuracy (runs "
        "trained on the retrieval task) hold up past the training context, for each RoPE scaling "
        "method, on one run or side by side on several (--run a,b,c --out DIR)."
    )
    cli.add_run(parser, several=True)
    cli.add_device(parser)
    text, retrieval = (",".join(map(str, k)) for k in (TEXT_MULTIPLES, RETRIEVAL_MULTIPLES))
    parser.add_argument(
        "--lengths",
        type=comma_list(positive()),
        help=f"context lengths (default: {text} × the training context; {retrieval} × for "
        "retrieval-task runs)",
    )
    parser.add_argument(
        "--methods",
        type=comma_list(choices=ROPE_SCALINGS),
        help="RoPE scaling methods, comma-separated (default: every one of model.ROPE_SCALINGS "
        "for RoPE runs, none for other position encodings)",
    )
    parser.add_argument(
        "--protocol",
        choices=("fixed-target", "sliding"),
        default=Options.protocol,
        help="fixed-target (default): the same last tokens scored with each context length; "
        "sliding: every token, through windows moving by half their length",
    )
    for flag, what in (
        ("num_windows", "validation windows"),
        ("probes", "copy-probe spans per distance"),
        ("retrieval_rows", "retrieval-task runs: evaluation rows per length and per distance"),
    ):
        default = getattr(Options, flag)
        option = "--" + flag.replace("_", "-")
        parser.add_argument(
            option, type=positive(), default=default, help=f"{what} (default {default})"
        )
    parser.add_argument(
        "--probe-span",
        type=int,
        default=Options.probe_span,
        help=f"random tokens in each probe span (default {Options.probe_span})",
    )
    parser.add_argument("--data", help="prepared dataset (default: the first run's data.dir)")
    cli.add_seed(parser, "which windows and probe spans", default=Options.seed)
    cli.add_out(parser, "output directory (default RUN/extrapolation; required with several runs)")


def write_report(report: dict, markdown: str, plot, out_dir: Path):
    """extrapolation.json, .md and .png in out_dir: all three or none (each is renamed into place
    only once every one has been written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (
        atomic_output(out_dir / "extrapolation.json") as json_path,
        atomic_output(out_dir / "extrapolation.md") as md_path,
        atomic_output(out_dir / "extrapolation.png") as png_path,
    ):
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        md_path.write_text(markdown)
        plot(report, png_path)


def extrapolation(runs: list[Path], out: Path | None, options: Options, command: list[str]) -> dict:
    """Evaluate run directories (one task, one tokenizer) past their training context, write
    extrapolation.json, .md and .png to `out` (default RUN/extrapolation) and print the Markdown;
    the report, which records `command` as the command line that made it."""
    names = [str(path) for path in runs]
    if len({Path(path).resolve() for path in runs}) < len(names):
        raise UserError(f"--run names a run twice: {','.join(names)}")
    if len(names) > 1 and out is None:
        raise UserError(
            "--out is required with several runs: the directory the comparison is written to"
        )
    if options.probe_span < 2:
        raise UserError(f"--probe-span must be >= 2, not {options.probe_span}")
    device = pick_device(options.device)
    loaded = load_runs(names, options.methods, device, pick_dtype(options.dtype, device))
    out_dir = Path(out) if out else Path(names[0]) / "extrapolation"
    if loaded[0][1]["task"] == "retrieval":
        check_writable(out_dir / "extrapolation.json")  # the folder, and writing inside it
        report = retrieval_study(loaded, options, command, device)
        markdown = retrieval_markdown(report)
        write_report(report, markdown, retrieval_plot, out_dir)
    else:
        report = text_study(loaded, options, command, device, out_dir)
        markdown = markdown_report(report)
        write_report(report, markdown, plot_report, out_dir)
    print(markdown)
    print(effective_line(report))
    print(f"wrote {out_dir}/extrapolation.json, .md and .png ({report['seconds']} s)")
    return report


def run(args, argv: list[str]) -> int:
    """The `extrapolate` command, on generate.py's parsed flags; argv: generate.py's, for the
    report."""
    extrapolation(args.run, args.out, Options.from_args(args), ["python", "generate.py", *argv])
    return 0
