"""`python -m picollama.serve --run RUN` starts an OpenAI-compatible server.

This module owns the flags, loading and the listening socket. The app answers requests and the
engine decodes."""

import ipaddress
import os
import queue
import socket
import sys
import threading
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.flags import (
    ArgumentParser,
    add_compile,
    add_device,
    add_run,
    add_threads,
    positive,
)
from picollama.kernels.caches import KV_CACHES, add_kv_cache_flag
from picollama.kernels.quantize import QUANTIZATIONS

API_KEY_VARIABLE = "PICOLLAMA_API_KEY"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})  # Host names a browser says here
PREFIX_CACHE_MIB = 1024  # --prefix-cache-mib's default: SmolLM2-135M's KV of 23,000 fp32 tokens


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m picollama.serve",
        description="Serve a run (or a .gguf file, or a Hugging Face directory) with OpenAI's API: "
        "/v1/chat/completions, /v1/completions, /v1/models; a chat page at /; Prometheus "
        "metrics at /metrics.",
    )
    add_run(parser)
    add_access_flags(parser)
    parser.add_argument(
        "--special-in-content",
        action="store_true",
        help="trusted clients only: special tokens' text in a message (such as <|im_end|>) becomes "
        "those tokens (default: plain text, so no client can forge a turn)",
    )
    parser.add_argument("--model-name", help="the model's id in the API (default: the run's name)")
    parser.add_argument(
        "--chat-template", metavar="FILE", help="a Jinja chat template (default: the run's own)"
    )
    add_batching_flags(parser)
    add_device(parser)
    add_threads(
        parser,
        "CPU threads for prompts and decoding",
        "torch's count, or 1 where a decode step timed at start is faster on one; then the cores "
        "other work leaves free",
    )
    add_compile(parser, "the one-token decode step, for each batch size (1, 2, 4, ...)")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="auto",
        help="weights: int8, int4 (CPU), llama.cpp's q8_0, q4_0, q4_1 (CPU), f32, bf16 (CPU "
        "kernels), none: float (default auto: a GGUF file's own format, else none)",
    )
    add_kv_cache_flag(parser)
    parser.add_argument(
        "--prefix-cache-mib",
        type=positive(int, zero=True),
        metavar="MIB",
        help="memory for the keys and values of earlier prompts and answers, reused by a prompt "
        "that starts with them (a conversation's next turn, a shared system prompt); the least "
        f"recently used go first (default {PREFIX_CACHE_MIB}, or a quarter of the memory beside "
        "the weights where less; 0: off)",
    )
    return parser


def add_access_flags(parser: ArgumentParser):
    """The flags for who may reach the server: its address and port, and the API key."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: all)",
    )
    parser.add_argument(
        "--port", type=positive(int, zero=True), default=8000, help="default 8000; 0: a free one"
    )
    parser.add_argument(
        "--api-key",
        help=f"require `Authorization: Bearer KEY` on /v1/* and /metrics (default: "
        f"${API_KEY_VARIABLE}, else no key; with none, only requests whose Host names this "
        "machine are answered); an empty key, or one with spaces around it, is refused",
    )
    parser.add_argument(
        "--insecure-no-key",
        action="store_true",
        help="listen beyond this machine (--host 0.0.0.0) with no API key: anyone who can reach "
        "it can use it, under any Host name (refused without this flag)",
    )


def add_batching_flags(parser: ArgumentParser):
    """The flags for how the engine batches: rows, queue, window and prompt spread."""
    parser.add_argument(
        "--max-batch", type=positive(), default=8, help="rows decoded together (default 8)"
    )
    static = "static batching only: a model without the fused decode step; "
    parser.add_argument(
        "--queue-size",
        type=positive(),
        default=64,
        help="requests that may wait; past it, 503 with Retry-After (default 64)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=positive(float, zero=True),
        default=10.0,
        help=f"{static}how long a batch waits for more requests after its first (default 10)",
    )
    parser.add_argument(
        "--max-prompt-spread",
        type=positive(int, zero=True),
        default=64,
        metavar="TOKENS",
        help=f"{static}prompts in one batch differ by at most this many tokens (rows step "
        "together from the shortest prompt's end: a longer one's first token waits that many "
        "steps; default 64)",
    )


def load(args):
    """The ServedModel with its Engine set up but not started.

    The run loads as generate.py loads it, with its chat template. The fast decode step is
    compiled for each batch size the engine makes."""
    import torch

    from picollama.chat_template import check_renders, compiled, load_chat_template
    from picollama.convert.main import imported_run
    from picollama.device import CoreShare, check_compiler, memory_bytes, pick_device
    from picollama.kernels.load import fast_step, load_to_sample
    from picollama.run_files import is_gguf_file
    from picollama.sampling.memory import free_bytes
    from picollama.serve.engine import Engine
    from picollama.serve.rows import ServedModel

    device = pick_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.compile:
        check_compiler()
    run = imported_run(args.run)
    template = load_chat_template(run, args.chat_template)
    compiled(template)  # A broken template fails now, not at each request.
    model, tokenizer, _ = load_to_sample(args, device)
    mine = f"--chat-template {args.chat_template}" if args.chat_template else None
    check_renders(template, mine or f"the chat template of {args.run}", tokenizer)
    source = Path(args.run)
    name = args.model_name or (source.stem if is_gguf_file(source) else source.name)
    served = ServedModel(model, tokenizer, template, name, free_bytes(model, memory_bytes(device)))
    served.special_in_content = args.special_in_content
    step = fast_step(model, args.compile, 1, KV_CACHES[args.kv_cache], args.threads)
    if getattr(step, "compiled", None) is not None:
        warm_up(served, step, args.max_batch)
    served.engine = Engine(
        model,
        step,
        served.vocab_limit,
        args.max_batch,
        args.queue_size,
        args.batch_window_ms / 1000,
        served.fits,
        args.max_prompt_spread,
        prefix_store(served, args.prefix_cache_mib),
    )
    served.engine.cores = CoreShare(device, fixed=args.threads is not None)
    torch.set_grad_enabled(False)
    return served


def prefix_store(served, mib: int | None):
    """The PrefixStore of --prefix-cache-mib, its bytes taken from what requests may use (None:
    off, or a model whose cached keys change as the sequence grows)."""
    from picollama.sampling.prefixes import PrefixStore, reusable

    capacity = (PREFIX_CACHE_MIB if mib is None else mib) << 20
    if mib is None and served.free is not None:
        capacity = min(capacity, max(served.free, 0) // 4)
    if capacity <= 0 or not reusable(served.model.args):
        return None
    if served.free is not None:
        served.free -= capacity
    return PrefixStore(capacity)


def warm_up(served, step, max_batch: int):
    """Compile the decode step for each batch size now, not at each size's first request.

    This costs time once a machine, since the compiled libraries are cached."""
    from picollama.sampling.rows import Row
    from picollama.sampling.sampler import Sampling
    from picollama.sampling.slots import Slots
    from picollama.serve.engine import bucket_sizes

    sizes = bucket_sizes(max_batch)
    print(f"compiling the decode step for batches of {sizes} (once)", file=sys.stderr)
    row = Row([max(served.tokenizer.bos_id(), 0)], Sampling(2, 0.0))
    for size in sizes:
        slots = Slots(served.model, step)
        for _ in range(size):
            slots.join(row, lambda token: False, lambda reason: None)
        slots.advance()


def load_on_engine_thread(args):
    """Run load(args) on a new thread, which then runs the engine (Engine.run).

    So one thread makes every OpenMP call. Once libgomp's pools hold more threads than cores, it
    cuts its workers' spin-wait to almost nothing. A second thread's pool does that on 2 cores.
    A decode step took 15 ms on the loading thread and 34 ms on another. That was SmolLM2 int8,
    compiled, on 2 Xeon cores."""
    loaded = queue.Queue()

    def engine_thread():
        try:
            served = load(args)
        except BaseException as e:  # A UserError, for the main thread to report.
            loaded.put(e)
            return
        loaded.put(served)
        served.engine.run()

    threading.Thread(target=engine_thread, name="picollama-engine", daemon=True).start()
    served = loaded.get()
    if isinstance(served, BaseException):
        raise served
    return served


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening. Port 0 picks a free one."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        cause = getattr(e, "strerror", None) or e
        raise UserError(f"cannot listen on {host}:{port}: {cause}") from None
    sock.listen(128)
    return sock


def api_key(given: str | None) -> str | None:
    """The key from --api-key, else $PICOLLAMA_API_KEY, else None. An empty or blank one (an
    unset variable, say) is a UserError, never a server with no key."""
    where = "--api-key"
    if given is None and API_KEY_VARIABLE in os.environ:
        given, where = os.environ[API_KEY_VARIABLE], f"${API_KEY_VARIABLE}"
    if given is not None and not given.strip():
        raise UserError(
            f"{where} is empty: give a key, or none at all to serve this machine alone without one"
        )
    if given is not None and given != given.strip():
        raise UserError(
            f"{where} starts or ends with a space, tab or newline, which no client's key can "
            "match (HTTP drops them from its header): give the key without them"
        )
    return given


def is_loopback(host: str) -> bool:
    """Whether host names only this machine (127.0.0.1, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].split("%")[0] for info in found}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_access(host: str, key: str | None, insecure: bool) -> str | None:
    """UserError for listening beyond this machine with no key, unless insecure. Then the warning
    to print. None when there is nothing to say."""
    if key or is_loopback(host):
        return None
    if not insecure:
        raise UserError(
            f"--host {host} listens beyond this machine with no API key: give --api-key KEY (or "
            f"${API_KEY_VARIABLE}), or --insecure-no-key to let anyone who can reach it use it"
        )
    return (
        f"WARNING: --insecure-no-key: no API key is set and {host} listens beyond this machine: "
        "anyone who can reach it can use the model, under any Host name (no check against DNS "
        "rebinding)"
    )


def allowed_hosts(host: str, key: str | None) -> frozenset[str] | None:
    """The Host names the app answers with no key (app.HostCheck): this machine's and --host's.
    None (any) with a key, which guards the server, or beyond loopback (--insecure-no-key)."""
    from picollama.serve.app import host_name

    if key or not is_loopback(host):
        return None
    return LOOPBACK_NAMES | {host_name(host)}


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.api_key = api_key(args.api_key)
    warning = check_access(args.host, args.api_key, args.insecure_no_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        import uvicorn

        from picollama.serve.app import Http, Server, create_app
    except ImportError as e:
        raise UserError(f"serving needs {e.name}: pip install -e '.[serve]'") from None
    sock = listening_socket(args.host, args.port)  # A busy port fails before the slow load.
    served = load_on_engine_thread(args)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    key = ", API key required" if args.api_key else ""
    print(
        f"serving {served.name} on http://{where}:{port}/ (the chat page; the API at /v1 and "
        f"metrics at /metrics{key})",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        create_app(served, args.api_key, allowed_hosts(args.host, args.api_key)),
        http=Http,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,
    )
    try:
        Server(config, served.engine).run(sockets=[sock])
    finally:
        served.engine.close()
    return 0
