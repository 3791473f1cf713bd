"""What bf16 products in a prefill's attention cost a block-format model: its logits with the
attention's products in fp32, in bf16 and through PyTorch's SDPA, beside the same file's
dequantized weights and llama.cpp's own logits.

kernels/prefill.py gives a block-format model (Q4_0, Q4_1, Q8_0 on a CPU) bf16 products. Its
linear layers round their inputs to int8, so any change to attention's output moves the logits
about as much. Each window of the context study's books (lab/context/text.py) is read whole
each way. The table gives each way's perplexity, and its logits against llama.cpp's."""

import argparse
import contextlib
import math
import os
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.convert.main import imported_run
from picollama.device import cpu_sdpa
from picollama.kernels.load import load_to_sample
from picollama.kernels.prefill import bf16_products, prefill_sdpa
from picollama.lab.bench import common
from picollama.lab.context.text import BOOKS, book_tokens, layout
from picollama.run_files import load_run, tokenizer_file

WAYS = {  # the block-format model's attention
    "fp32 products": partial(prefill_sdpa, bf16=False),
    "bf16 products": partial(prefill_sdpa, bf16=True),
    "PyTorch SDPA (fp32)": F.scaled_dot_product_attention,
}
DEQUANTIZED = "dequantized weights, fp32 throughout"


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "prefill_products", models=False)
    p.add_argument("--run", help="a block-format GGUF file (default $PICOLLAMA_SMOLLM2_GGUF)")
    p.add_argument("--windows", type=int, default=4, help="windows read (default 4)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens a window (default 1024)")
    cli = common.parse(p, argv)
    cli.run = cli.run or os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
    if cli.run is None:
        raise UserError("--run GGUF is required (or set PICOLLAMA_SMOLLM2_GGUF)")
    if cli.smoke:
        cli.windows, cli.tokens = 1, 128
    return cli


def windows(run: Path, tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    """`count` windows of `tokens` tokens, laid out in the books as the context study lays its."""
    books = {book.name: book_tokens(book, tokenizer, tokenizer_file(run)) for book in BOOKS}
    sizes = {name: len(ids) for name, ids in books.items()}
    spans = [books[w.book][w.end - tokens : w.end] for w in layout(sizes, [tokens] * count, tokens)]
    return [torch.from_numpy(span.astype(np.int64))[None] for span in spans]


@torch.inference_mode()
def logits_of(model, x: torch.Tensor, kernel) -> torch.Tensor:
    with cpu_sdpa(torch.device("cpu"), kernel):
        return model(x)[0].float()


@contextlib.contextmanager
def llama_cpp(gguf: Path | None, tokens: int):
    """llama.cpp's model of the GGUF file, for windows of `tokens`: None without one or without
    llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if gguf is None or llama_cpp is None:
        yield None
        return
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        str(gguf), n_ctx=tokens, logits_all=True, n_threads=threads, verbose=False
    )
    try:
        yield llm
    finally:
        llm.close()


def llama_cpp_logits(llm, x: torch.Tensor) -> torch.Tensor | None:
    """llama.cpp's logits for x (None without its model)."""
    if llm is None:
        return None
    llm.reset()
    llm.eval(x[0].tolist())
    return torch.tensor(np.array(llm.scores[: x.shape[1]]), dtype=torch.float32)


def compare(logits: torch.Tensor, x: torch.Tensor, theirs: torch.Tensor | None) -> dict:
    """A way's loss over the window, and its logits against llama.cpp's where there are some."""
    said = {"loss": F.cross_entropy(logits[:-1], x[0, 1:]).item()}
    if theirs is not None:
        said["rms_logit_gap"] = (logits - theirs).pow(2).mean().sqrt().item()
        said["top1_agree"] = (logits.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return said


def measure(cli) -> dict:
    """{way: its mean loss, perplexity over fp32 products' and its gap to llama.cpp} over the
    windows."""
    run = imported_run(cli.run)
    sampled = argparse.Namespace(run=cli.run, dtype="auto", quantize="auto")
    model, tokenizer, _ = load_to_sample(sampled, torch.device("cpu"))
    if not bf16_products(model) or model.tok_embeddings.weight.dtype != torch.float32:
        raise UserError(f"{cli.run} is not a block-format model (Q4_0, Q4_1, Q8_0) on a CPU")
    dequantized = load_run(run, "cpu", torch.float32)[0].eval()
    gguf = Path(cli.run) if str(cli.run).endswith(".gguf") else None
    said = {way: [] for way in [*WAYS, DEQUANTIZED]}
    with llama_cpp(gguf, cli.tokens) as llm:
        for x in tqdm(windows(run, tokenizer, cli.windows, cli.tokens), desc="windows"):
            theirs = llama_cpp_logits(llm, x)
            for way, kernel in WAYS.items():
                said[way].append(compare(logits_of(model, x, kernel), x, theirs))
            plain = logits_of(dequantized, x, F.scaled_dot_product_attention)
            said[DEQUANTIZED].append(compare(plain, x, theirs))
    means = {
        way: {k: float(np.mean([w[k] for w in each])) for k in each[0]}
        for way, each in said.items()
    }
    for mean in means.values():
        mean["perplexity_over_fp32"] = math.exp(mean["loss"] - means["fp32 products"]["loss"])
    return means


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    results = measure(cli)
    print(f"{cli.windows} windows of {cli.tokens:,} tokens of {cli.run}")
    headers = ["attention", "loss", "ppl / fp32 products", "rms gap to llama.cpp", "top-1 agree"]
    rows = []
    for way, r in results.items():
        gap, agree = r.get("rms_logit_gap"), r.get("top1_agree")
        rows.append([way, f"{r['loss']:.4f}", f"{r['perplexity_over_fp32']:.4f}"])
        rows[-1] += ["-" if gap is None else f"{gap:.3f}", "-" if agree is None else f"{agree:.3f}"]
    common.print_table(headers, rows)
    payload = {"run": str(cli.run), "windows": cli.windows, "tokens": cli.tokens}
    common.write_results(cli, {**payload, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
