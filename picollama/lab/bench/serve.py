"""Our OpenAI-compatible server against llama.cpp's own llama-server, on one GGUF file.

llama-server (continuous batching over 4 slots) is the anchor. llama-cpp-python's server, which
runs one request at a time, stands beside it. 1, 4 and 8 concurrent clients stream the same chat
prompts. It reports aggregate completion tokens/s and time to first token. With --turns, one
client holds a conversation instead, and it reports each turn's time to first token: a server
that keeps the conversation's KV cache prefills only each turn's new tokens."""

import importlib.util
import os
import shlex
import sys
import tempfile
from operator import itemgetter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import comma_list, positive
from picollama.cli.outputs import atomic_output
from picollama.lab.bench import common
from picollama.lab.bench.llamacpp import (
    LLAMA_CPP_BODY,
    LLAMA_CPP_OPTIONS,
    LLAMA_SERVER,
    has_amx,
    llama_server_flags,
)
from picollama.lab.bench.serve_load import (
    ServerProcess,
    TokenCounter,
    TurnText,
    conversation,
    free_port,
    message_tokens,
    python_module,
    run_clients,
)

SERVERS = ("ours", "llama_server", "llama_cpp")
NAMES = {"ours": "picollama.serve", "llama_server": "llama-server", "llama_cpp": "llama_cpp.server"}
ANCHORS = ("llama_server", "llama_cpp")  # whom the ratios take, the first one measured
# Questions whose answers run past the default 64 tokens, so every request ends at max_tokens.
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part.",
    "Describe the water cycle in detail.",
    "What are the main causes of the French Revolution? Explain each one.",
    "Give me ten tips for learning a new language, with a sentence on each.",
    "Explain the difference between weather and climate, with examples.",
    "Describe a day in the life of a medieval blacksmith.",
    "How do airplanes stay in the air? Explain it to a curious teenager.",
]
WARM_UP = "Say hello."
TTFT_KEYS = ("ttft_p50_seconds", "ttft_p95_seconds")


def parse_args(argv: list[str]):
    """The flags, with --smoke's single short request filled in."""
    p = common.parser(__doc__, "serve", models=False)
    p.add_argument(
        "--gguf",
        type=Path,
        default=os.environ.get("PICOLLAMA_SMOLLM2_GGUF"),
        help="the GGUF file both servers load (default: $PICOLLAMA_SMOLLM2_GGUF)",
    )
    add_load_flags(p)
    p.add_argument(
        "--servers",
        type=comma_list(choices=SERVERS),
        help=f"which servers, comma-separated (default {','.join(SERVERS)}; llama_server only "
        "where its binary is found)",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("PICOLLAMA_LLAMA_SERVER", LLAMA_SERVER),
        help="llama.cpp's llama-server binary (default: $PICOLLAMA_LLAMA_SERVER, else "
        f"{LLAMA_SERVER})",
    )
    p.add_argument(
        "--threads",
        type=positive(),
        default=os.cpu_count(),
        help=f"llama.cpp's threads, decoding and prompts (default: every core, {os.cpu_count()})",
    )
    p.add_argument(
        "--n-ctx",
        type=positive(),
        default=2048,
        help="llama_cpp.server's context (default 2048, its own: room for the prompts and "
        "max_tokens; its KV cache is sized by it)",
    )
    p.add_argument(
        "--ours-args",
        default="",
        metavar="FLAGS",
        help="more flags for python -m picollama.serve, e.g. '--compile' (default none)",
    )
    add_turn_flags(p)
    given, _ = p.parse_known_args(argv)
    if given.turns and not given.smoke and given.out is None:  # not the client levels' file
        argv = [*argv, "--out", str(common.RESULTS_DIR / "serve_turns.json")]
    cli = common.parse(p, argv)
    if cli.servers is None:
        found = cli.llama_server.is_file()
        cli.servers = [name for name in SERVERS if found or name != "llama_server"]
    if cli.smoke:  # One thread each, so seconds even on a busy machine.
        cli.clients, cli.requests, cli.max_tokens, cli.threads = [1], 1, 4, 1
        cli.repeats = 1
        cli.ours_args = f"--threads 1 {cli.ours_args}"
        cli.turns, cli.conversation_tokens = cli.turns and min(cli.turns, 3), 120
    check(cli)
    return cli


def add_turn_flags(p):
    """--turns and the conversation's length."""
    p.add_argument(
        "--turns",
        type=positive(),
        help="one client's conversation of this many turns instead of --clients: each turn sends "
        "the turns before with their answers and a new message; reports each turn's time to "
        "first token, the last over the first (default --out docs/results/serve_turns.json)",
    )
    p.add_argument(
        "--conversation-tokens",
        type=positive(),
        default=2000,
        help="with --turns: about how long the conversation is at its last turn, answers "
        "included (default 2000)",
    )


def add_load_flags(p):
    """The load each server is measured under: clients, requests, tokens, repeats."""
    p.add_argument(
        "--clients",
        type=comma_list(positive()),
        default="1,4,8",
        help="concurrent clients to measure, comma-separated (default 1,4,8)",
    )
    p.add_argument(
        "--requests", type=positive(), default=4, help="requests each client sends (default 4)"
    )
    p.add_argument(
        "--max-tokens", type=positive(), default=64, help="max_tokens of each request (default 64)"
    )
    p.add_argument(
        "--repeats",
        type=positive(),
        default=3,
        help="times each server is started and measured; each client count reports its median "
        "run by tokens/s (default 3: one start of llama_cpp.server ran at 32 tokens/s, the next at "
        "74, on the same idle machine)",
    )


def check(cli):
    """UserError for a missing GGUF file or llama-cpp-python server, before any server starts."""
    if cli.gguf is None:
        raise UserError("no GGUF file: pass --gguf FILE (or set PICOLLAMA_SMOLLM2_GGUF)")
    if not cli.gguf.is_file() or cli.gguf.suffix != ".gguf":
        raise UserError(f"--gguf {cli.gguf}: not a .gguf file")
    needed = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if "llama_cpp" in cli.servers and missing:
        raise UserError(
            f"llama_cpp.server needs {', '.join(missing)}: pip install "
            "'llama-cpp-python[server]' (or --servers ours)"
        )
    if "llama_server" in cli.servers and not cli.llama_server.is_file():
        raise UserError(
            f"--llama-server {cli.llama_server}: no such file (build llama.cpp's llama-server, or "
            "leave llama_server out of --servers)"
        )


def command(cli, server: str, port: int) -> list[str]:
    """The command that starts `server` on 127.0.0.1:port, serving cli.gguf."""
    if server == "ours":
        flags = ["--run", cli.gguf, "--port", port, *shlex.split(cli.ours_args)]
        return python_module("picollama.serve", *flags)
    if server == "llama_server":
        return [*map(str, [cli.llama_server, *llama_server_flags(cli)]), "--port", str(port)]
    threads = ["--n_threads", cli.threads, "--n_threads_batch", cli.threads]
    options = [x for flag, (value, _) in LLAMA_CPP_OPTIONS.items() for x in (flag, value)]
    flags = ["--model", cli.gguf, "--host", "127.0.0.1", "--port", port, *threads]
    # llama_cpp.server itself, with extra CPU buffer types off on AMX CPUs, where they crash.
    launcher = "picollama.lab.bench.llamacpp"
    return python_module(launcher, *flags, "--n_ctx", cli.n_ctx, *options)


def body(server: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat request for one prompt."""
    asked = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return asked | (LLAMA_CPP_BODY if server == "llama_cpp" else {})


def level(server: ServerProcess, name: str, clients: int, cli, counter, progress) -> dict:
    """`clients` clients at once, each sending cli.requests prompts (client c from PROMPTS[c] on):
    aggregate tokens/s and time to first token."""
    bodies = [
        [body(name, PROMPTS[(c + r) % len(PROMPTS)], cli.max_tokens) for r in range(cli.requests)]
        for c in range(clients)
    ]
    samples, seconds = run_clients(server, bodies, progress)
    tokens = [counter(s) for s in samples]
    ttfts = [s.ttft for s in samples]
    return {
        "clients": clients,
        "requests": len(samples),
        "completion_tokens": sum(tokens),
        "seconds": seconds,
        "tokens_per_second": sum(tokens) / seconds,
        **{key: float(np.percentile(ttfts, q)) for key, q in zip(TTFT_KEYS, (50, 95))},
        "ended_before_max_tokens": sum(t < cli.max_tokens for t in tokens),
        "ttft_seconds": ttfts,
        "first_answer": samples[0].text,  # The same from both servers, where they agree.
    }


def measure(cli, name: str, folder: Path) -> dict:
    """Each client count's median run (by tokens/s) of cli.repeats starts of the server, every
    run's tokens/s beside it, and the command of the first start."""
    counter = TokenCounter(cli.gguf, cli.max_tokens)
    total = sum(cli.clients) * cli.requests * cli.repeats
    with tqdm(total=total, desc=f"{NAMES[name]} requests", disable=None) as progress:
        runs = [measure_once(cli, name, folder, counter, progress) for _ in range(cli.repeats)]
    levels = []
    for i in range(len(cli.clients)):
        tried = sorted((run[1][i] for run in runs), key=itemgetter("tokens_per_second"))
        median = tried[(len(tried) - 1) // 2]  # The lower middle, so an even count errs low.
        median["tokens_per_second_runs"] = [run[1][i]["tokens_per_second"] for run in runs]
        levels.append(median)
    return {"command": runs[0][0], "repeats": cli.repeats, "levels": levels}


def measure_once(cli, name: str, folder: Path, counter, progress) -> tuple[str, list[dict]]:
    """Start the server (its log in folder), warm it up with one request, measure each client
    count, stop it: (its command, a result a client count)."""
    port = free_port()
    argv = command(cli, name, port)
    progress.write(f"starting {NAMES[name]}: {shlex.join(map(str, argv[1:]))}")
    levels = []
    with ServerProcess(NAMES[name], argv, port, folder / f"{name}.log") as server:
        run_clients(server, [[body(name, WARM_UP, cli.max_tokens)]])
        for clients in cli.clients:
            levels.append(level(server, name, clients, cli, counter, progress))
            progress.write(summary(NAMES[name], levels[-1]))
    return shlex.join(map(str, argv)), levels


def plural(n: int, what: str) -> str:
    """ "1 client", "4 clients"."""
    return f"{n} {what}{'s' * (n != 1)}"


def summary(name: str, said: dict) -> str:
    """One line on one client count's results."""
    return (
        f"{name}, {plural(said['clients'], 'client')}: {said['tokens_per_second']:.1f} tokens/s, "
        f"time to first token p50 {said['ttft_p50_seconds']:.3f} s, "
        f"p95 {said['ttft_p95_seconds']:.3f} s"
    )


def ratios(results: dict) -> dict[str, list[dict]]:
    """Ours over each peer measured, at each client count: tokens/s (higher is better for ours),
    time to first token p50 and p95 (lower is better for ours)."""
    keys = ("tokens_per_second", *TTFT_KEYS)
    return {
        peer: [
            {"clients": ours["clients"], **{key: ours[key] / theirs[key] for key in keys}}
            for ours, theirs in zip(results["ours"]["levels"], results[peer]["levels"])
        ]
        for peer in ANCHORS
        if "ours" in results and peer in results
    }


def markdown(cli, results: dict, compared: dict, load: float) -> str:
    """The results as a Markdown table (a row per client count), with what was run and on what:
    ours over the anchor (llama-server where it ran) in the last columns."""
    machine = common.machine_info("cpu")
    headers = ["clients"]
    for name in results:
        headers += [f"{NAMES[name]} {x}" for x in ("tokens/s", "TTFT p50 (s)", "TTFT p95 (s)")]
    anchor = next(iter(compared), None)
    if anchor:
        headers += [f"ours / {NAMES[anchor]}: {x}" for x in ("tokens/s", "TTFT p50", "TTFT p95")]
    rows = []
    for i, clients in enumerate(cli.clients):
        row = [str(clients)]
        for result in results.values():
            said = result["levels"][i]
            row += [f"{said['tokens_per_second']:.1f}"]
            row += [f"{said[k]:.3f}" for k in ("ttft_p50_seconds", "ttft_p95_seconds")]
        if anchor:
            ratio = compared[anchor][i]
            row += [f"{ratio[k]:.2f}x" for k in ("tokens_per_second", *TTFT_KEYS)]
        rows.append(row)
    options = " ".join(f"{flag} {value}" for flag, (value, _) in LLAMA_CPP_OPTIONS.items())
    theirs = (
        f" llama_cpp.server: {plural(cli.threads, 'thread')}, n_ctx {cli.n_ctx}, {options}, "
        "repeat_penalty 1.0."
        if "llama_cpp" in results
        else ""
    )
    if "llama_server" in results:
        theirs += f" llama-server: {shlex.join(map(str, llama_server_flags(cli)))}."
    lines = [
        f"# Serving: {' against '.join(NAMES[name] for name in results)}",
        "",
        f"`{cli.gguf.name}`; {plural(cli.requests, 'streamed chat request')} per client, one after "
        f"another, max_tokens {cli.max_tokens}, temperature 0; each server started "
        f"{plural(cli.repeats, 'time')}, the median run a row; {machine['cpu']}, "
        f"{machine['cpu_cores']} cores, load average {load:.2f} before and "
        f"{machine['load_average_1min']:.2f} after.{theirs}",
        "",
        *table_rows(headers, rows, results),
    ]
    return "\n".join(lines) + "\n"


def measure_turns(cli, name: str, folder: Path, texts: TurnText) -> dict:
    """cli.repeats starts of the server, each warmed up with one request and then holding one
    conversation from `texts`: each turn's median time to first token, the last over the first."""
    runs = []
    for _ in range(cli.repeats):
        port = free_port()
        argv = command(cli, name, port)
        print(f"starting {NAMES[name]}: {shlex.join(map(str, argv[1:]))}", file=sys.stderr)
        with ServerProcess(NAMES[name], argv, port, folder / f"{name}.log") as server:
            run_clients(server, [[body(name, WARM_UP, cli.max_tokens)]])
            asked = body(name, "", cli.max_tokens)
            runs.append(conversation(server, texts.restart(), cli.turns, asked))
    each = [[sample.ttft for sample in run] for run in runs]
    ttfts = np.median(each, axis=0).tolist()
    return {
        "command": shlex.join(map(str, argv)),
        "repeats": cli.repeats,
        "ttft_seconds": ttfts,
        "ttft_seconds_runs": each,
        "prompt_tokens": [sample.prompt_tokens for sample in runs[-1]],
        "last_over_first": ttfts[-1] / ttfts[0],
    }


def turns_markdown(cli, results: dict, load: float) -> str:
    """--turns' results as a Markdown table: a row a turn, the last over the first at the end."""
    machine = common.machine_info("cpu")
    headers = ["turn", "prompt tokens", *(f"{NAMES[name]} TTFT (s)" for name in results)]
    tokens = next(iter(results.values()))["prompt_tokens"]
    rows = [
        [str(t + 1), str(tokens[t] or "")]
        + [f"{r['ttft_seconds'][t]:.3f}" for r in results.values()]
        for t in range(cli.turns)
    ]
    rows.append(["last / first", ""] + [f"{r['last_over_first']:.2f}x" for r in results.values()])
    lines = [
        f"# Serving: a conversation of {plural(cli.turns, 'turn')}",
        "",
        f"`{cli.gguf.name}`; one client, each turn a new message of {message_tokens(cli)} tokens "
        "(and as many more as the answer before fell short of max_tokens) after the turns before "
        f"and their answers (about {cli.conversation_tokens:,} tokens at the last), "
        f"max_tokens {cli.max_tokens}, temperature 0; the median of "
        f"{plural(cli.repeats, 'start')} of each server; {machine['cpu']}, "
        f"{machine['cpu_cores']} cores, load average {load:.2f} before and "
        f"{machine['load_average_1min']:.2f} after.",
        "",
        *table_rows(headers, rows, results),
    ]
    return "\n".join(lines) + "\n"


def table_rows(headers: list[str], rows: list[list[str]], results: dict) -> list[str]:
    """A Markdown table's lines, then each server's command."""
    return [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join(["---:"] * len(headers)) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        *(f"- `{result['command']}`" for result in results.values()),
    ]


def write(cli, table: str, payload: dict):
    """The table on stdout and beside --out (.md), and the JSON at --out: both or neither."""
    print(table)
    table_path = cli.out.with_suffix(".md")
    table_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(table_path) as md:
        md.write_text(table)
        common.write_results(cli, payload)
    print(f"the table: {table_path}")


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="picollama-bench-serve-") as folder:
        if cli.turns:
            texts = TurnText(cli.gguf, " ".join(PROMPTS), message_tokens(cli))
            results = {n: measure_turns(cli, n, Path(folder), texts) for n in cli.servers}
        else:
            results = {name: measure(cli, name, Path(folder)) for name in cli.servers}
    if cli.turns:
        turns = dict(turns=cli.turns, max_tokens=cli.max_tokens, message_tokens=message_tokens(cli))
        write(cli, turns_markdown(cli, results, load), {**turns, "results": results})
        return 0
    compared = ratios(results)
    table = markdown(cli, results, compared, load)
    payload = {
        "gguf": str(cli.gguf),
        "load_average_1min_before": load,
        "clients": cli.clients,
        "requests_per_client": cli.requests,
        "max_tokens": cli.max_tokens,
        "prompts": PROMPTS,
        "llama_cpp_threads": cli.threads,
        "llama_cpp_n_ctx": cli.n_ctx,
        "llama_cpp_options": {
            flag: dict(value=v, why=why) for flag, (v, why) in LLAMA_CPP_OPTIONS.items()
        },
        "llama_cpp_body": LLAMA_CPP_BODY,
        "llama_cpp_extra_buffer_types": "off (an AMX CPU)" if has_amx() else "on (its default)",
        "results": results,
        **{f"ours_over_{peer}": each for peer, each in compared.items()},
    }
    write(cli, table, payload)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
