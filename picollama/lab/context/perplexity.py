"""`python -m picollama.lab.context.perplexity`: a real model's perplexity past its context, for
each length method, in cells that each save as they finish.

Fixed target. Each window's last --scored tokens are scored with n tokens of its book, scored
ones included, for n = the context (1×) and each longer length. Each method applies as the text
track applies it, stretched to the length. A read is a chunked prefill through the KV cache, so
65,536 tokens fit in memory, and only the scored tail's logits are made. A rerun skips saved
cells. This module does not report: report.py reads the saved cells."""

import hashlib
import math
import resource
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.tokenizer import tokenizer_file
from picollama.cli import UserError
from picollama.cli import flags as cli
from picollama.cli.command import Interrupted, run_command
from picollama.cli.flags import comma_list, positive
from picollama.components.length import length_dependent, stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.convert.main import imported_run
from picollama.device import pick_device, pick_dtype
from picollama.lab.bench.common import cpu_model
from picollama.lab.context.cells import Cells
from picollama.lab.context.report import write_report
from picollama.lab.context.text import BOOKS, Window, book_tokens, layout
from picollama.lab.cost import HEAD_CHUNK, duration, gigabytes, method_kind, synchronize
from picollama.lab.interruptible import interruptible
from picollama.lab.plots import pyplot
from picollama.lab.text_track import forward_key
from picollama.run_files import load_run

METHODS = ("none", "yarn", "rerope", "self_extend")
LOGN = "-logn"  # after a method's name: with log-n attention too (method_args)
MULTIPLES = (1, 2, 4, 8)
SCORED = 1024
CHUNK = 4096  # Tokens a prefill forward takes at once.
CALIBRATION = (1024, 4096)  # The two lengths timed to fit a cell's seconds as a·n + b·n².


def default_windows(multiple: float) -> int:
    """Windows read at `multiple` × the context: 8 at 2×, 4 at 4×, 2 at 8× and beyond."""
    return max(2, int(16 // multiple))


@dataclass
class Plan:
    """What a study reads: `windows[n]` windows at each length n (ascending, the first the
    context), under each method, the last `scored` tokens of each, in prefill chunks of `chunk`."""

    methods: list[str]
    lengths: list[int]
    windows: dict[int, int]
    scored: int
    chunk: int

    def longest(self) -> list[int]:
        """The longest read of each window: window w is read at every length with more windows."""
        count = max(self.windows.values())
        return [max(n for n in self.lengths if self.windows[n] > w) for w in range(count)]


@dataclass(frozen=True)
class Cell:
    method: str
    length: int
    window: Window

    @property
    def key(self) -> str:
        return f"ppl.{self.method}.{self.length}.w{self.window.index}"


def make_plan(args, context: int) -> Plan:
    """The plan of the parsed flags for a model trained at `context` tokens. UserError on
    lengths below the context or not above --scored, or --windows that do not match them."""
    if args.lengths and args.multiples:
        raise UserError("give --lengths or --multiples, not both")
    lengths = args.lengths or [round(m * context) for m in args.multiples or MULTIPLES]
    lengths = sorted(set(lengths) | {context})
    if lengths[0] < context or lengths[0] <= args.scored:
        raise UserError(
            f"every length must be at least the context, {context:,}, and above --scored "
            f"{args.scored:,}"
        )
    longer = lengths[1:]
    counts = args.windows or [default_windows(n / context) for n in longer]
    if len(counts) == 1 and len(longer) > 1:
        counts = counts * len(longer)
    if len(counts) != len(longer):
        raise UserError(
            f"--windows gives {len(counts)} counts for {len(longer)} lengths past the context "
            f"({','.join(map(str, longer))}); give one, or one for each"
        )
    windows = dict(zip(longer, counts))
    windows[context] = max(counts, default=default_windows(2))
    return Plan(args.methods, lengths, windows, args.scored, args.chunk)


def plan_cells(plan: Plan, windows: list[Window]) -> list[Cell]:
    """Every cell, length by length, so that a partial study has its shorter lengths whole."""
    return [
        Cell(method, length, window)
        for length in plan.lengths
        for window in windows[: plan.windows[length]]
        for method in plan.methods
    ]


def forward_identity(args, length: int) -> str:
    """A short hash of what a forward of `length` tokens computes (text_track.forward_key)."""
    return hashlib.sha1(repr(forward_key(args, length)).encode()).hexdigest()[:16]


def tail_nll(model, h: torch.Tensor, targets: torch.Tensor) -> float:
    """The summed cross-entropy of targets (T,) from the last layer's output h (1, T, dim), its
    logits made HEAD_CHUNK positions at a time."""
    total = 0.0
    for start in range(0, h.shape[1], HEAD_CHUNK):
        logits = model.head(h[0, start : start + HEAD_CHUNK]).float()
        wanted = targets[start : start + HEAD_CHUNK]
        total += F.cross_entropy(logits, wanted, reduction="sum").item()
    return total


def scored_nll(model, tokens: torch.Tensor, scored: int, chunk: int, bar: bool = False) -> float:
    """The summed cross-entropy of the last `scored` of tokens (n,), each given every token
    before it: tokens[:-1] run through the KV cache `chunk` at a time, and the head reads only
    the positions that predict a scored token. Each forward runs interruptible (Ctrl-C).
    `bar` shows the chunks' progress."""
    inputs = tokens[None, :-1]
    first = len(tokens) - 1 - scored  # The position whose output predicts the first scored token.
    model.setup_cache(1, inputs.shape[1])
    total = 0.0
    starts = range(0, inputs.shape[1], chunk)
    for start in tqdm(starts, desc="window", unit="chunk", leave=False, disable=not bar):
        piece = inputs[:, start : start + chunk]
        h = interruptible(model.features, piece, start)
        keep = max(first - start, 0)
        if keep < piece.shape[1]:
            targets = tokens[start + keep + 1 : start + piece.shape[1] + 1]
            total += interruptible(tail_nll, model, h[:, keep:], targets)
    model.reset_cache()
    return total


def peak_gigabytes() -> float:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)


def reading(cell: Cell, plan: Plan, run: str, dtype) -> dict:
    """What a saved cell must match to count for this study: the same tokens scored by the same
    model in the same dtype."""
    return {
        "book": cell.window.book,
        "end": cell.window.end,
        "scored": plan.scored,
        "model": run,
        "dtype": str(dtype).removeprefix("torch."),
    }


def method_args(base, method: str, length: int):
    """base stretched by `method` to `length`. A name ending in LOGN ("rerope-logn") adds log-n
    attention (variants.logn_attention): past the context, queries grow by log n / log context,
    as Qwen adds to dynamic NTK and a window."""
    logn = method.endswith(LOGN) or base.logn_attention
    return replace(stretched(base, method.removesuffix(LOGN), length), logn_attention=logn)


def read_cell(model, base, cell: Cell, tokens: np.ndarray, plan: Plan) -> dict:
    """Score one cell: the window's last plan.scored tokens with cell.length tokens in all."""
    model.args = method_args(base, cell.method, cell.length)
    chunk = cell.length if length_dependent(model.args) else plan.chunk  # Dynamic: one forward.
    end = cell.window.end
    ids = torch.from_numpy(tokens[end - cell.length : end].astype(np.int64))
    start = time.perf_counter()
    nll = scored_nll(model, ids.to(model.output.weight.device), plan.scored, chunk, bar=True)
    return {
        "nll_sum": nll,
        "tokens": plan.scored,
        "perplexity": math.exp(nll / plan.scored),
        "seconds": round(time.perf_counter() - start, 2),
        "chunk": chunk,
        "peak_rss_gb": peak_gigabytes(),
    }


def saved_forwards(cells: Cells, wanted: dict[str, dict], windows: dict[int, dict]) -> dict:
    """{(length, window, forward identity): key} of the saved cells that read the tokens this
    plan reads (`windows`: window index -> its reading), another method's cells included.
    UserError when one of `wanted` (key: its reading) was saved by another study, on other tokens
    or another model."""
    found = {}
    for key, result in cells.results("ppl.").items():
        expected = wanted.get(key)
        same = expected or windows.get(result.get("window"))
        if any(result.get(name) != value for name, value in (same or {"": 0}).items()):
            if expected is None:  # Another study's cell: neither checked nor copied.
                continue
            differs = {name: result.get(name) for name in expected}
            raise UserError(
                f"{cells.path(key)} was read with {differs}, not {expected}: the windows move "
                "with the lengths asked, so give the --multiples or --lengths this folder was "
                "made with (the default, 1,2,4,8, for a study spanning sessions), or another --out"
            )
        found[result["length"], result["window"], result["forward"]] = key
    return found


def cell_result(model, base, cell: Cell, books: dict, plan: Plan, cells: Cells, forwards: dict):
    """(the cell's result, whether it ran a forward). A forward that another method's saved cell
    already computed is copied from it, not run again."""
    args = method_args(base, cell.method, cell.length)
    identity = forward_identity(args, cell.length)
    same = forwards.get((cell.length, cell.window.index, identity))
    if same:
        copied = cells.done(same)
        result = {name: copied[name] for name in ("nll_sum", "tokens", "perplexity")}
        result |= {"seconds": 0.0, "same_forward_as": same}
    else:
        result = read_cell(model, base, cell, books[cell.window.book], plan)
    forwards.setdefault((cell.length, cell.window.index, identity), cell.key)
    described = {"method": cell.method, "length": cell.length, "window": cell.window.index}
    described["context"] = base.original_seq_len
    return result | described | {"forward": identity, "rope_factor": args.rope_factor}, not same


def study(
    model, run: str, plan: Plan, windows: list[Window], books: dict, out: Path, command: list
) -> int:
    """Read every cell of the plan not yet saved in out/cells, saving each as it ends. Returns
    the forwards run. Ctrl-C keeps every cell saved before it."""
    cells, base, dtype = Cells(out / "cells"), model.args, model.output.weight.dtype
    every = plan_cells(plan, windows)
    wanted = {cell.key: reading(cell, plan, run, dtype) for cell in every}
    windows_read = {cell.window.index: wanted[cell.key] for cell in every}
    forwards = saved_forwards(cells, wanted, windows_read)
    todo = [cell for cell in every if cells.done(cell.key) is None]
    machine = {"cpu": cpu_model(), "threads": torch.get_num_threads()}
    computed = 0
    try:
        with torch.inference_mode(), tqdm(total=len(todo), desc="cells", unit="cell") as bar:
            for cell in todo:
                bar.set_postfix_str(cell.key)
                result, ran = cell_result(model, base, cell, books, plan, cells, forwards)
                extra = {"command": command, "machine": machine}
                cells.save(cell.key, result | wanted[cell.key] | extra)
                computed += ran
                bar.update()
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted: the cells done so far are saved in {out / 'cells'}; run the same "
            "command again to go on"
        ) from None
    finally:
        model.args = base
    return computed


# ---------------------------------------------------------------- the plan and its estimate


def timed_read(model, args, n: int, scored: int, chunk: int) -> float:
    """Seconds of one read of n random tokens under `args`, as read_cell reads."""
    model.args = args
    tokens = torch.randint(0, args.vocab_size, (n,), device=model.output.weight.device)
    start = time.perf_counter()
    scored_nll(model, tokens, scored, chunk)
    synchronize(tokens.device)
    return time.perf_counter() - start


def fit_seconds(model, base, method: str, plan: Plan) -> tuple[float, float]:
    """(a, b): a cell of n tokens under `method` takes about a·n + b·n² seconds here, the linear
    layers and attention. Fitted to reads of the CALIBRATION lengths, after one untimed read. The
    context is shrunk to a quarter of each, so a windowed method attends in both branches. Each
    read runs in two chunks, the second over cached keys, as a long cell's chunks do."""
    times = []
    for n in (CALIBRATION[0], *CALIBRATION):
        short = replace(base, max_seq_len=n // 4, rope_original_max_seq_len=None)
        args = method_args(short, method, n)
        chunk = n if length_dependent(args) else n // 2
        times.append(timed_read(model, args, n, min(plan.scored, n // 4), chunk))
    (n1, n2), (t1, t2) = CALIBRATION, times[1:]
    b = max((t2 / n2 - t1 / n1) / (n2 - n1), 0.0)
    return max(t2 / n2 - b * n2, 0.0), b


def memory_line(model, plan: Plan) -> str:
    """The memory the longest read holds beside the weights: its KV cache and a chunk's mask."""
    args, longest = model.args, max(plan.lengths)
    size = model.output.weight.element_size()
    cache = 2 * args.n_layers * args.n_kv_heads * args.head_dim * longest * size
    mask = min(plan.chunk, longest) * longest
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return (
        f"memory: weights {gigabytes(weights)}; the longest read, {longest:,} tokens, holds a KV "
        f"cache of {gigabytes(cache)} and a chunk's causal mask of {gigabytes(mask)}"
    )


def print_plan(model, plan: Plan, windows: list[Window], out: Path) -> float:
    """Print each cell with its estimated seconds (saved cells and shared forwards cost none),
    and the total. Returns the total seconds."""
    base, cells, fits = model.args, Cells(out / "cells"), {}
    try:
        with torch.inference_mode():
            for method in plan.methods:
                if method_kind(method) not in fits:
                    fits[method_kind(method)] = fit_seconds(model, base, method, plan)
    finally:
        model.args = base
    for kind, (a, b) in fits.items():
        print(f"calibrated {kind}: {a * 1e3:.3f} ms a token + {b * 1e9:.3f} ms a million n²")
    total, count, forwards = 0.0, 0, {}
    for cell in plan_cells(plan, windows):
        identity = forward_identity(method_args(base, cell.method, cell.length), cell.length)
        first = forwards.setdefault((cell.length, cell.window.index, identity), cell.key)
        if cells.done(cell.key) is not None:
            status = "saved"
        elif first != cell.key:
            status = f"shares {first}'s forward"
        else:
            a, b = fits[method_kind(cell.method)]
            seconds = a * cell.length + b * cell.length**2
            total, count, status = total + seconds, count + 1, duration(seconds)
        print(f"{cell.key:<30} {cell.window.book:<8} {cell.length:>7,} tokens  {status}")
    print(memory_line(model, plan))
    print(f"total: {count} forwards to run, about {duration(total)} on {cpu_model()}")
    return total


# ---------------------------------------------------------------- the command


def parse_args(argv: list[str]):
    parser = cli.ArgumentParser(
        prog="python -m picollama.lab.context.perplexity", description=__doc__.split("\n\n")[0]
    )
    cli.add_run(parser)
    cli.add_device(parser)
    parser.add_argument(
        "--methods",
        type=comma_list(choices=[*ROPE_SCALINGS, *(name + LOGN for name in ROPE_SCALINGS)]),
        default=list(METHODS),
        help=f"length methods, comma-separated, each with {LOGN} after it for log-n attention "
        f"too (default {','.join(METHODS)})",
    )
    parser.add_argument(
        "--multiples",
        type=comma_list(positive(float)),
        help=f"lengths as multiples of the context (default {','.join(map(str, MULTIPLES))})",
    )
    parser.add_argument("--lengths", type=comma_list(positive()), help="lengths in tokens")
    parser.add_argument(
        "--windows",
        type=comma_list(positive()),
        help="windows read at each length past the context, one count or one a length (default "
        "8 at 2x, 4 at 4x, 2 at 8x and beyond); every window is read at 1x too",
    )
    parser.add_argument(
        "--scored", type=positive(), default=SCORED, help=f"tokens scored (default {SCORED})"
    )
    parser.add_argument(
        "--chunk", type=positive(), default=CHUNK, help=f"prefill chunk (default {CHUNK})"
    )
    parser.add_argument("--plan", action="store_true", help="print the plan and its estimate")
    cli.add_out(parser, "the study's folder: cells/ and the report")
    parser.needed = [*parser.needed, ("out", "--out")]
    return parser.parse_args(argv)


def load_books(run: Path, tokenizer, vocab_size: int) -> dict[str, np.ndarray]:
    """Every book's tokens in the run's tokenizer. UserError if an id is past the vocabulary."""
    books = {book.name: book_tokens(book, tokenizer, tokenizer_file(run)) for book in BOOKS}
    for name, tokens in books.items():
        if tokens.max() >= vocab_size:
            raise UserError(f"{name} has token ids past the model's {vocab_size} embeddings")
    return books


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run = imported_run(args.run)
    device = pick_device(args.device)
    model, _, tokenizer = load_run(run, device, pick_dtype(args.dtype, device))
    plan = make_plan(args, model.args.original_seq_len)
    books = load_books(run, tokenizer, model.args.vocab_size)
    sizes = {name: len(tokens) for name, tokens in books.items()}
    windows = layout(sizes, plan.longest(), plan.scored)
    if args.plan:
        print_plan(model, plan, windows, args.out)
        return 0
    pyplot()  # Without matplotlib, fail now rather than after hours of cells.
    command = ["python", "-m", "picollama.lab.context.perplexity", *argv]
    # The run by its folder's name: a relative and an absolute --run read as one model.
    computed = study(model, Path(run).resolve().name, plan, windows, books, args.out, command)
    written = write_report(args.out)
    print(f"{computed} cells read; cells in {args.out / 'cells'}; report {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
