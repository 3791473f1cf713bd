"""The length-extrapolation report (text_track.py and retrieval_track.py compute it): Markdown
tables, the effective-context line and the plots, of perplexity and the copy probe (runs trained on
text) or of retrieval accuracy (runs trained on the retrieval task)."""

import math
import re
from pathlib import Path

import numpy as np

from model import ROPE_SCALINGS
from picollama.cli import UserError

BINS_PER_OCTAVE, MIN_BIN = 3, 8  # of the loss-by-position curve
METHODS_TEXT = (
    "RoPE runs: static methods use factor n / the context RoPE was trained at, `dynamic` factor 1; "
    "other position encodings are scored as they are (`none`)"
)


def short_number(x: float) -> str:
    """3 significant digits; `>10^k` for blow-ups of 1000 and more."""
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
    """(first header columns, [(run, method)], label(run, method)): one row per run and method,
    with the run column only when there are several runs."""
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
    """(column, run key) of the effective context by an accuracy threshold (RULER's kind) that a
    report holds: retrieval accuracy, or passkey accuracy where passkeys were scored; None
    otherwise (an older report, or --passkeys 0)."""
    if report.get("kind") == "retrieval":
        if "threshold" not in report:
            return None
        return f"accuracy ≥ {report['threshold']:.0%}", "accuracy_effective"
    if report.get("passkey"):
        return f"passkey ≥ {report['passkey']['threshold']:.0%}", "passkey_effective"
    return None


def effective_table(report: dict, with_basis: bool) -> list[str]:
    """Effective context both ways, a row per run and method: the report's own rule (perplexity
    band, or share of the in-context retrieval accuracy) and, where the report has one, an
    accuracy threshold (accuracy_effective)."""
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


# ---------------------------------------------------------------- across seeds


def seed_metric(report: dict) -> tuple[str, str, bool]:
    """What the seeds of a study are compared on: (report key, cell field, higher is better)."""
    if report.get("kind") == "retrieval":
        return "accuracy", "mean", True
    return "perplexity", "perplexity", False


def seed_cell(values: list[float]) -> dict:
    """Mean and spread (min and max) of one cell's values across seeds."""
    return {
        "mean": float(np.mean(values)),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def separated(a: dict, b: dict) -> bool:
    """Whether two cells' min-max ranges across seeds do not overlap (an ordering is called)."""
    return a["min"] > b["max"] or b["min"] > a["max"]


def tiers(cells: dict, higher: bool) -> list[list]:
    """The keys of cells ({key: seed_cell}) in tiers, best first: ranges that overlap, directly or
    through others, share a tier, so that every member of a tier is separated from (better than)
    every member of the tiers after it, and no order is called within one."""
    merged = []  # [low, high, keys], by low
    for key in sorted(cells, key=lambda k: (cells[k]["min"], cells[k]["max"])):
        cell = cells[key]
        if merged and cell["min"] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], cell["max"])
            merged[-1][2].append(key)
        else:
            merged.append([cell["min"], cell["max"], [key]])
    groups = [sorted(keys, key=lambda k: cells[k]["mean"], reverse=higher) for *_, keys in merged]
    return groups[::-1] if higher else groups


def seeds_summary(report: dict, groups: dict[str, list[str]]) -> dict:
    """The study's cells across seeds: for each recipe run (groups: {name: its seeds' folder
    names}) and method, mean, min and max over the seeds at each length (None where a seed has no
    value), and at each length the (run, method) pairs in tiers (tiers)."""
    key, field, higher = seed_metric(report)
    by_name = {run_title(run): run for run in report["runs"]}
    cells = {}
    for name, folders in groups.items():
        seeds = [by_name[folder] for folder in folders]
        for method in seeds[0]["methods"]:
            for n in map(str, report["lengths"]):
                values = [run[key][method][n] for run in seeds]
                if None not in values:
                    cells.setdefault(n, {})[(name, method)] = seed_cell([v[field] for v in values])
    runs = {}
    for n, by_pair in cells.items():
        for (name, method), cell in by_pair.items():
            runs.setdefault(name, {}).setdefault(method, {})[n] = cell
    return {
        "metric": f"{key} ({field})",
        "spread": "min-max across seeds",
        "seeds": {name: len(folders) for name, folders in groups.items()},
        "runs": runs,
        "tiers": {
            n: [[list(pair) for pair in tier] for tier in tiers(c, higher)]
            for n, c in cells.items()
        },
    }


def seed_text(cell: dict | None, percent: bool) -> str:
    if cell is None:
        return "n/a"
    if percent:
        return f"{cell['mean']:.0%} [{cell['min']:.0%}–{cell['max']:.0%}]"
    return f"{short_number(cell['mean'])} [{short_number(cell['min'])}–{short_number(cell['max'])}]"


def seeds_markdown(report: dict, groups: dict[str, list[str]]) -> list[str]:
    """The across-seeds section of a study's Markdown: nothing with one seed."""
    if not groups:
        return []
    summary = seeds_summary(report, groups)
    lengths = [str(n) for n in report["lengths"]]
    percent = report.get("kind") == "retrieval"
    rows = [
        [f"`{name}`", method] + [seed_text(cells.get(n), percent) for n in lengths]
        for name, methods in summary["runs"].items()
        for method, cells in methods.items()
    ]
    counts = sorted(set(summary["seeds"].values()))
    lines = [
        f"## Across seeds ({'/'.join(map(str, counts))} a run)",
        "",
        f"Each run's {summary['metric'].split()[0]} at each length: the mean over its seeds "
        "[the min–max range across them; a range, not a confidence interval].",
        "",
        *table(["run", "method", *lengths], rows),
        "",
        "Orderings called: at each length the runs and methods in tiers, best first, separated "
        "by `>` only where every member's min–max range lies apart from every member's of the "
        "next tier; within a tier (`,`) the ranges overlap and no order is called.",
        "",
    ]
    for n in lengths:
        ranked = summary["tiers"].get(n, [])
        text = " > ".join(", ".join(f"`{name}` {method}" for name, method in t) for t in ranked)
        lines.append(f"- {n}: {text or 'n/a'}")
    return lines + [""]


# ---------------------------------------------------------------- plots


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), imported when first plotting;
    UserError naming the extra where matplotlib is not installed (extrapolate and study call this
    before their work)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "plotting needs the matplotlib package; install it with pip install -e '.[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def method_style(method: str) -> dict:
    """The same marker, line and colour for a RoPE scaling method in every panel."""
    index = ROPE_SCALINGS.index(method)
    colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
    return dict(marker="os^Dvx<>ph"[index % 10], color=colors[index % len(colors)], label=method)


def run_title(run: dict) -> str:
    return Path(run["name"]).name or run["name"]


def plain_tick(value: float, _) -> str:
    return f"{value:g}"


def times_tick(value: float, _) -> str:
    return f"{value:g}×"


def plain_log_ticks(axis):
    """Ticks at 1, 1.5, 2, 3, 5, 7 per decade, labelled 90, 100, 150 rather than 9×10^1."""
    import matplotlib.ticker

    subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    axis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(plain_tick))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def text_panels(axes, run: dict, report: dict, title: str):
    """One text run's panels: perplexity by length, loss by position in the longest windows and
    (when it was run) copy probe by distance, a line per method, the training context dashed."""
    ppl_ax, pos_ax, probe_ax = (*axes, None)[:3]
    lengths, span = report["lengths"], report["probe"]["span"]
    edges = np.asarray(report["per_position_edges"])
    centers = np.sqrt((edges[:-1] + 1) * edges[1:])  # index i predicts the token at position i+1
    for method in run["methods"]:
        style = method_style(method)
        cells = [(n, run["perplexity"][method][str(n)]) for n in lengths]
        ppl_ax.plot(*zip(*[(n, c["perplexity"]) for n, c in cells if c is not None]), **style)
        if method in run["per_position"]:
            losses = run["per_position"][method]["loss_mean"]
            pos_ax.plot(centers, losses, color=style["color"], label=method)
        reads = [(d, run["probe"][method][str(d)]) for d in report["probe"]["distances"]]
        reads = [(d, c["accuracy"]["mean"]) for d, c in reads if c is not None]
        if reads:
            probe_ax.plot(*zip(*reads), **style)
    context = run["train_context"]
    marks = [(ppl_ax, context), (pos_ax, context), (probe_ax, context - span)]
    for ax, at in marks[: len(axes)]:
        ax.axvline(at, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ppl_ax.set(yscale="log", ylabel="perplexity", title=f"{title}perplexity ({report['protocol']})")
    pos_ax.set(ylabel="loss (nats)", title=f"{title}loss by position, {max(lengths)} tokens")
    if probe_ax is not None:
        probe_title = f"{title}copy probe, {span} tokens"
        probe_ax.set(ylabel="top-1 on the repeat", ylim=(-0.02, 1.02), title=probe_title)
    plain_log_ticks(ppl_ax.yaxis)


def plot_report(report: dict, path: Path):
    """Small multiples: a row of panels per run (perplexity by length, loss by position, copy
    probe by distance), a line per method, the training context dashed."""
    runs = report["runs"]
    panels = 3 if report["probe"]["distances"] else 2  # no probe panel with --probes 0
    size = (14 * panels / 3, 3.4 * len(runs) + 0.8)
    fig, grid = pyplot().subplots(len(runs), panels, figsize=size, squeeze=False)
    for axes, run in zip(grid, runs):
        text_panels(axes, run, report, f"{run_title(run)}: " if len(runs) > 1 else "")
    labels = ("context length (tokens)", "position in the window", "distance to the repeat")
    for ax, label in zip(grid[-1], labels):
        ax.set_xlabel(label)
    note = "dashed: the training context"
    if panels == 3:
        note += " (for the probe, the farthest repeat in it)"
    save_figure(fig, list(grid.flat), path, note)


def seed_line(ax, points: list[list[tuple]], **style):
    """A line through the mean of each x's values across seeds (points: [(x, y)] a seed), in a band
    from their min to their max where there are several seeds."""
    ys = {}
    for seed in points:
        for x, y in seed:
            ys.setdefault(x, []).append(y)
    if not ys:
        return
    xs = sorted(ys)
    ax.plot(xs, [np.mean(ys[x]) for x in xs], linestyle="-", **style)
    if len(points) > 1:
        low, high = ([f(ys[x]) for x in xs] for f in (min, max))
        ax.fill_between(xs, low, high, color=style["color"], alpha=0.15, linewidth=0)


def seed_lines(ax, runs: list[dict], key: str, field: str, xs: list[int], scale: float):
    """seed_line of each method: its cells' `field` under run[key][method] at xs, against x /
    scale, over a run's seeds (runs); methods whose lines would coincide (every point within
    0.5%, closer than a figure shows) as one line labelled with each name (`ntk = dynamic`: dynamic
    NTK is NTK at each forward's own length)."""
    lines = []  # [(points, methods)]
    for method in runs[0]["methods"]:
        points = []
        for run in runs:
            cells = [(x, run[key][method][str(x)]) for x in xs]
            points.append([(x / scale, cell[field]) for x, cell in cells if cell is not None])
        same = [line for line in lines if coincide(line[0], points)]
        if same:
            same[0][1].append(method)
        else:
            lines.append((points, [method]))
    for points, methods in lines:
        seed_line(ax, points, **method_style(methods[0]) | dict(label=" = ".join(methods)))


def coincide(a: list[list[tuple]], b: list[list[tuple]]) -> bool:
    """Whether two methods' points (a list of (x, y) per seed) are at the same xs, their ys within
    0.5%: one line in a figure."""
    shape = [[x for x, _ in seed] for seed in a] == [[x for x, _ in seed] for seed in b]
    values = [y for seed in a for _, y in seed], [y for seed in b for _, y in seed]
    return shape and np.allclose(*values, rtol=5e-3, atol=0)


def accuracy_panel(
    ax,
    runs: list[dict],
    key: str,
    xs: list[int],
    chance: float,
    mark: float,
    title: str,
    scale: int = 1,
):
    """Accuracy (report key "accuracy" or "by_distance") against xs / scale, a line per method
    over a run's seeds (runs); chance dotted, the training context (at mark) dashed."""
    seed_lines(ax, runs, key, "mean", xs, scale)
    ax.axhline(chance, color="gray", linestyle=":", linewidth=1)
    ax.axvline(mark, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set(ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)


def save_figure(fig, axes, path: Path, note: str = ""):
    """Tight layout, one legend of every method shown beneath the panels, and the note above
    them."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if note:
        fig.suptitle(note, fontsize="medium")
    height = fig.get_figheight()  # inches: the legend takes 0.5 below the panels, the note 0.35
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1 - (0.35 / height if note else 0)))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles))
    fig.savefig(path, format="png", dpi=80)
    pyplot().close(fig)


def retrieval_plot(report: dict, path: Path):
    """Small multiples: for each run, accuracy by length above accuracy by distance (a line per
    method)."""
    runs, chance = report["runs"], report["task"]["chance"]
    lengths, distances = report["lengths"], report["distances"]
    columns = min(4, len(runs))
    blocks = math.ceil(len(runs) / columns)
    fig, grid = pyplot().subplots(
        2 * blocks, columns, figsize=(3.6 * columns, 5.2 * blocks), squeeze=False, sharey=True
    )
    for index in range(len(runs), blocks * columns):
        grid[2 * (index // columns), index % columns].set_visible(False)
        grid[2 * (index // columns) + 1, index % columns].set_visible(False)
    for index, run in enumerate(runs):
        top = grid[2 * (index // columns), index % columns]
        bottom = grid[2 * (index // columns) + 1, index % columns]
        context = run["train_context"]
        title = f"{run_title(run)}: by length"
        accuracy_panel(top, [run], "accuracy", lengths, chance, context, title)
        title = "by key-query distance"
        accuracy_panel(bottom, [run], "by_distance", distances, chance, context, title)
        top.set_xlabel("row length (tokens)", fontsize="small")
        bottom.set_xlabel(f"distance in rows of {max(lengths)}", fontsize="small")
        for ax, xs in ((top, lengths), (bottom, distances)):
            ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    for row in grid:
        row[0].set_ylabel("retrieval accuracy")
    save_figure(fig, [ax for ax in grid.flat if ax.get_visible()], path)


def ratio_range(text: dict) -> tuple[float, float]:
    """The y range every ratio panel shares: the drawn runs' ratios (text: {name: (seeds, ...)})
    with a margin, at least 0.8–2×, so that lines near 1× stay apart."""
    ratios = [
        cell["ratio"]
        for runs, *_ in text.values()
        for run in runs
        for cells in run["perplexity"].values()
        for cell in cells.values()
        if cell is not None
    ]
    return min([0.8, *ratios]) / 1.1, max([2.0, *ratios]) * 1.1


def ratio_panel(ax, runs: list[dict], lengths: list[int], title: str, ylim: tuple):
    """A text run's perplexity ratio to its training length against the length in multiples of
    the context it was first trained at, a line per method over the run's seeds (runs)."""
    base = runs[0]["original_context"]
    seed_lines(ax, runs, "perplexity", "ratio", lengths, base)
    ax.axhline(1, color="gray", linestyle=":", linewidth=1)
    ax.axvline(runs[0]["train_context"] / base, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set(ylim=ylim, title=title)
    ax.grid(alpha=0.3)


def missing_panel(ax, title: str, study: str):
    """An empty panel saying that the run is not in one of the two studies."""
    where = f"not in the\n{study} study"
    ax.text(0.5, 0.5, where, ha="center", va="center", transform=ax.transAxes)
    ax.set(xticks=[], yticks=[], title=title)


def text_report_problem(report) -> str | None:
    """What keeps `report` (read from JSON) from being a text study's report that side_by_side_plot
    can draw; None when nothing does."""
    if not isinstance(report, dict) or not {"runs", "lengths"} <= set(report):
        return "it has no runs and lengths"
    if report.get("kind") == "retrieval":
        return "it is a retrieval study's report"
    try:
        numbers = list(report["lengths"])
        for run in report["runs"]:
            numbers += [run["original_context"], run["train_context"], len(run_title(run))]
            for method in run["methods"]:
                if method not in ROPE_SCALINGS:
                    return f"a run names an unknown method {method!r}"
                cells = [run["perplexity"][method][str(n)] for n in report["lengths"]]
                numbers += [cell["ratio"] for cell in cells if cell is not None]
    except KeyError as e:
        return f"a run has no {e.args[0]!r}"
    except TypeError:
        numbers = [None]
    if not all(isinstance(x, (int, float)) for x in numbers):
        return "its runs are not a text report's"
    return None


def seed_sets(report: dict) -> dict[str, list[dict]]:
    """A report's runs by name, the seeds of a study run (NAME-seedK) under NAME."""
    sets = {}
    for run in report["runs"]:
        sets.setdefault(re.sub(r"-seed\d+$", "", run_title(run)), []).append(run)
    return sets


def side_by_side_plot(
    text_reports: list[dict], retrieval_reports: list[dict], path: Path, columns: int = 3
):
    """Small multiples, one pair of panels per run name (text studies' run and retrieval studies'
    run of the same name, e.g. `rope`; of each kind, the last report naming it): perplexity
    ratio by length beside retrieval accuracy by length, a line per method (the mean of a run's
    seeds, in their min–max band), the training context dashed."""
    import matplotlib.ticker

    text, retrieval = {}, {}
    for kind, reports in ((text, text_reports), (retrieval, retrieval_reports)):
        for report in reports:
            for name, runs in seed_sets(report).items():
                kind[name] = (runs, report["lengths"], report.get("task"))  # at its first place
    names = list(retrieval) + [name for name in text if name not in retrieval]
    rows = math.ceil(len(names) / columns)
    size = (3.0 * 2 * columns, 2.9 * rows)
    fig, grid = pyplot().subplots(rows, 2 * columns, figsize=size, squeeze=False)
    for ax in grid.flat[2 * len(names) :]:
        ax.set_visible(False)
    times = matplotlib.ticker.FuncFormatter(times_tick)
    ylim = ratio_range(text)
    for index, name in enumerate(names):
        left, right = grid.flat[2 * index], grid.flat[2 * index + 1]
        if name in text:
            ratio_panel(left, *text[name][:2], f"{name}: perplexity ratio", ylim)
            left.yaxis.set_major_formatter(times)
        else:
            missing_panel(left, f"{name}: perplexity ratio", "perplexity")
        if name in retrieval:
            runs, lengths, task = retrieval[name]
            base = runs[0]["original_context"]
            mark = runs[0]["train_context"] / base
            title = f"{name}: retrieval"
            accuracy_panel(right, runs, "accuracy", lengths, task["chance"], mark, title, base)
        else:
            missing_panel(right, f"{name}: retrieval", "retrieval")
        for ax in (left, right):
            if ax.get_xscale() == "log":
                ax.set_xlim(0.7, 23)
                ax.xaxis.set_major_formatter(times)
    note = (
        "x: length in multiples of the training context (of the base run for a fine-tune); "
        "dashed: the run's training context; dotted: chance (retrieval) or the in-context "
        "perplexity; bands: min–max across seeds"
    )
    save_figure(fig, [ax for ax in grid.flat if ax.get_visible()], path, note)
