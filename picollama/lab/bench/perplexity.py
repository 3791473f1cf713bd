"""Our perplexity against llama.cpp's, on the same GGUF file and the same tokens.

It checks that the study's numbers on a real model are the model's, not an artefact of our
forward."""

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.loader import document_windows
from data.tokenizer import HFTokenizer
from model import Transformer
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.convert.from_gguf import import_gguf
from picollama.convert.main import imported_run
from picollama.convert.to_gguf import write_gguf
from picollama.lab.bench import common
from picollama.lab.scoring import token_losses
from picollama.run_files import load_model


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "perplexity", models=False)
    p.add_argument("--gguf", type=Path, help="an F32 or F16 Llama-family GGUF file")
    p.add_argument("--data", type=Path, help="a dataset prepared with that model's tokenizer")
    p.add_argument(
        "--length", type=positive(), default=8192, help="tokens in the window (default 8192)"
    )
    p.add_argument("--threads", type=positive(), help="CPU threads of both (default: all cores)")
    args = common.parse(p, argv)
    if not args.smoke and (args.gguf is None or args.data is None):
        raise UserError("--gguf and --data are required (or --smoke)")
    return args


def smoke_gguf(folder: Path) -> tuple[Path, int]:
    """A random tiny Llama with a tiny byte-level BPE, as an F32 GGUF file, and its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet
    )
    backend.train_from_iterator(["a tiny model, a tiny text"] * 10, trainer)
    tokenizer = HFTokenizer(spec=backend.to_str(), config={"bos_token": "<s>", "eos_token": "</s>"})
    torch.manual_seed(0)
    args = common.model_args("smoke")
    model = Transformer(type(args)(**args.to_dict() | {"vocab_size": backend.get_vocab_size()}))
    write_gguf(model.eval(), tokenizer, folder / "smoke.gguf", "f32", "smoke")
    return folder / "smoke.gguf", model.args.vocab_size


def ours(run: Path, tokens: np.ndarray) -> np.ndarray:
    """Our float32 losses of tokens[1:] given everything before each."""
    model, _ = load_model(run)
    with torch.inference_mode():
        return token_losses(model.eval(), torch.from_numpy(tokens)[None])[0].numpy()


def llama_cpp_losses(gguf: Path, tokens: np.ndarray, threads: int) -> np.ndarray:
    """llama.cpp's losses of tokens[1:] from its logits of the whole window in one context."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError("llama-cpp-python is not installed: pip install -e '.[llama]'") from None
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(tokens),
        n_batch=512,
        logits_all=True,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    llm.eval(tokens.tolist())
    logits = torch.from_numpy(np.asarray(llm.scores[: len(tokens) - 1], dtype=np.float32))
    del llm
    targets = torch.from_numpy(tokens[1:])
    return F.cross_entropy(logits, targets, reduction="none").numpy()


def timed(work, *args):
    start = time.perf_counter()
    cpu = time.process_time()
    result = work(*args)
    return result, time.perf_counter() - start, time.process_time() - cpu


@common.one_writer
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    folder = tempfile.TemporaryDirectory(prefix="picollama-perplexity-")
    if args.smoke:  # Imported into the temporary folder, not the cache.
        gguf, vocab = smoke_gguf(Path(folder.name))
        tokens = np.random.default_rng(0).integers(2, vocab, size=32)
        run = Path(folder.name) / "run"
        import_gguf(gguf, run)
    else:
        gguf = args.gguf
        tokens = document_windows(args.data, "val", args.length, 1)[0]
        run = imported_run(gguf)
    our_losses, our_wall, our_cpu = timed(ours, run, tokens)
    their_losses, their_wall, _ = timed(llama_cpp_losses, gguf, tokens, threads)
    folder.cleanup()
    ppl = math.exp(our_losses.mean()), math.exp(their_losses.mean())
    gap = np.abs(our_losses - their_losses)
    result = {
        "gguf": str(gguf),
        "data": None if args.smoke else str(args.data),
        "tokens": len(tokens),
        "threads": threads,
        "perplexity": {"ours": ppl[0], "llama_cpp": ppl[1]},
        "ours_over_llama_cpp": ppl[0] / ppl[1],
        "loss_abs_difference": {"mean": float(gap.mean()), "max": float(gap.max())},
        "seconds": {"ours": our_wall, "ours_cpu": our_cpu, "llama_cpp": their_wall},
    }
    common.print_table(
        ["", "perplexity", "seconds"],
        [
            ["ours", f"{ppl[0]:.4f}", f"{our_wall:.1f}"],
            ["llama.cpp", f"{ppl[1]:.4f}", f"{their_wall:.1f}"],
        ],
    )
    print(f"ours / llama.cpp: {ppl[0] / ppl[1]:.5f} over {len(tokens) - 1:,} scored tokens")
    common.write_results(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
