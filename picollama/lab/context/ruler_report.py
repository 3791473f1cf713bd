"""RULER's report from saved cells alone: the mean score over the tasks by method and length, each
method's effective length, each task's scores, each length's change paired by question
(ruler.md), and the same as a figure (ruler.png). The seeds in the cells are pooled.

This module reads cells and does arithmetic. It loads no model and runs no task (ruler.py does).
`python -m picollama.lab.context.ruler_report --out FOLDER [--context N]` rewrites FOLDER's
report."""

import sys
from pathlib import Path

import numpy as np

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.components.registry import ROPE_SCALINGS
from picollama.lab.context.cells import Cells
from picollama.lab.context.report import LEVEL, mean_interval, report_main, write_pair
from picollama.lab.plots import method_style, pyplot

THRESHOLD = 85.6  # RULER's: Llama-2-7B's mean score at 4k
DROP = 5.0  # points below the shortest length's score that the second effective length allows
SECONDS = ("seconds", "prefill_seconds")  # a cell's, in all and its prefill's


def seed_of(cell: dict) -> int:
    return (cell.get("setup") or {}).get("seed", 0)


def complete_cells(results: dict) -> dict[str, dict[int, dict[int, list[dict]]]]:
    """{method: {length: {seed: its cells, one a task in task order}}} from saved cells, the
    seeds under which the method has every task any cell has at the length: empty where none
    has, not measured yet."""
    tasks = sorted({cell["task"] for cell in results.values()})
    lengths = sorted({cell["length"] for cell in results.values()})
    found = {}
    for cell in results.values():
        by_seed = found.setdefault(cell["method"], {}).setdefault(cell["length"], {})
        by_seed.setdefault(seed_of(cell), {})[cell["task"]] = cell
    complete = {}
    for method in sorted(found, key=method_order):
        complete[method] = {}
        for n in lengths:
            by_seed = found[method].get(n, {})
            complete[method][n] = {
                seed: [by_task[t] for t in tasks]
                for seed, by_task in sorted(by_seed.items())
                if set(by_task) == set(tasks)
            }
    return complete


def mean_scores(results: dict) -> dict[str, dict[int, float | None]]:
    """{method: {length: the mean score over the tasks and seeds}} from saved cells, None where
    no seed has every task yet."""
    return {
        method: {
            n: float(np.mean([c["score"] for cells in by_seed.values() for c in cells]))
            if by_seed
            else None
            for n, by_seed in by_length.items()
        }
        for method, by_length in complete_cells(results).items()
    }


def changes(results: dict, reference: int) -> dict[str, dict[int, tuple | None]]:
    """{method: {length: (change, low, high)}} past `reference`, a length: each question's score
    (0-100) less its own at `reference`, the seed's same key and needles, averaged over every
    task's questions of the seeds both lengths have, with its LEVEL t-interval."""
    found = {}
    for method, by_length in complete_cells(results).items():
        before = by_length.get(reference, {})
        found[method] = {n: paired_change(before, by_length[n]) for n in by_length if n > reference}
    return found


def paired_change(before: dict[int, list[dict]], after: dict[int, list[dict]]):
    """(change, low, high) of the cells of one method at two lengths by seed, over the seeds both
    have. None unless every task's questions pair one to one and there are two or more."""
    pairs = [
        (a, b) for seed in before.keys() & after.keys() for a, b in zip(before[seed], after[seed])
    ]
    if not pairs or any(len(a["scores"]) != len(b["scores"]) for a, b in pairs):
        return None
    change = [
        100 * (late - early) for a, b in pairs for early, late in zip(a["scores"], b["scores"])
    ]
    return (float(np.mean(change)), *mean_interval(change)) if len(change) > 1 else None


def method_order(method: str) -> int:
    return ROPE_SCALINGS.index(method) if method in ROPE_SCALINGS else len(ROPE_SCALINGS)


def longest(by_length: dict, floor: float, strictly: bool) -> int | None:
    """The longest length up to which every length is measured and scores above `floor`
    (or at it, unless `strictly`). None if the shortest does not."""
    found = None
    for length in sorted(by_length):
        score = by_length[length]
        if score is None or score < floor or (strictly and score == floor):
            break
        found = length
    return found


def effective_lengths(results: dict, threshold: float = THRESHOLD, drop: float = DROP) -> dict:
    """{method: {"effective": the longest length whose mean stays above `threshold`, "holds":
    the longest whose mean stays within `drop` points of the shortest length's, "shortest": that
    score}} from saved cells (Cells.results)."""
    found = {}
    for method, by_length in mean_scores(results).items():
        shortest = by_length[min(by_length)]
        found[method] = {
            "effective": longest(by_length, threshold, strictly=True),
            "holds": None if shortest is None else longest(by_length, shortest - drop, False),
            "shortest": shortest,
        }
    return found


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def shown(value, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else f"{value}{unit}"


def markdown(results: dict, threshold=THRESHOLD, drop=DROP, context: int | None = None) -> str:
    """The mean score by method (rows) and length (columns) with both effective lengths, then
    each task's score and questions answered in full."""
    lengths = sorted({cell["length"] for cell in results.values()})
    means = mean_scores(results)
    effective = effective_lengths(results, threshold, drop)
    header = ["method", *map(str, lengths), f"effective (> {threshold})"]
    header.append(f"holds (within {drop:g} of {lengths[0]})")
    rows = [
        [m, *(shown(means[m][n]) for n in lengths)]
        + [shown(effective[m]["effective"]), shown(effective[m]["holds"])]
        for m in means
    ]
    lines = ["## RULER, the mean score over the tasks (0-100)", "", *table(header, rows)]
    for task in sorted({cell["task"] for cell in results.values()}):
        cells = task_cells(results, task)
        rows = [
            [m, *(score_cell(cells.get((m, n))) for n in lengths)]
            for m in sorted({m for m, _ in cells}, key=method_order)
        ]
        lines += ["", f"### {task}: score (questions answered in full)", ""]
        lines += table(["method", *map(str, lengths)], rows)
    lines += change_tables(results, lengths, context)
    return "\n".join(lines + provenance(results, lengths)) + "\n"


def change_tables(results: dict, lengths: list[int], context: int | None) -> list[str]:
    """The mean change by method and length, with its interval, from the shortest length and
    from the model's `context` (None: not known)."""
    lines = []
    references = sorted({lengths[0], context or lengths[0]})
    for reference in [n for n in references if n < lengths[-1]]:
        later = [n for n in lengths if n > reference]
        rows = [
            [method, *(change_text(by_length.get(n)) for n in later)]
            for method, by_length in changes(results, reference).items()
        ]
        lines += ["", f"### Change from {reference}: each question paired with its own", ""]
        lines += table(["method", *map(str, later)], rows)
    if not lines:
        return []
    return lines + [
        "",
        "The mean over every task's questions of a question's score less its score at the",
        f"reference length [{LEVEL:.0%} t-interval]. The questions of one haystack share its",
        "prefill, so they are not independent draws, and the interval is a guide. Up to the",
        "model's context every method is the model itself: a change past it is the method's.",
    ]


def change_text(change) -> str:
    if change is None:
        return "-"
    mean, low, high = change
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]"


def provenance(results: dict, lengths: list[int]) -> list[str]:
    """Each method's seconds a cell by length (the median over the tasks it ran, with its
    prefill's), then the setup, machines and commands behind the cells."""
    ran = [cell for cell in results.values() if "copied_from" not in cell and "seconds" in cell]
    rows = []
    for method in sorted({cell["method"] for cell in ran}, key=method_order):
        row = [method]
        for n in lengths:
            cells = [c for c in ran if (c["method"], c["length"]) == (method, n)]
            if not cells:
                row.append("-")
                continue
            total, prefill = (np.median([c[key] for c in cells]) for key in SECONDS)
            row.append(f"{total:,.0f} ({prefill:,.0f})")
        rows.append(row)
    lines = ["", "### Seconds a cell (its prefill's): the median over the tasks that ran", ""]
    lines += table(["method", *map(str, lengths)], rows)
    lines += ["", "-: none ran. A method that computes another's forward at a length (every method"]
    lines += ["inside the context) copies its cells."]
    setups = {setup_text(cell["setup"]) for cell in results.values() if "setup" in cell}
    machines = sorted({f"{c['machine']['cpu']}, {c['machine']['threads']} threads" for c in ran})
    commands = sorted({" ".join(cell["command"]) for cell in ran if "command" in cell})
    unknown = sum("command" not in cell for cell in ran)
    lines += ["", "Setup: " + "; ".join(sorted(setups)), "", "Machine: " + "; ".join(machines)]
    if commands:
        lines += ["", "Commands:", "", "```", *commands, "```"]
    if unknown:
        lines += ["", f"{unknown} cells ran before cells kept their command."]
    return lines


def setup_text(setup: dict) -> str:
    """A cell's setup in words, its run by its folder's name."""
    return ", ".join(
        f"{name} {Path(value).name if name == 'run' else value}" for name, value in setup.items()
    )


def task_cells(results: dict, task: str) -> dict[tuple[str, int], list[dict]]:
    """{(method, length): the task's cells there, one a seed}."""
    cells = {}
    for cell in results.values():
        if cell["task"] == task:
            cells.setdefault((cell["method"], cell["length"]), []).append(cell)
    return cells


def score_cell(cells: list[dict] | None) -> str:
    """The seeds' mean score and their questions answered in full, of all asked."""
    if not cells:
        return "-"
    score = np.mean([cell["score"] for cell in cells])
    return f"{score:.1f} ({sum(c['correct'] for c in cells)}/{sum(c['questions'] for c in cells)})"


def draw_scores(ax, by_method: dict[str, dict[int, float | None]], title: str, notes=None):
    """A line per method of its scores by length, nudged apart so equal lines show. `notes`:
    {method: what its label adds}."""
    notes = notes or {}
    for shift, (method, by_length) in enumerate(by_method.items()):
        known = [(n, score) for n, score in sorted(by_length.items()) if score is not None]
        if not known:
            continue
        nudge = 2 ** (0.02 * (shift - (len(by_method) - 1) / 2))
        style = method_style(method) if method in ROPE_SCALINGS else {"label": method}
        style["label"] += notes.get(method, "")
        ax.plot([n * nudge for n, _ in known], [score for _, score in known], **style)
    lengths = sorted({n for by_length in by_method.values() for n in by_length})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n / 1024:g}k" for n in lengths])
    ax.minorticks_off()
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("haystack tokens")


def plot(results: dict, path: Path, drop: float = DROP):
    """The mean over the tasks with the floor of the second effective length (dashed: the
    shortest length's mean less `drop`), each method's in its label, then a panel per task."""
    plt = pyplot()
    tasks = sorted({cell["task"] for cell in results.values()})
    fig, axes = plt.subplots(1, 1 + len(tasks), figsize=(3.4 * (1 + len(tasks)), 3.8), sharey=True)
    effective = effective_lengths(results, drop=drop)
    notes = {method: f" (holds to {shown(found['holds'])})" for method, found in effective.items()}
    draw_scores(axes[0], mean_scores(results), "mean over the tasks", notes)
    floors = {found["shortest"] - drop for found in effective.values() if found["shortest"]}
    for floor in sorted(floors):
        axes[0].axhline(floor, color="grey", linewidth=0.8, linestyle="--")
    for ax, task in zip(axes[1:], tasks):
        by_method = {}
        for (method, length), cells in task_cells(results, task).items():
            by_method.setdefault(method, {})[length] = float(np.mean([c["score"] for c in cells]))
        draw_scores(ax, {m: by_method[m] for m in sorted(by_method, key=method_order)}, task)
    axes[0].set_ylabel(f"score, 0-100 (RULER's threshold: {THRESHOLD})")
    axes[0].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)


def write_report(out: Path, context: int | None = None) -> list[str]:
    """Write out/ruler.md and out/ruler.png from the cells in out, the changes also from the
    model's `context` where it is given. Returns their paths."""
    results = Cells(Path(out)).results("ruler.")
    if not results:
        raise UserError(f"{out} holds no RULER cells yet")
    return write_pair(Path(out) / "ruler", markdown(results, context=context), results, plot)


def options(parser):
    parser.add_argument(
        "--context",
        type=positive(),
        metavar="N",
        help="the model's context: the changes are also shown from it (ruler.py passes it)",
    )


def main(argv: list[str]) -> int:
    module = "picollama.lab.context.ruler_report"
    folder = "the folder of the RULER cells"
    return report_main(argv, module, __doc__, folder, write_report, options)


if __name__ == "__main__":
    sys.exit(run_command(main))
