"""The length-extrapolation study's report (extrapolate.py computes it): Markdown tables, the effective-context
line, and the plot."""

import math
from pathlib import Path

import numpy as np

from model import ROPE_SCALINGS

DEFAULT_METHODS = ("none", "linear", "ntk", "dynamic", "yarn")
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
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown_report(report: dict) -> str:
    runs, lengths, probe = report["runs"], report["lengths"], report["probe"]
    several = len(runs) > 1
    # one row per run and method; the run column only when there are several runs
    keys = [(run, method) for run in runs for method in run["methods"]]
    first = ["run", "method"] if several else ["method"]

    def label(run, method):
        return [f"`{run['name']}`", method] if several else [method]

    contexts = sorted({run["train_context"] for run in runs})
    windows = report["num_windows"]
    protocol = (
        f"the last {report['score_tokens']} tokens of {windows} validation windows of {max(lengths)} tokens (each "
        "inside one document), scored with the last n tokens as context"
        if report["protocol"] == "fixed-target"
        else f"every token of {windows} validation windows of {max(lengths)} tokens, scored through windows of n "
        "tokens moving by n/2"
    )
    lines = [
        "# Length extrapolation of " + ", ".join(f"`{run['name']}`" for run in runs),
        "",
        f"Training context {', '.join(map(str, contexts))} tokens. Protocol `{report['protocol']}`: {protocol}. "
        "RoPE runs: static methods use factor n / the context RoPE was trained at, `dynamic` factor 1; other "
        "position encodings are scored as they are (`none`).",
        "",
        f"Perplexity ± its standard error over the {windows} windows (ratio to the run's training length):",
        "",
        *table(
            first + [f"{n}" for n in lengths],
            [label(run, m) + [perplexity_cell(run["perplexity"][m][str(n)]) for n in lengths] for run, m in keys],
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
            [label(run, m) + [probe_cell(run["probe"][m][str(d)]) for d in distances] for run, m in keys],
        ),
        "",
        "Effective context: the longest tested length up to which perplexity stays within 5% of its training-length "
        "value and the probe (its farthest repeat that fits) within 10 points of its in-context accuracy:",
        "",
        *table(
            first + ["training context", "effective context", "basis"],
            [
                label(run, m)
                + [
                    str(run["train_context"]),
                    str(run["effective_context"][m]["tokens"]),
                    run["effective_context"][m]["basis"],
                ]
                for run, m in keys
            ],
        ),
        "",
        f"Loss by position (the plot), over the {windows} windows of {max(lengths)} tokens: {BINS_PER_OCTAVE} bins "
        f"per doubling of the position, at least {MIN_BIN} positions wide; each point averages its bin's width × "
        f"{windows} tokens, from {report['per_position_tokens'][0]:,} (the first) to "
        f"{report['per_position_tokens'][-1]:,} (the last).",
    ]
    return "\n".join(lines) + "\n"


def effective_line(report: dict) -> str:
    """The effective contexts, in one line per run."""
    return "\n".join(
        f"effective context of {run['name']} (trained at {run['train_context']}): "
        + ", ".join(f"{m} {run['effective_context'][m]['tokens']}" for m in run["methods"])
        for run in report["runs"]
    )


def plot_report(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs, lengths = report["runs"], report["lengths"]
    distances, span = report["probe"]["distances"], report["probe"]["span"]
    several = len(runs) > 1
    fig, (ppl_ax, pos_ax, probe_ax) = plt.subplots(1, 3, figsize=(17, 5))
    marks, lines = "os^Dvx<>ph", ["-", "--", "-.", ":"]
    styles = {method: marks[i % len(marks)] + lines[i % len(lines)] for i, method in enumerate(ROPE_SCALINGS)}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    edges = np.asarray(report["per_position_edges"])
    centers = np.sqrt((edges[:-1] + 1) * edges[1:])  # index i predicts the token at position i+1
    for index, run in enumerate(runs):
        for number, method in enumerate(run["methods"]):
            style = styles[method]
            color = colors[(index if several else number) % len(colors)]
            name = f"{run['name']}: {method}" if several else method
            cells = [(n, run["perplexity"][method][str(n)]) for n in lengths]
            cells = [(n, c["perplexity"]) for n, c in cells if c is not None]
            ppl_ax.plot(*zip(*cells), style, color=color, label=name)
            if method in run["per_position"]:
                pos_ax.plot(centers, run["per_position"][method]["loss_mean"], style[1:], color=color, label=name)
            reads = [(d, run["probe"][method][str(d)]) for d in distances]
            reads = [(d, c["accuracy"]["mean"]) for d, c in reads if c is not None]
            if reads:
                probe_ax.plot(*zip(*reads), style, color=color, label=name)
        run_color = colors[index % len(colors)] if several else "gray"
        for ax, at in ((ppl_ax, run["train_context"]), (pos_ax, run["train_context"])):
            ax.axvline(at, color=run_color, linestyle="--", linewidth=1)
        probe_ax.axvline(run["train_context"] - span, color=run_color, linestyle="--", linewidth=1)
    ppl_ax.set(yscale="log", xlabel="context length (tokens)", ylabel="perplexity")
    ppl_ax.set_title(f"perplexity ({report['protocol']}); dashed: training context")
    pos_ax.set(xlabel="position in the window", ylabel="loss (nats)", title=f"loss by position, {max(lengths)} tokens")
    probe_ax.set(xlabel="distance to the repeat (tokens)", ylabel="top-1 accuracy on the repeat", ylim=(-0.02, 1.02))
    probe_ax.set_title(f"copy probe: {span} random tokens, repeated")
    for ax in (ppl_ax, pos_ax, probe_ax):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    # ticks at 1, 1.5, 2, 3, 5, 7 per decade, labelled 90, 100, 150 rather than 9×10^1
    ppl_ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ppl_ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    # beside the panels, not over the first: a comparison of several runs has a line per run and method
    fig.legend(*ppl_ax.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------- the command
