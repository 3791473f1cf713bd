"""RULER's effective length of a real model, by length method: `python -m
picollama.lab.context.ruler --run RUN --methods none,yarn --lengths 4096,8192 --out FOLDER`.

Each cell is one task at one length under one method. Its haystack (ruler_tasks.py) runs into the
KV cache once, in chunks, so 32k and 64k fit in memory. Then each question runs from the end of
the haystack and is answered greedily. The next question overwrites the same cache positions.
So one prefill serves every question of a cell. The score is RULER's string_match_all, 0-100.
The effective length is the longest length up to which the mean over the tasks stays above
RULER's threshold, 85.6 (Llama-2-7B's mean at 4k). A small model may score below it at the
shortest length. So the length up to which the mean stays within 5 points of that shortest
length's is reported too. The prompt is RULER's plain "base" template unless --template chat:
on SmolLM2-135M-Instruct at 4k the chat template halved niah_single's score (15 against 30).
ruler_report.py writes the report from the cells. One run a folder. Another --seed adds other
needles, and so more questions, to the folder's cells, and the report pools the seeds."""

import hashlib
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from model import rope_frequencies
from picollama.chat_template import load_chat_template, stop_ids
from picollama.cli import UserError
from picollama.cli.command import Interrupted, run_command
from picollama.cli.flags import (
    ArgumentParser,
    add_device,
    add_out,
    add_run,
    add_seed,
    comma_list,
    positive,
)
from picollama.cli.outputs import check_writable
from picollama.components.length import length_dependent, stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.convert.main import imported_run
from picollama.device import pick_device, pick_dtype
from picollama.lab.bench.common import cpu_model
from picollama.lab.context.cells import Cells
from picollama.lab.context.ruler_report import write_report
from picollama.lab.context.ruler_tasks import TASKS, Haystack, haystack, match_all
from picollama.lab.interruptible import interruptible
from picollama.lab.runs import scalings
from picollama.lab.text_track import forward_key
from picollama.run_files import load_run

SAMPLE = 5  # answers a cell keeps in full, beside every question's score
CHUNK = 2048  # tokens a prefill forward takes at once
FROZEN = {"dynamic": "ntk"}  # a length-dependent scaling -> the static one of equal frequencies


def method_args(args, method: str, length: int):
    """The model's args under `method` for `length` tokens (components.length.stretched).

    Dynamic NTK's frequencies follow each forward's end, so chunks of one haystack would turn by
    different ones. It is held at its frequencies for `length` tokens instead: NTK at factor
    length/original, checked equal here."""
    stretch = stretched(args, method, length)
    if not length_dependent(stretch):
        return stretch
    factor = max(1.0, length / stretch.original_seq_len)
    held = replace(stretch, rope_scaling=FROZEN.get(method, method), rope_factor=factor)
    if length_dependent(held) or not torch.equal(
        rope_frequencies(held, length)[0], rope_frequencies(stretch, length)[0]
    ):
        raise UserError(
            f"--methods {method}: its frequencies follow the length and have no fixed form"
        )
    return held


@torch.inference_mode()
def prefill(model, tokens: list[int], room: int, chunk: int | None = None):
    """Run the haystack into a fresh KV cache of `room` positions, `chunk` (CHUNK) at a time."""
    chunk = chunk or CHUNK
    device = model.tok_embeddings.weight.device
    row = torch.tensor([tokens], device=device)
    model.setup_cache(1, room)
    starts = range(0, len(tokens), chunk)
    for start in tqdm(starts, desc="haystack", unit="chunk", leave=False):
        interruptible(model.features, row[:, start : start + chunk], start_pos=start)


@torch.inference_mode()
def greedy(model, tokens: list[int], start: int, steps: int, stops: set[int]) -> list[int]:
    """The greedy continuation of a question that follows `start` cached tokens: at most
    `steps` tokens, ending before a stop token."""
    device = model.tok_embeddings.weight.device
    given, made = torch.tensor([tokens], device=device), []
    for _ in range(steps):
        choice = int(model.head(model.features(given, start_pos=start)[:, -1]).argmax())
        if choice in stops:
            break
        made.append(choice)
        start += given.shape[1]
        given = torch.tensor([[choice]], device=device)
    return made


def answer_all(model, tokenizer, hay: Haystack, room: int, stops: set[int]) -> tuple[list, float]:
    """Every question of a haystack answered through its one prefill, and the prefill's seconds."""
    start = time.perf_counter()
    prefill(model, hay.tokens, room)
    seconds, answers = time.perf_counter() - start, []
    try:
        for question in tqdm(hay.questions, desc="questions", unit="q", leave=False):
            made = greedy(model, question.tokens, len(hay.tokens), TASKS[hay.task].tokens, stops)
            text = tokenizer.decode(made)
            answers.append(
                {
                    "key": question.key,
                    "expected": question.answers,
                    "generated": text,
                    "depth": round(question.depth, 3),
                    "score": match_all(question.answers, text),
                }
            )
    finally:
        model.reset_cache()
    return answers, seconds


def cell_result(method: str, length: int, hay: Haystack, answers: list, seconds: tuple) -> dict:
    """A cell's result. `seconds` is the cell's (prefill and answers) and the prefill's alone."""
    scores = [a["score"] for a in answers]
    return {
        "method": method,
        "length": length,
        "task": hay.task,
        "questions": len(answers),
        "correct": sum(score == 1 for score in scores),
        "score": round(100 * float(np.mean(scores)), 2),
        "seconds": round(seconds[0], 2),
        "prefill_seconds": round(seconds[1], 2),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads()},
        "haystack_tokens": len(hay.tokens),
        "answers": answers[:SAMPLE],
        "scores": scores,
        "depths": [a["depth"] for a in answers],
    }


def fingerprint(args, length: int, setup: dict) -> str:
    """What a cell computes: the forward (text_track.forward_key) and the setup. Methods that
    compute equal forwards at a length (all static scalings at factor 1, and the methods that
    attend in branches, which attend as plain RoPE there) share their cells."""
    what = repr((forward_key(args, length), sorted(setup.items())))
    return hashlib.sha256(what.encode()).hexdigest()


def same_forward(cells: Cells, length: int, task: str, mark: str) -> tuple[str, dict] | None:
    """A saved cell of this task and length that computed the same forward, by its key."""
    for key, result in cells.results("ruler.").items():
        if (result["length"], result["task"], result.get("forward")) == (length, task, mark):
            return key, result
    return None


def cell_key(method: str, length: int, task: str, seed: int) -> str:
    """The name of a cell's file: seed 0's has none, as before seeds were pooled."""
    return f"ruler.{method}.{length}.{task}" + (f".seed={seed}" if seed else "")


def check_setup(cells: Cells, setup: dict):
    """UserError when the folder holds cells of another run or setup, bar the seed: they would
    mix."""
    for key, result in cells.results("ruler.").items():
        saved = result.get("setup") or {}
        differ = [
            f"{name} {saved.get(name)}, not {setup[name]}"
            for name in setup
            if name != "seed" and saved.get(name) != setup[name]
        ]
        if differ:
            raise UserError(
                f"{cells.folder} holds cells of another setup ({key}: {', '.join(differ)}); "
                "pass another --out"
            )


def run_study(model, tokenizer, template: str | None, cli, cells: Cells) -> dict:
    """Every cell of the plan not yet saved: lengths, then tasks, then methods, so that the
    methods of a length and task share one haystack. Returns the setup the cells record."""
    setup = {"run": str(Path(cli.run).resolve()), "seed": cli.seed, "questions": cli.questions}
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    setup |= {"template": "base" if template is None else "chat", "dtype": dtype}
    check_setup(cells, setup)
    stops = stop_ids(tokenizer, template) if template else {tokenizer.eos_id()} - {-1}
    base, hay = model.args, None
    plan = [(n, task, m) for n in cli.lengths for task in cli.tasks for m in cli.methods]
    try:
        for length, task, method in tqdm(plan, desc="ruler cells", unit="cell"):
            key = cell_key(method, length, task, cli.seed)
            if cells.done(key):
                continue
            model.args = method_args(base, method, length)
            mark = fingerprint(model.args, length, setup)
            twin = same_forward(cells, length, task, mark)
            if twin is not None:
                cells.save(key, twin[1] | {"method": method, "copied_from": twin[0]})
                continue
            if hay is None or (hay.task, hay.length) != (task, length):
                hay = haystack(task, tokenizer, template, length, cli.questions, cli.seed)
            start = time.perf_counter()
            answers, prefilled = answer_all(model, tokenizer, hay, length, stops)
            seconds = (time.perf_counter() - start, prefilled)
            result = cell_result(method, length, hay, answers, seconds)
            cells.save(key, result | {"forward": mark, "setup": setup, "command": cli.command})
    finally:
        model.args = base
    return setup


def parse_args(argv: list[str]):
    p = ArgumentParser(prog="python -m picollama.lab.context.ruler", description=__doc__)
    add_run(p)
    p.add_argument("--methods", type=comma_list(choices=ROPE_SCALINGS), default=["none"])
    p.add_argument("--lengths", type=comma_list(positive()), default=[4096], metavar="N,N")
    tasks = ",".join(TASKS)
    p.add_argument("--tasks", type=comma_list(choices=tuple(TASKS)), default=list(TASKS))
    p.add_argument("--questions", type=positive(), default=20, help="per haystack (default 20)")
    p.add_argument(
        "--template",
        choices=("base", "chat"),
        default="base",
        help="base: plain text, RULER's own (default); chat: in the run's chat template",
    )
    add_seed(p, "the needles' seed")
    add_out(p, f"the folder of the cells and ruler.md (tasks: {tasks})", required=True)
    add_device(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    cli.command = ["python", "-m", "picollama.lab.context.ruler", *argv]
    cli.run = imported_run(Path(cli.run))  # Imports a .gguf file or a Hugging Face folder.
    check_writable(cli.out / "ruler.md")
    device = pick_device(cli.device)
    model, _, tokenizer = load_run(cli.run, device, pick_dtype(cli.dtype, device))
    refused = [m for m in cli.methods if m not in scalings(model.args)]
    if refused:
        raise UserError(f"--methods {','.join(refused)}: {cli.run} does not use RoPE")
    template = load_chat_template(cli.run) if cli.template == "chat" else None
    cells = Cells(cli.out)
    try:
        run_study(model, tokenizer, template, cli, cells)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: the cells done are in {cli.out}: rerun to go on") from None
    written = write_report(cli.out, model.args.max_seq_len)
    print(Path(written[0]).read_text())
    print(
        f"wrote the cells (ruler.METHOD.LENGTH.TASK[.seed=S].json), ruler.md and ruler.png in "
        f"{cli.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
