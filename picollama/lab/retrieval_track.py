"""`generate.py extrapolate` on runs trained on the retrieval task.

It scores accuracy by length and by key-query distance. Text runs go to text_track.py."""

import math
import time

import numpy as np
import torch
from tqdm import tqdm

from data.retrieval import RetrievalTask
from model import Transformer
from picollama.cli import UserError
from picollama.components.length import stretched
from picollama.config.training import DataConfig
from picollama.lab.cost import Forwards, check_cost, model_logits
from picollama.lab.passkey import THRESHOLD, effective_length
from picollama.lab.runs import Options, fits, spread

RETRIEVAL_MULTIPLES = (1, 2, 4, 8, 16)  # Default lengths of a retrieval report, × the context.
KEEPS = 0.5  # The effective context keeps at least this share of in-context accuracy.


def retrieval_task(config: dict) -> RetrievalTask:
    """The retrieval task a run was trained on, from its config.json's data section.

    Keys it leaves out take config.py's defaults."""
    data = config.get("data") or {}
    defaults = DataConfig()
    return RetrievalTask(
        data.get("retrieval_keys", defaults.retrieval_keys),
        data.get("retrieval_values", defaults.retrieval_values),
        data.get("retrieval_pairs", defaults.retrieval_pairs),
    )


def retrieval_distances(context: int, longest: int, pairs: int) -> list[int]:
    """Key-to-query distances, read in rows of the longest length.

    They are a quarter and a half of the training context. Then, for each doubling up to the
    longest length, the farthest that fits (even, at least 2·pairs)."""
    lengths = [context * 2**k for k in range(int(math.log2(longest / context)) + 1)] + [longest]
    wanted = {context // 4, context // 2} | {n - 2 * pairs for n in lengths}
    return sorted({d - d % 2 for d in wanted if 2 * pairs <= d - d % 2 <= longest - 2 * pairs})


def retrieval_scores(model: Transformer, batches, device) -> np.ndarray:
    """Per row of the (x, y) batches: the fraction of its queries whose value is the argmax of the
    logits."""
    scores = []
    for x, y in batches:
        logits = model_logits(model, x.to(device))
        y = y.to(device)
        mask = y != -100
        hits = (logits.argmax(-1) == y) & mask
        scores.append((hits.sum(1) / mask.sum(1)).float())
    return torch.cat(scores).cpu().numpy()


def retrieval_effective(accuracy: dict, train_len: int) -> dict:
    """The longest length up to which every tested length keeps >= KEEPS of in-context accuracy.

    In-context means at the training length. An n/a cell (a learned table's end) stops it. None
    if the run retrieves under KEEPS even in context."""
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
    """Accuracy under `method` for each key of rows ({length or distance: batches}).

    Rows are `row_length` long, or the key's length for None. None where the model cannot reach
    it."""
    cells = {}
    for key, batches in rows.items():
        length = row_length or key
        cells[str(key)] = None
        if fits(model, length):
            model.args = stretched(model.args, method, length)
            cells[str(key)] = spread(retrieval_scores(model, batches, device))
        bar.update(sum(len(x) for x, _ in batches))
    return cells


def evaluate_retrieval(model: Transformer, run: dict, rows: dict, device, bar) -> dict:
    """Retrieval accuracy of one run by length and by key-query distance, for each method.

    All runs share the evaluation rows, {"length": {n: batches}, "distance": {d: batches}}. The
    distance rows have the longest length."""
    longest = max(rows["length"])
    result = {"accuracy": {}, "by_distance": {}, "effective_context": {}, "accuracy_effective": {}}
    for method in run["methods"]:
        accuracy = retrieval_cells(model, method, rows["length"], None, device, bar)
        by_distance = retrieval_cells(model, method, rows["distance"], longest, device, bar)
        result["accuracy"][method] = accuracy
        result["by_distance"][method] = by_distance
        result["effective_context"][method] = retrieval_effective(accuracy, run["train_context"])
        # RULER's kind holds the accuracy itself at THRESHOLD, not a share of in-context.
        result["accuracy_effective"][method] = effective_length(accuracy, "mean")
    return result


def retrieval_rows(
    task: RetrievalTask, lengths: list, distances: list, count: int, size: int, seed
):
    """The rows every run and method is scored on, `count` batches of `size`.

    Returns {"length": {n: batches}, "distance": {d: batches}}. Distance rows have the longest
    length (see retrieval_distances)."""
    longest = max(lengths)
    return {
        "length": {n: task.fixed_batches(count, size, n, seed=seed + 1) for n in lengths},
        "distance": {
            d: task.fixed_batches(count, size, longest, d, seed=seed + 2) for d in distances
        },
    }


def retrieval_plan(loaded: list, options: Options) -> tuple[RetrievalTask, list[int]]:
    """The retrieval task the runs were trained on, and the lengths they are scored at.

    UserError for runs of different tasks, or a length too short for a row."""
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
    return task, lengths


def retrieval_work(model, run: dict, lengths: list, distances: list, count: int, size: int):
    """The Forwards that evaluate_retrieval makes for one run.

    For each method, `count` batches of `size` rows at each length and distance it can reach."""
    longest = max(lengths)
    reads = [(n, 1) for n in lengths] + [(longest, len(distances))]
    count *= len(run["methods"])
    return [Forwards(size, n, count * k) for n, k in reads if k and fits(model, n)]


def retrieval_study(loaded: list, options: Options, command: list[str], device) -> dict:
    """The retrieval report of runs trained on one retrieval task.

    Every run and method gets the same seeded rows. An evaluation too large is refused before it
    starts (cost.check_cost)."""
    task, lengths = retrieval_plan(loaded, options)
    count = max(1, options.retrieval_rows // 64)
    size = min(64, options.retrieval_rows)
    context = min(run["train_context"] for _, run in loaded)
    distances = retrieval_distances(context, max(lengths), task.pairs)
    work = [retrieval_work(model, run, lengths, distances, count, size) for model, run in loaded]
    ids = 16 * count * size * (sum(lengths) + len(distances) * max(lengths))  # x, y in int64.
    check_cost(loaded, work, ids, options, device, "--retrieval-rows")
    rows = retrieval_rows(task, lengths, distances, count, size, options.seed)
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
        "threshold": THRESHOLD,
        "seed": options.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for _, run in loaded],
    }
