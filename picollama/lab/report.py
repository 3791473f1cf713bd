"""The length-extrapolation study's report (extrapolate.py computes it): Markdown tables, the effective-context
line and the plots, of perplexity and the copy probe (runs trained on text) or of retrieval accuracy (runs trained on
the retrieval task)."""

import math
from pathlib import Path

import numpy as np

from model import ROPE_SCALINGS

BINS_PER_OCTAVE, MIN_BIN = 3, 8  # of the loss-by-position curve


def short_number(x: float) -> str:
    """3 significant digits; `>10^k` for blow-ups of 1000 and more."""
    if not math.isfinite(x):
        return "inf"
    return f">10^{int(math.log10(x))}" if x >= 1000 else f"{x:.3g}"


def ratio_text(x: float) -> str:
    return short_number(x) if x >= 1000 or not math.isfinite(x) else f"{x:.2f}×"


def perplexity_cell(row: dict | None) -> str:
    """Perplexity ± its standard error over windows (as a percentage), and the ratio to the training length."""
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


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def run_rows(runs: list[dict]):
    """(first header columns, [(run, method)], label(run, method)): one row per run and method, with the run column
    only when there are several runs."""
    several = len(runs) > 1

    def label(run, method):
        return [f"`{run['name']}`", method] if several else [method]

    return (
        (["run", "method"] if several else ["method"]),
        [(r, m) for r in runs for m in r["methods"]],
        label,
    )


def protocol_text(report: dict) -> str:
    windows = report["num_windows"]
    longest = max(report["lengths"])
    if report["protocol"] == "fixed-target":
        return (
            f"the last {report['score_tokens']} tokens of {windows} validation windows of {longest} tokens (each "
            "inside one document), scored with the last n tokens as context"
        )
    return (
        f"every token of {windows} validation windows of {longest} tokens, scored through windows of n tokens "
        "moving by n/2"
    )


def markdown_report(report: dict) -> str:
    runs, lengths, probe = report["runs"], report["lengths"], report["probe"]
    first, keys, label = run_rows(runs)
    contexts = sorted({run["train_context"] for run in runs})
    windows = report["num_windows"]
    lines = [
        "# Length extrapolation of " + ", ".join(f"`{run['name']}`" for run in runs),
        "",
        f"Training context {', '.join(map(str, contexts))} tokens. Protocol `{report['protocol']}`: "
        f"{protocol_text(report)}. RoPE runs: static methods use factor n / the context RoPE was trained at, "
        "`dynamic` factor 1; other position encodings are scored as they are (`none`).",
        "",
        f"Perplexity ± its standard error over the {windows} windows (ratio to the run's training length):",
        "",
        *table(
            first + [f"{n}" for n in lengths],
            [
                label(run, m) + [perplexity_cell(run["perplexity"][m][str(n)]) for n in lengths]
                for run, m in keys
            ],
        ),
    ]
    distances, span = probe["distances"], probe["span"]
    inside = [d for d in distances if d + span <= min(contexts)]
    lines += [
        "",
        f"Copy probe: a span of {span} random token ids (uniform over the non-special vocabulary) at the start of "
        f"real validation text, repeated d tokens later; top-1 accuracy on the repeat after its first token ± its "
        f"standard error over {probe['count']} probes, and (in brackets) the loss drop in nats from the first "
        f"occurrence to the repeat. d ≤ {max(inside, default=0)} lies inside the training context.",
        "",
        *table(
            first + [f"d={d}" for d in distances],
            [
                label(run, m) + [probe_cell(run["probe"][m][str(d)]) for d in distances]
                for run, m in keys
            ],
        ),
        "",
        "Effective context: the longest tested length up to which perplexity stays within 5% of its training-length "
        "value and the probe (its farthest repeat that fits) within 10 points of its in-context accuracy:",
        "",
        *effective_table(report, with_basis=True),
        "",
        f"Loss by position (the plot), over the {windows} windows of {max(lengths)} tokens: {BINS_PER_OCTAVE} bins "
        f"per doubling of the position, at least {MIN_BIN} positions wide; each point averages its bin's width × "
        f"{windows} tokens, from {report['per_position_tokens'][0]:,} (the first) to "
        f"{report['per_position_tokens'][-1]:,} (the last).",
    ]
    return "\n".join(lines) + "\n"


def effective_table(report: dict, with_basis: bool) -> list[str]:
    first, keys, label = run_rows(report["runs"])
    rows = []
    for run, m in keys:
        effective = run["effective_context"][m]
        rows.append(
            label(run, m)
            + [str(run["train_context"]), str(effective["tokens"] or "none")]
            + ([effective["basis"]] if with_basis else [])
        )
    return table(
        first + ["training context", "effective context"] + (["basis"] if with_basis else []), rows
    )


def accuracy_cell(cell: dict | None) -> str:
    """Accuracy ± its standard error over rows."""
    return "n/a" if cell is None else f"{cell['mean']:.0%} ±{100 * cell['sem']:.0f}"


def retrieval_markdown(report: dict) -> str:
    runs, lengths, distances, task = (
        report["runs"],
        report["lengths"],
        report["distances"],
        report["task"],
    )
    first, keys, label = run_rows(runs)
    context = min(run["train_context"] for run in runs)
    return (
        "\n".join(
            [
                "# Retrieval past the training context of "
                + ", ".join(f"`{run['name']}`" for run in runs),
                "",
                f"Multi-query associative recall (data/retrieval.py): {task['pairs']} key-value pairs from "
                f"{task['keys']} keys and {task['values']} values, each key queried once later in the row; accuracy "
                f"(top-1 on the queried value; chance {task['chance']:.1%}) ± its standard error over "
                f"{report['rows']} seeded rows per cell, the same rows for every run and method. RoPE runs: static "
                "methods use factor n / the context RoPE was trained at, `dynamic` factor 1; other position encodings "
                "are scored as they are (`none`); learned positions read n/a past their table.",
                "",
                f"By length n (training context {context}): the key block anywhere in the row, the queries at its end, "
                "so that distances run up to n:",
                "",
                *table(
                    first + [f"{n} ({n / context:g}×)" for n in lengths],
                    [
                        label(run, m) + [accuracy_cell(run["accuracy"][m][str(n)]) for n in lengths]
                        for run, m in keys
                    ],
                ),
                "",
                f"By key-query distance d, in rows of {max(lengths)} tokens:",
                "",
                *table(
                    first + [f"d={d}" for d in distances],
                    [
                        label(run, m)
                        + [accuracy_cell(run["by_distance"][m][str(d)]) for d in distances]
                        for run, m in keys
                    ],
                ),
                "",
                f"Effective context from retrieval: the longest tested length up to which every tested length keeps at "
                f"least {report['keeps']:.0%} of the run's accuracy at its training length (none where that accuracy "
                f"is under {report['keeps']:.0%}):",
                "",
                *effective_table(report, with_basis=False),
            ]
        )
        + "\n"
    )


def effective_line(report: dict) -> str:
    """The effective contexts, in one line per run."""
    return "\n".join(
        f"effective context of {run['name']} (trained at {run['train_context']}): "
        + ", ".join(
            f"{m} {run['effective_context'][m]['tokens'] or 'none'}" for m in run["methods"]
        )
        for run in report["runs"]
    )


def plot_report(report: dict, path: Path):
    """Small multiples: a row of panels per run (perplexity by length, loss by position, copy probe by distance), a
    line per method, the training context dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs, lengths = report["runs"], report["lengths"]
    distances, span = report["probe"]["distances"], report["probe"]["span"]
    edges = np.asarray(report["per_position_edges"])
    centers = np.sqrt((edges[:-1] + 1) * edges[1:])  # index i predicts the token at position i+1
    fig, grid = plt.subplots(len(runs), 3, figsize=(14, 3.4 * len(runs) + 0.8), squeeze=False)
    for (ppl_ax, pos_ax, probe_ax), run in zip(grid, runs):
        for method in run["methods"]:
            style = method_style(method)
            cells = [(n, run["perplexity"][method][str(n)]) for n in lengths]
            cells = [(n, c["perplexity"]) for n, c in cells if c is not None]
            ppl_ax.plot(*zip(*cells), **style)
            if method in run["per_position"]:
                pos_ax.plot(
                    centers,
                    run["per_position"][method]["loss_mean"],
                    color=style["color"],
                    label=method,
                )
            reads = [(d, run["probe"][method][str(d)]) for d in distances]
            reads = [(d, c["accuracy"]["mean"]) for d, c in reads if c is not None]
            if reads:
                probe_ax.plot(*zip(*reads), **style)
        for ax, at in (
            (ppl_ax, run["train_context"]),
            (pos_ax, run["train_context"]),
            (probe_ax, run["train_context"] - span),
        ):
            ax.axvline(at, color="black", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        name = f"{run_title(run)}: " if len(runs) > 1 else ""
        ppl_ax.set(
            yscale="log", ylabel="perplexity", title=f"{name}perplexity ({report['protocol']})"
        )
        pos_ax.set(ylabel="loss (nats)", title=f"{name}loss by position, {max(lengths)} tokens")
        probe_ax.set(
            ylabel="top-1 on the repeat",
            ylim=(-0.02, 1.02),
            title=f"{name}copy probe, {span} tokens",
        )
        # ticks at 1, 1.5, 2, 3, 5, 7 per decade, labelled 90, 100, 150 rather than 9×10^1
        ppl_ax.yaxis.set_major_locator(
            matplotlib.ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
        )
        ppl_ax.yaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
        )
        ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax, label in zip(
        grid[-1], ("context length (tokens)", "position in the window", "distance to the repeat")
    ):
        ax.set_xlabel(label)
    save_figure(
        fig,
        list(grid.flat),
        path,
        "dashed: the training context (for the probe, the farthest repeat in it)",
    )


def method_style(method: str) -> dict:
    """The same marker, line and colour for a RoPE scaling method in every panel."""
    import matplotlib.pyplot as plt

    index = ROPE_SCALINGS.index(method)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return dict(marker="os^Dvx<>ph"[index % 10], color=colors[index % len(colors)], label=method)


def accuracy_panel(
    ax, run: dict, key: str, xs: list[int], chance: float, mark: float, title: str, scale: int = 1
):
    """One run's accuracy (report key "accuracy" or "by_distance") against xs / scale, a line per method; chance
    dotted, the training context (at mark) dashed."""
    for method in run["methods"]:
        points = [(x, run[key][method][str(x)]) for x in xs]
        points = [(x / scale, cell["mean"]) for x, cell in points if cell is not None]
        if points:
            ax.plot(*zip(*points), linestyle="-", **method_style(method))
    ax.axhline(chance, color="gray", linestyle=":", linewidth=1)
    ax.axvline(mark, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set(ylim=(-0.02, 1.02), title=title)
    ax.grid(alpha=0.3)


def run_title(run: dict) -> str:
    return Path(run["name"]).name or run["name"]


def save_figure(fig, axes, path: Path, note: str = ""):
    """Tight layout, one legend of every method shown beneath the panels, and the note above them."""
    import matplotlib.pyplot as plt

    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if note:
        fig.suptitle(note, fontsize="medium")
    height = (
        fig.get_figheight()
    )  # inches: the legend takes 0.5 below the panels, the note 0.35 above
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1 - (0.35 / height if note else 0)))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles))
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)


def retrieval_plot(report: dict, path: Path):
    """Small multiples: for each run, accuracy by length above accuracy by distance (a line per method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, chance = report["runs"], report["task"]["chance"]
    columns = min(4, len(runs))
    blocks = math.ceil(len(runs) / columns)
    fig, grid = plt.subplots(
        2 * blocks, columns, figsize=(3.6 * columns, 5.2 * blocks), squeeze=False, sharey=True
    )
    for index in range(len(runs), blocks * columns):
        grid[2 * (index // columns), index % columns].set_visible(False)
        grid[2 * (index // columns) + 1, index % columns].set_visible(False)
    for index, run in enumerate(runs):
        top, bottom = (
            grid[2 * (index // columns), index % columns],
            grid[2 * (index // columns) + 1, index % columns],
        )
        context = run["train_context"]
        accuracy_panel(
            top, run, "accuracy", report["lengths"], chance, context, f"{run_title(run)}: by length"
        )
        accuracy_panel(
            bottom,
            run,
            "by_distance",
            report["distances"],
            chance,
            context,
            "by key-query distance",
        )
        top.set_xlabel("row length (tokens)", fontsize="small")
        bottom.set_xlabel(f"distance in rows of {max(report['lengths'])}", fontsize="small")
        for ax, xs in ((top, report["lengths"]), (bottom, report["distances"])):
            ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    for row in grid:
        row[0].set_ylabel("retrieval accuracy")
    save_figure(fig, [ax for ax in grid.flat if ax.get_visible()], path)


def ratio_panel(ax, run: dict, lengths: list[int], title: str):
    """One text run's perplexity ratio to its training length against the length in multiples of the context it
    was first trained at, a line per method."""
    base = run["original_context"]
    for method in run["methods"]:
        points = [(n, run["perplexity"][method][str(n)]) for n in lengths]
        points = [(n / base, cell["ratio"]) for n, cell in points if cell is not None]
        if points:
            ax.plot(*zip(*points), linestyle="-", **method_style(method))
    ax.axhline(1, color="gray", linestyle=":", linewidth=1)
    ax.axvline(run["train_context"] / base, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(ylim=(0.6, 30), title=title)
    ax.grid(alpha=0.3)


def side_by_side_plot(text_report: dict, retrieval_report: dict, path: Path, columns: int = 3):
    """Small multiples, one pair of panels per run name (a text study's run and a retrieval study's run of the same
    name, e.g. `rope`): perplexity ratio by length beside retrieval accuracy by length, a line per method, the
    training context dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    text = {run_title(run): run for run in text_report["runs"]}
    retrieval = {run_title(run): run for run in retrieval_report["runs"]}
    names = list(retrieval) + [name for name in text if name not in retrieval]
    rows = math.ceil(len(names) / columns)
    fig, grid = plt.subplots(
        rows, 2 * columns, figsize=(3.0 * 2 * columns, 2.9 * rows), squeeze=False
    )
    for ax in grid.flat[2 * len(names) :]:
        ax.set_visible(False)
    chance = retrieval_report["task"]["chance"]
    times = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}×")
    for index, name in enumerate(names):
        left, right = (
            grid[index // columns, 2 * (index % columns)],
            grid[index // columns, 2 * (index % columns) + 1],
        )
        if name in text:
            ratio_panel(left, text[name], text_report["lengths"], f"{name}: perplexity ratio")
            left.yaxis.set_major_formatter(times)
        else:
            left.text(
                0.5,
                0.5,
                "not in the\nperplexity study",
                ha="center",
                va="center",
                transform=left.transAxes,
            )
            left.set(xticks=[], yticks=[], title=f"{name}: perplexity ratio")
        if name in retrieval:
            run = retrieval[name]
            base = run["original_context"]
            title = f"{name}: retrieval"
            mark = run["train_context"] / base
            accuracy_panel(
                right, run, "accuracy", retrieval_report["lengths"], chance, mark, title, base
            )
        else:
            right.text(
                0.5,
                0.5,
                "not in the\nretrieval study",
                ha="center",
                va="center",
                transform=right.transAxes,
            )
            right.set(xticks=[], yticks=[], title=f"{name}: retrieval")
        for ax in (left, right):
            if ax.get_xscale() == "log":
                ax.set_xlim(0.7, 23)
                ax.xaxis.set_major_formatter(times)
    note = (
        "x: length in multiples of the training context (of the base run for a fine-tune); dashed: the run's "
        "training context; dotted: chance (retrieval) or the in-context perplexity"
    )
    save_figure(fig, [ax for ax in grid.flat if ax.get_visible()], path, note)
