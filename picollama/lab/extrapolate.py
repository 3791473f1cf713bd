"""Length extrapolation, run as `python generate.py extrapolate`.

It measures how models hold up past their training context, for each RoPE scaling method and
each run. Runs trained on text get perplexity and a copy probe. Runs trained on the retrieval
task get retrieval accuracy."""

import json
from pathlib import Path

from picollama.cli import UserError
from picollama.cli import flags as cli
from picollama.cli.flags import comma_list, positive
from picollama.cli.outputs import (
    atomic_output,
    check_own_result,
    check_replaceable,
    check_writable,
    exclusive,
)
from picollama.components.registry import ROPE_SCALINGS
from picollama.convert.main import imported_run
from picollama.device import pick_device, pick_dtype
from picollama.lab.plots import plot_report, pyplot, retrieval_plot
from picollama.lab.report import effective_line, markdown_report, retrieval_markdown
from picollama.lab.retrieval_track import RETRIEVAL_MULTIPLES, retrieval_study
from picollama.lab.runs import Options, load_runs
from picollama.lab.text_track import TEXT_MULTIPLES, text_study


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
        help="RoPE scaling methods, comma-separated (default: every one of ROPE_SCALINGS "
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
        ("probes", "copy-probe spans per distance, 0 for no probe"),
        ("passkeys", "passkey rows per length and depth, 0 for none"),
        ("retrieval_rows", "retrieval-task runs: evaluation rows per length and per distance"),
        ("max_minutes", "refuse an evaluation estimated to take longer, in minutes"),
    ):
        default = getattr(Options, flag)
        option = "--" + flag.replace("_", "-")
        kind = positive(zero=flag in ("probes", "passkeys"))
        parser.add_argument(option, type=kind, default=default, help=f"{what} (default {default})")
    parser.add_argument(
        "--probe-span",
        type=int,
        default=Options.probe_span,
        help=f"random tokens in each probe span (default {Options.probe_span})",
    )
    parser.add_argument("--data", help="prepared dataset (default: the first run's data.dir)")
    cli.add_seed(parser, "which windows and probe spans", default=Options.seed)
    cli.add_out(parser, "output directory (default RUN/extrapolation; required with several runs)")


def check_own_folder(out_dir: Path):
    """The ownership rule for --out, so an evaluation never touches files it did not make.

    The folder must be absent, empty, or hold only what an evaluation writes. That is
    extrapolation.json, .md and .png, with the JSON an evaluation's report."""
    what = "an evaluation writes extrapolation.json, .md and .png into a folder of its own"
    check_replaceable(out_dir, r"extrapolation\.(json|md|png)", what=what)
    check_own_result(out_dir / "extrapolation.json", "generate.py extrapolate", written_by)


def written_by(report: dict) -> str | None:
    """Who wrote a report, by the command line it records: "generate.py extrapolate", or None."""
    command = report.get("command")
    if isinstance(command, list) and command[1:3] == ["generate.py", "extrapolate"]:
        return "generate.py extrapolate"
    return None


def write_report(report: dict, markdown: str, plot, out_dir: Path):
    """Write extrapolation.json, .md and .png in out_dir, all three or none.

    Each is renamed into place only once every one has been written."""
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
    """Evaluate run directories past their training context and return the report.

    The runs must share one task and one tokenizer. It writes extrapolation.json, .md and .png to
    `out` (default RUN/extrapolation) and prints the Markdown. The report records `command` as
    the command line that made it."""
    names = [str(path) for path in runs]
    if len({Path(path).resolve() for path in runs}) < len(names):
        raise UserError(f"--run names a run twice: {','.join(names)}")
    if len(names) > 1 and out is None:
        raise UserError(
            "--out is required with several runs: the directory the comparison is written to"
        )
    if options.probe_span < 2:
        raise UserError(f"--probe-span must be >= 2, not {options.probe_span}")
    names = [str(imported_run(Path(name))) for name in names]  # Imports .gguf and HF folders.
    device = pick_device(options.device)
    loaded = load_runs(names, options.methods, device, pick_dtype(options.dtype, device))
    out_dir = Path(out) if out else Path(names[0]) / "extrapolation"
    with exclusive(out_dir):  # One evaluation writes a folder at a time.
        check_own_folder(out_dir)
        if loaded[0][1]["task"] == "retrieval":
            check_writable(out_dir / "extrapolation.json")  # The folder, and files in it.
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
    """The `extrapolate` command, on generate.py's parsed flags. argv goes into the report."""
    pyplot()  # Without matplotlib, fail now rather than after the work.
    extrapolation(args.run, args.out, Options.from_args(args), ["python", "generate.py", *argv])
    return 0
