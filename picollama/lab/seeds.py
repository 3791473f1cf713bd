"""A study's runs across seeds.

Each cell gets its mean and min-max range. An ordering is called only where ranges do not
overlap."""

import numpy as np

from picollama.lab.report import run_title, short_number, table


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
    """The keys of cells ({key: seed_cell}) in tiers, best first.

    Ranges that overlap, directly or through others, share a tier. So every member of a tier is
    better than every member of the tiers after it. No order is called within a tier."""
    merged = []  # [low, high, keys], by low.
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
    """The study's cells across seeds.

    `groups` maps each recipe run's name to its seeds' folders. For each run and method, we give
    the mean, min and max over seeds at each length. A cell is None where a seed has no value.
    At each length the (run, method) pairs are also put in tiers."""
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
