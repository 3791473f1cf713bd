"""Plots of a length-extrapolation report, and of a study's runs side by side.

They use matplotlib, an optional extra. This module only draws reports. It computes nothing."""

import math
import re
from pathlib import Path

import numpy as np

from picollama.cli import UserError
from picollama.components.registry import ROPE_SCALINGS
from picollama.lab.report import run_title


def pyplot():
    """matplotlib.pyplot on the Agg backend, which writes files and needs no display.

    Without matplotlib, a UserError names the extra to install. Extrapolate and study call this
    before their work, so they fail fast."""
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
    colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"] + ["black"]  # 11 methods
    return dict(marker="os^Dvx<>ph*"[index % 11], color=colors[index % len(colors)], label=method)


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
    centers = np.sqrt((edges[:-1] + 1) * edges[1:])  # Index i predicts the token at i+1.
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
    panels = 3 if report["probe"]["distances"] else 2  # No probe panel with --probes 0.
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
    """A line through the mean of each x's values across seeds. points holds [(x, y)] per seed.

    With several seeds, a band runs from their min to their max."""
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
    """A seed_line for each method, over a run's seeds (runs).

    Each plots its cells' `field` under run[key][method] at xs, against x / scale. Methods whose
    lines would coincide share one line labelled with each name. Coinciding means every point is
    within 0.5%, closer than a figure shows. An example is `ntk = dynamic`, since dynamic NTK is
    NTK at each forward's own length."""
    lines = []  # [(points, methods)].
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
    height = fig.get_figheight()  # In inches. The legend takes 0.5 below, the note 0.35.
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
    """Small multiples, one pair of panels per run name, such as `rope`.

    The left panel is the text study's perplexity ratio by length. The right is the retrieval
    study's accuracy by length. Of each kind, the last report naming the run is drawn. Each
    method gets a line through the mean of the run's seeds, in their min–max band. The training
    context is dashed."""
    import matplotlib.ticker

    text, retrieval = {}, {}
    for kind, reports in ((text, text_reports), (retrieval, retrieval_reports)):
        for report in reports:
            for name, runs in seed_sets(report).items():
                kind[name] = (runs, report["lengths"], report.get("task"))  # At its first place.
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
