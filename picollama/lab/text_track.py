"""`generate.py extrapolate` on runs trained on text.

At each length it scores perplexity, a copy probe, loss by position and, if asked, passkeys.
Runs trained on the retrieval task go to retrieval_track.py."""

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.loader import copy_vocabulary, document_windows, load_meta
from data.tokenizer import same_tokenizer, tokenizer_file
from model import ModelArgs, Transformer, rope_frequencies
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.outputs import check_writable
from picollama.components.length import length_dependent, stretched, uses_rope
from picollama.components.registry import WINDOWED
from picollama.lab.cost import Forwards, block_rows, check_cost
from picollama.lab.longppl import key_tokens
from picollama.lab.passkey import (
    DEPTHS,
    DISTRACTORS,
    THRESHOLD,
    effective_length,
    passkey_read,
    passkey_rows,
)
from picollama.lab.report import BINS_PER_OCTAVE, MIN_BIN
from picollama.lab.runs import Options, fits, spread
from picollama.lab.scoring import losses_and_hits, row_blocks, sliding_losses, token_losses
from picollama.run_files import read_tokenizer

TEXT_MULTIPLES = (1, 2, 4, 8)  # Default lengths of a text report, × the training context.


# ---------------------------------------------------------------- the copy probe


def probe_distances(train_len: int, lengths: list[int], span: int) -> list[int]:
    """Span-to-repeat distances: train_len/4, train_len/2, and n - span for each tested length n.

    n - span is the farthest that fits n tokens, so the probe reads at every length. No distance
    is below span, so the copies never overlap."""
    wanted = {train_len // 4, train_len // 2} | {n - span for n in lengths}
    return sorted(d for d in wanted if d >= span)


def probe_spans(meta: dict, count: int, span: int, seed: int) -> np.ndarray:
    """(count, span) random token ids, uniform over the non-special vocabulary.
    No language prior predicts them, so only copying can."""
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
    """Per row of probe_sequences: top-1 accuracy on the repeat, and the loss drop in nats.
    Both use the span's last span-1 tokens. The drop is from the first copy to the repeat."""
    span = sequences.shape[1] - distance
    accuracy = []
    drop = []
    for tokens in row_blocks(sequences, sequences.shape[1], device):
        losses, hits = losses_and_hits(model, tokens)
        accuracy.append(hits[:, distance : distance + span - 1].float().mean(1))
        drop.append((losses[:, : span - 1] - losses[:, distance : distance + span - 1]).mean(1))
    return torch.cat(accuracy).cpu().numpy(), torch.cat(drop).cpu().numpy()


def position_bins(longest: int) -> np.ndarray:
    """Edges of the loss-by-position bins over a window's longest-1 predictions.

    Index i has i+1 tokens of context. There are BINS_PER_OCTAVE bins per doubling, each at least
    MIN_BIN wide. So every point averages several tokens. Later points, where the curve changes
    slowly, average many."""
    edges = [0]
    while edges[-1] < longest - 1:
        grown = round((edges[-1] + 1) * 2 ** (1 / BINS_PER_OCTAVE)) - 1
        edges.append(min(max(grown, edges[-1] + MIN_BIN), longest - 1))
    return np.array(edges)


def effective_context(perplexity: dict, probe: dict, train_len: int, span: int) -> dict:
    """The longest length up to which every tested length stays near the training length.

    Perplexity must stay within 5% of its value there. The probe, at the farthest distance that
    fits, must stay within 10 points of its accuracy there. If the probe reads under 20% at the
    training length, perplexity alone decides."""
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
    elif not probe:
        basis = "perplexity only: no copy probe (--probes 0)"
    elif accuracy is None:
        basis = "perplexity only: no probe fits the training context"
    else:
        basis = f"perplexity only: the probe reads {accuracy:.0%} in context"
    return {"tokens": tokens, "basis": basis, "probe_in_context": accuracy}


@dataclass
class TextRows:
    """What every run of a text report is scored on.
    That is validation windows (`text`) at each length, probe rows (`probe_text` with `spans`) at
    each distance, and the loss-by-position bins."""

    text: np.ndarray
    probe_text: np.ndarray
    spans: np.ndarray
    lengths: list[int]
    distances: list[int]
    protocol: str
    score_tokens: int
    edges: np.ndarray
    passkeys: dict = field(default_factory=dict)  # passkey.passkey_rows, empty if unscored.


def forward_key(args: ModelArgs, length: int) -> tuple:
    """A key for what a forward of `length` tokens computes, so equal forwards run once.
    It holds the model's args without the RoPE scaling's name, plus the exact frequencies and
    attention scale that scaling gives at this length. Every static scaling at factor 1 gives
    plain RoPE, and so does a WINDOWED method at factor 1 (model.py does not call it). Past it,
    they move the positions attention sees, not the frequencies. So their key is the whole args,
    and their forwards are their own."""
    if args.rope_scaling in WINDOWED and args.rope_factor > 1:
        return length, repr(args), None
    frequencies = None
    if uses_rope(args):
        inv_freq, scale = rope_frequencies(args, length)
        frequencies = (inv_freq.numpy().tobytes(), scale)
        if length_dependent(args) and length > args.original_seq_len:
            # Dynamic NTK follows each forward's own end, not `length`. So its frequencies here
            # say nothing, and it shares no forward.
            frequencies = ("dynamic", length)
    return length, repr(replace(args, rope_scaling="none", rope_factor=1.0)), frequencies


def window_losses(model, rows: TextRows, length: int, device, bar) -> tuple[list, list, np.ndarray]:
    """Losses of the windows with `length` tokens of context, in three forms.
    First, each window's mean loss on its scored tokens. Second, at the longest length, its mean
    loss in each position bin. Third, the loss of each scored token (windows, scored tokens), for
    the key tokens of longppl.py."""
    fixed = rows.protocol == "fixed-target"
    means, per_position, scored = [], [], []
    for tokens in row_blocks(rows.text[:, -length:] if fixed else rows.text, length, device):
        if fixed:
            losses = token_losses(model, tokens)
            targets = losses[:, -rows.score_tokens :]
        else:
            losses = targets = sliding_losses(model, tokens, length)
        means += targets.mean(1).tolist()
        scored.append(targets.cpu().numpy())
        if length == max(rows.lengths):
            bins = list(zip(rows.edges[:-1], rows.edges[1:]))
            per_position += [[row[a:b].mean().item() for a, b in bins] for row in losses]
        bar.update(len(tokens))
    return means, per_position, np.concatenate(scored)


def length_losses(model, method: str, rows: TextRows, device, bar, memo: dict) -> tuple:
    """Loss and perplexity at each length under `method`, with window_losses' other two forms.

    A length the model cannot reach gets None. `memo` keeps the scores by forward_key. So
    methods that compute the same forward at a length run it once."""
    per_length, scored = {}, {}
    per_position = []
    for length in rows.lengths:
        per_length[str(length)] = scored[str(length)] = None
        if not fits(model, length):
            bar.update(len(rows.text))
            continue
        model.args = stretched(model.args, method, length)
        key = forward_key(model.args, length)
        if key in memo:
            bar.update(len(rows.text))
        else:
            memo[key] = window_losses(model, rows, length, device, bar)
        means, positions, scored[str(length)] = memo[key]
        per_position = positions or per_position
        loss = spread(means)
        per_length[str(length)] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
    return per_length, per_position, scored


def probe_reads(model, method: str, rows: TextRows, device, bar, memo: dict) -> dict:
    """The copy probe's accuracy and loss drop at each distance under `method`.
    None where the model cannot reach it. `memo` is as in length_losses."""
    span = rows.spans.shape[1]
    per_distance = {}
    for distance in rows.distances:
        per_distance[str(distance)] = None
        if fits(model, distance + span):
            model.args = stretched(model.args, method, distance + span)
            key = ("probe", distance, forward_key(model.args, distance + span))
            if key not in memo:
                sequences = probe_sequences(rows.probe_text, rows.spans, distance)
                memo[key] = probe_scores(model, sequences, distance, device)
            accuracy, drop = memo[key]
            per_distance[str(distance)] = {"accuracy": spread(accuracy), "loss_drop": spread(drop)}
        bar.update(len(rows.probe_text))
    return per_distance


def passkey_reads(model, method: str, rows: TextRows, device, bar, memo: dict) -> dict:
    """Passkey accuracy and margin at each length under `method`, overall and by depth.
    None where the model cannot reach the length. `memo` is as in length_losses."""
    per_length = {}
    for length in rows.lengths:
        per_length[str(length)] = None
        keyed = [(depth, keys) for (n, depth), keys in rows.passkeys.items() if n == length]
        if keyed and fits(model, length):
            model.args = stretched(model.args, method, length)
            by_depth = {}
            for depth, keys in keyed:
                key = ("passkey", depth, forward_key(model.args, length))
                if key not in memo:
                    memo[key] = passkey_read(model, keys, device)
                by_depth[str(depth)] = memo[key]
            cells = list(by_depth.values())
            per_length[str(length)] = {
                "accuracy": float(np.mean([c["accuracy"] for c in cells])),
                "margin": float(np.mean([c["margin"] for c in cells])),
                "by_depth": by_depth,
            }
        bar.update(sum(len(keys) for _, keys in keyed))
    return per_length


def evaluate_run(model, run: dict, rows: TextRows, device, bar, scored: dict) -> dict:
    """Perplexity, probe, loss-by-position and effective context of one run, for each method.

    Token losses go into `scored` as {method: {length: token losses}}, for the key tokens.
    Lengths a learned-position model cannot reach are None ("n/a")."""
    context = run["train_context"]
    result = {"perplexity": {}, "probe": {}, "per_position": {}, "effective_context": {}}
    memo = {}
    for method in run["methods"]:
        per_length, per_position, scored[method] = length_losses(
            model, method, rows, device, bar, memo
        )
        reference = per_length[str(context)]["perplexity"]
        for row in filter(None, per_length.values()):
            row["ratio"] = row["perplexity"] / reference
        per_distance = probe_reads(model, method, rows, device, bar, memo)
        if rows.passkeys:
            passkeys = passkey_reads(model, method, rows, device, bar, memo)
            result.setdefault("passkey", {})[method] = passkeys
            result.setdefault("passkey_effective", {})[method] = effective_length(passkeys)
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
    tokenizer = tokenizer_file(checkpoint)
    recorded = load_meta(data_dir).get("tokenizer_sha256")
    if tokenizer is not None and not same_tokenizer(recorded, tokenizer):
        raise UserError(f"{data_dir} was tokenized with another tokenizer than {tokenizer}")


def text_work(model, run: dict, lengths: list, distances: list, options: Options) -> list:
    """The Forwards that evaluate_run makes for one run.
    For each method, the windows at each length and probes at each distance that it can reach."""
    longest = max(lengths)
    reads = []  # (length, rows, forwards of each block of rows).
    for length in lengths:
        slides = 1  # Sliding windows of `length` move by length/2 over the longest length.
        if options.protocol == "sliding":
            slides += math.ceil((longest - length) / max(length // 2, 1))
        reads.append((length, options.num_windows, slides))
    reads += [(d + options.probe_span, options.probes, 1) for d in distances]
    reads += [(n, options.passkeys * len(DEPTHS), 1) for n in lengths if options.passkeys]
    work = []
    for length, rows, slides in reads:
        if fits(model, length):
            block = block_rows(length, rows)
            count = math.ceil(rows / block) * slides * len(run["methods"])
            work.append(Forwards(block, length, count))
    return work


def tokens_by_flag(lengths: list, distances: list, options: Options) -> dict:
    """The token ids (int64, in memory) made by each flag that sets rows.
    --num-windows makes windows and --probes spans. --passkeys makes filler and rows at every
    length and depth."""
    longest = max(lengths)
    return {
        "--num-windows": longest * options.num_windows,
        "--probes": longest * options.probes,
        "--passkeys": options.passkeys * (longest + len(DEPTHS) * sum(lengths)),
    }


def text_rows(loaded: list, options: Options, out_dir: Path, device) -> tuple[TextRows, Path]:
    """The windows and probe rows every run and method is scored on, and their dataset.

    Bad lengths, data or output are refused before any evaluation. So is an evaluation too large
    (cost.check_cost)."""
    runs = [run for _, run in loaded]
    contexts = [run["train_context"] for run in runs]
    lengths = options.lengths or [min(contexts) * k for k in TEXT_MULTIPLES]
    lengths = sorted(set(lengths) | set(contexts))
    score_tokens = min(64, min(contexts) // 2)
    if min(lengths) <= score_tokens:
        raise UserError(f"--lengths must all exceed {score_tokens} (the scored tokens)")
    data_dir = find_data_dir(runs[0]["config"], options.data)
    check_same_tokenizer(Path(runs[0]["name"]), data_dir)
    check_writable(out_dir / "extrapolation.json")  # The folder, and files in it.
    longest, seed = max(lengths), options.seed
    distances = probe_distances(min(contexts), lengths, options.probe_span)
    if options.probes and not distances:  # Else the probe is dropped, as if --probes 0.
        raise UserError(
            f"--probe-span {options.probe_span} does not fit: a probe holds its span twice "
            f"within the longest length, {longest} tokens, so at most {longest // 2}"
        )
    distances = distances if options.probes else []
    document_windows(data_dir, "val", longest, 1)  # UserError if no document is that long.
    work = [text_work(model, run, lengths, distances, options) for model, run in loaded]
    tokens = tokens_by_flag(lengths, distances, options)
    flag = max(tokens, key=tokens.get)  # A refusal names the flag behind most of the work.
    check_cost(loaded, work, 8 * sum(tokens.values()), options, device, flag, losses_and_hits)
    text = document_windows(data_dir, "val", longest, options.num_windows, seed=seed)
    probe_text = document_windows(data_dir, "val", longest, options.probes, seed=seed + 1)
    if text.max() >= min(model.args.vocab_size for model, _ in loaded):
        raise UserError(
            f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another "
            "tokenizer"
        )
    spans = probe_spans(load_meta(data_dir), options.probes, options.probe_span, seed)
    protocol, edges = options.protocol, position_bins(longest)
    rows = TextRows(text, probe_text, spans, lengths, distances, protocol, score_tokens, edges)
    if options.passkeys:  # Real text around the keys. All runs share the first's tokenizer.
        filler = document_windows(data_dir, "val", longest, options.passkeys, seed=seed + 2)
        tokenizer = read_tokenizer(tokenizer_file(Path(runs[0]["name"])))
        rows.passkeys = passkey_rows(tokenizer, filler, lengths, seed)
    return rows, data_dir


def add_key_tokens(loaded: list, scored: dict, short: int, long: int) -> dict:
    """Find the key tokens (longppl.key_tokens) between the `short` and `long` lengths.
    `short` is the training context. Each run's perplexity on them by method and length goes in
    its "key_token"."""
    found, cells = key_tokens(scored, short, long)
    if found["evaluator"] is not None:
        index, method = found["evaluator"]
        found["evaluator"] = [loaded[index][1]["name"], method]
    for (index, method), by_length in cells.items():
        loaded[index][1].setdefault("key_token", {})[method] = by_length
    return found


def text_study(loaded: list, options: Options, command: list[str], device, out_dir: Path) -> dict:
    """The perplexity, copy-probe and loss-by-position report of runs trained on text.
    All runs are scored on the same windows."""
    rows, data_dir = text_rows(loaded, options, out_dir, device)
    start = time.perf_counter()
    reads = len(rows.lengths) * len(rows.text) + len(rows.distances) * len(rows.spans)
    reads += sum(map(len, rows.passkeys.values()))
    work = sum(len(run["methods"]) * reads for _, run in loaded)
    scored = {}  # {(run, method): {length: token losses}}.
    with torch.inference_mode(), tqdm(total=work, desc="extrapolation", unit="sequence") as bar:
        for index, (model, run) in enumerate(loaded):
            by_method = {}
            run.update(evaluate_run(model, run, rows, device, bar, by_method))
            scored |= {(index, method): losses for method, losses in by_method.items()}
    context = min(run["train_context"] for _, run in loaded)
    found = add_key_tokens(loaded, scored, context, max(rows.lengths))
    return {
        "command": command,
        "data": str(data_dir),
        "lengths": rows.lengths,
        "protocol": options.protocol,
        "num_windows": options.num_windows,
        "score_tokens": rows.score_tokens,
        "probe": {"span": options.probe_span, "count": options.probes, "distances": rows.distances},
        "passkey": rows.passkeys
        and {
            "count": options.passkeys,
            "depths": DEPTHS,
            "distractors": DISTRACTORS,
            "threshold": THRESHOLD,
        },
        "key_tokens": found,
        "per_position_edges": rows.edges.tolist(),
        "per_position_tokens": (np.diff(rows.edges) * options.num_windows).tolist(),
        "seed": options.seed,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 1),
        "runs": [{k: v for k, v in run.items() if k != "config"} for _, run in loaded],
    }
