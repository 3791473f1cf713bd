"""Markdown tables of a length-extrapolation report.

They show perplexity, probes, passkeys or retrieval. This module only formats a finished report.
It runs no model."""

import math
from pathlib import Path

BINS_PER_OCTAVE, MIN_BIN = 3, 8  # For the loss-by-position curve.
METHODS_TEXT = (
    "RoPE runs: static methods use factor n / the context RoPE was trained at, `dynamic` factor 1; "
    "other position encodings are scored as they are (`none`)"
)


def short_number(x: float) -> str:
    """3 significant digits, or `>10^k` for blow-ups of 1000 and more."""
    if not math.isfinite(x):
        return "inf"
    return f">10^{int(math.log10(x))}" if x >= 1000 else f"{x:.3g}"


def ratio_text(x: float) -> str:
    return short_number(x) if x >= 1000 or not math.isfinite(x) else f"{x:.2f}×"


def perplexity_cell(row: dict | None) -> str:
    """Perplexity ± its standard error over windows (as a percentage), and the ratio to the
    training length."""
    if row is None:
        return "n/a"
    error = 100 * math.expm1(row["loss"]["sem"])
    return f"{short_number(row['perplexity'])} ±{error:.0f}% ({ratio_text(row['ratio'])})"


def probe_cell(cell: dict | None) -> str:
    """Accuracy ± its standard error over probes, and the loss drop in nats."""
    if cell is None:
        return "n/a"
    accuracy = cell["accuracy"]
    return f"{accuracy['mean']:.0%} ±{100 * accuracy['sem']:.0f} ({cell['loss_drop']['mean']:+.1f})"


def accuracy_cell(cell: dict | None) -> str:
    """Accuracy ± its standard error over rows."""
    return "n/a" if cell is None else f"{cell['mean']:.0%} ±{100 * cell['sem']:.0f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def run_rows(runs: list[dict]):
    """(first header columns, [(run, method)], label(run, method)), a row per run and method.

    The run column appears only when there are several runs."""
    several = len(runs) > 1

    def label(run, method):
        return [f"`{run['name']}`", method] if several else [method]

    return (
        (["run", "method"] if several else ["method"]),
        [(r, m) for r in runs for m in r["methods"]],
        label,
    )


def run_table(report: dict, columns: list[str], key: str, xs: list[int], cell) -> list[str]:
    """A table of a line per run and method: cell(run[key][method][str(x)]) for each x of xs,
    under `columns`."""
    first, keys, label = run_rows(report["runs"])
    rows = [label(run, m) + [cell(run[key][m][str(x)]) for x in xs] for run, m in keys]
    return table(first + columns, rows)


def protocol_text(report: dict) -> str:
    windows = report["num_windows"]
    longest = max(report["lengths"])
    if report["protocol"] == "fixed-target":
        return (
            f"the last {report['score_tokens']} tokens of {windows} validation windows of "
            f"{longest} tokens (each inside one document), scored with the last n tokens as context"
        )
    return (
        f"every token of {windows} validation windows of {longest} tokens, scored through windows "
        "of n tokens moving by n/2"
    )


def names(runs: list[dict]) -> str:
    return ", ".join(f"`{run['name']}`" for run in runs)


def run_title(run: dict) -> str:
    return Path(run["name"]).name or run["name"]


def probe_section(report: dict, distances: list, span: int, inside: list) -> list[str]:
    """The copy probe's paragraph and table: nothing when it was not run (--probes 0)."""
    if not distances:
        return []
    return [
        f"Copy probe: a span of {span} random token ids (uniform over the non-special vocabulary) "
        "at the start of real validation text, repeated d tokens later; top-1 accuracy on the "
        f"repeat after its first token ± its standard error over {report['probe']['count']} "
        "probes, and (in brackets) the loss drop in nats from the first occurrence to the repeat. "
        f"d ≤ {max(inside, default=0)} lies inside the training context.",
        "",
        *run_table(report, [f"d={d}" for d in distances], "probe", distances, probe_cell),
        "",
    ]


def passkey_cell(cell: dict | None) -> str:
    """Passkey accuracy over every depth, then by depth, and the true key's mean margin."""
    if cell is None:
        return "n/a"
    depths = "/".join(f"{c['accuracy']:.0%}" for c in cell["by_depth"].values())
    return f"{cell['accuracy']:.0%} ({depths}; {cell['margin']:+.1f})"


def passkey_section(report: dict) -> list[str]:
    """The passkey paragraph and table: nothing when it was not run (--passkeys 0)."""
    passkey = report.get("passkey")
    if not passkey:
        return []
    lengths = report["lengths"]
    first, keys, label = run_rows(report["runs"])
    effective = [str(run["passkey_effective"][m] or "none") for run, m in keys]
    rows = [
        label(run, m) + [passkey_cell(run["passkey"][m][str(n)]) for n in lengths]
        for run, m in keys
    ]
    depths = "/".join(f"{d:.0%}" for d in passkey["depths"])
    return [
        f"Passkey: a random five-digit key in real validation text at depths {depths} of it, "
        f"{passkey['count']} rows per length and depth; accuracy is how often the true key's "
        f"log-likelihood after the question beats all {passkey['distractors']} distractor keys' "
        f"(chance {1 / (passkey['distractors'] + 1):.0%}): over every depth (by depth; the true "
        f"key's mean margin in nats over the best distractor). Effective passkey length: the "
        f"longest length up to which accuracy stays >= {passkey['threshold']:.0%}.",
        "",
        *table(
            first + [str(n) for n in lengths] + ["effective"],
            [r + [e] for r, e in zip(rows, effective)],
        ),
        "",
    ]


def markdown_report(report: dict) -> str:
    runs, lengths, probe = report["runs"], report["lengths"], report["probe"]
    contexts = sorted({run["train_context"] for run in runs})
    windows = report["num_windows"]
    distances, span = probe["distances"], probe["span"]
    inside = [d for d in distances if d + span <= min(contexts)]
    tokens = report["per_position_tokens"]

    lines = [
        f"# Length extrapolation of {names(runs)}",
        "",
        f"Training context {', '.join(map(str, contexts))} tokens. Protocol "
        f"`{report['protocol']}`: {protocol_text(report)}. {METHODS_TEXT}.",
        "",
        f"Perplexity ± its standard error over the {windows} windows (ratio to the run's training "
        "length):",
        "",
        *run_table(report, [f"{n}" for n in lengths], "perplexity", lengths, perplexity_cell),
        "",
        *probe_section(report, distances, span, inside),
        *passkey_section(report),
        *key_token_section(report),
        "Effective context: the longest tested length up to which perplexity stays within 5% of "
        "its training-length value and the probe (its farthest repeat that fits) within 10 points "
        "of its in-context accuracy; with passkeys, beside it the passkey's (its accuracy held at "
        "the threshold, RULER's kind):",
        "",
        *effective_table(report, with_basis=True),
        "",
        f"Loss by position (the plot), over the {windows} windows of {max(lengths)} tokens: "
        f"{BINS_PER_OCTAVE} bins per doubling of the position, at least {MIN_BIN} positions wide; "
        f"each point averages its bin's width × {windows} tokens, from {tokens[0]:,} (the first) "
        f"to {tokens[-1]:,} (the last).",
    ]
    return "\n".join(lines) + "\n"


def accuracy_effective(report: dict) -> tuple[str, str] | None:
    """(column, run key) of the report's effective context by an accuracy threshold.

    This is RULER's kind. It uses retrieval accuracy, or passkey accuracy where passkeys were
    scored. None for an older report, or with --passkeys 0."""
    if report.get("kind") == "retrieval":
        if "threshold" not in report:
            return None
        return f"accuracy ≥ {report['threshold']:.0%}", "accuracy_effective"
    if report.get("passkey"):
        return f"passkey ≥ {report['passkey']['threshold']:.0%}", "passkey_effective"
    return None


def effective_table(report: dict, with_basis: bool) -> list[str]:
    """Effective context both ways, a row per run and method.

    First by the report's own rule: a perplexity band, or a share of the in-context retrieval
    accuracy. Then by an accuracy threshold (accuracy_effective), where the report has one."""
    first, keys, label = run_rows(report["runs"])
    threshold = accuracy_effective(report)
    rows = []
    for run, m in keys:
        effective = run["effective_context"][m]
        rows.append(
            label(run, m)
            + [str(run["train_context"]), str(effective["tokens"] or "none")]
            + ([str(run[threshold[1]][m] or "none")] if threshold else [])
            + ([effective["basis"]] if with_basis else [])
        )
    columns = ["training context", "effective context"] + ([threshold[0]] if threshold else [])
    return table(first + columns + (["basis"] if with_basis else []), rows)


def key_token_cell(cell: dict | None) -> str:
    """Key-token perplexity ± its standard error over the key tokens, and its ratio to the
    training length's."""
    if cell is None:
        return "n/a"
    error = 100 * math.expm1(cell["loss"]["sem"])
    return f"{short_number(cell['perplexity'])} ±{error:.0f}% ({ratio_text(cell['ratio'])})"


def key_token_section(report: dict) -> list[str]:
    """The LongPPL-style paragraph and table: nothing for a report made before it."""
    found = report.get("key_tokens")
    if not found:
        return []
    what = (
        f"Key-token perplexity (LongPPL-style, Fang et al. 2025): perplexity on the scored tokens "
        f"whose loss falls by more than {found['gain']:g} nats from {found['short']} tokens of "
        f"context to {found['long']} and ends below {found['confident']:g} nats (log-probability "
        f"> −{found['confident']:g}), as judged by the run and method that finds the most such "
        "tokens"
    )
    if not found["count"]:
        return [f"{what}: no key token among the {found['scored']:,} scored tokens.", ""]
    name, method = found["evaluator"]
    lengths = report["lengths"]
    return [
        f"{what} (`{name}` with {method}): {found['count']} of the {found['scored']:,} scored "
        f"tokens; ± its standard error over them (ratio to {found['short']} tokens).",
        "",
        *run_table(report, [str(n) for n in lengths], "key_token", lengths, key_token_cell),
        "",
    ]


def retrieval_markdown(report: dict) -> str:
    runs, lengths, distances, task = (
        report["runs"],
        report["lengths"],
        report["distances"],
        report["task"],
    )
    context = min(run["train_context"] for run in runs)
    keeps = f"{report['keeps']:.0%}"
    by_length = [f"{n} ({n / context:g}×)" for n in lengths]

    lines = [
        f"# Retrieval past the training context of {names(runs)}",
        "",
        f"Multi-query associative recall (data/retrieval.py): {task['pairs']} key-value pairs "
        f"from {task['keys']} keys and {task['values']} values, each key queried once later in "
        f"the row; accuracy (top-1 on the queried value; chance {task['chance']:.1%}) ± its "
        f"standard error over {report['rows']} seeded rows per cell, the same rows for every run "
        f"and method. {METHODS_TEXT}; learned positions read n/a past their table.",
        "",
        f"By length n (training context {context}): the key block anywhere in the row, the "
        "queries at its end, so that distances run up to n:",
        "",
        *run_table(report, by_length, "accuracy", lengths, accuracy_cell),
        "",
        f"By key-query distance d, in rows of {max(lengths)} tokens:",
        "",
        *run_table(report, [f"d={d}" for d in distances], "by_distance", distances, accuracy_cell),
        "",
        "Effective context from retrieval: the longest tested length up to which every tested "
        f"length keeps at least {keeps} of the run's accuracy at its training length (none where "
        f"that accuracy is under {keeps}), and beside it RULER's kind, up to which the accuracy "
        "itself stays at the threshold:",
        "",
        *effective_table(report, with_basis=False),
    ]
    return "\n".join(lines) + "\n"


def effective_line(report: dict) -> str:
    """The effective contexts, in one line per run."""
    return "\n".join(
        f"effective context of {run['name']} (trained at {run['train_context']}): "
        + ", ".join(
            f"{m} {run['effective_context'][m]['tokens'] or 'none'}" for m in run["methods"]
        )
        for run in report["runs"]
    )
