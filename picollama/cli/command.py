"""How a command ends: one `error:` line and an exit status, also on Ctrl-C and SIGTERM. Work
that must finish can hold signals."""

import os
import signal
import sys
import threading
from contextlib import contextmanager


def one_line(e: BaseException) -> str:
    """An exception as one readable line, naming the path for OS errors."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    if out_of_memory(e):
        return "out of memory: choose a smaller model, batch or length"
    return " ".join(str(e).split()) or type(e).__name__


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` reports exhausted memory (torch's failed allocations are RuntimeErrors)."""
    text = str(e)
    return (
        isinstance(e, MemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, with a message saying what was kept (e.g. where --resume continues)."""


def run_command(main, argv=None) -> int:
    """Run main(argv) and return its exit status.

    User mistakes, OS errors and lack of memory print one `error:` line and give status 2. So do
    Ctrl-C (130) and SIGTERM (143), even in a __del__ or a callback, where Python swallows the
    KeyboardInterrupt. Only rank 0 of a torchrun job prints."""
    received = []
    with interrupt_handlers(received):
        try:
            status = main(sys.argv[1:] if argv is None else list(argv)) or 0
            if not received:
                return status
            # A signal came but its KeyboardInterrupt was swallowed. The work may be incomplete.
            message = "interrupted"
        except KeyboardInterrupt as e:
            message, status = str(e) or "interrupted", 128 + signal.SIGINT
        except (ValueError, OSError, MemoryError) as e:
            message, status = one_line(e), 2
        except RuntimeError as e:
            if not out_of_memory(e):
                raise
            message, status = one_line(e), 2
    if received:
        status = 128 + received[0]
    if os.environ.get("RANK", "0") == "0":  # Escape lone surrogates from argv.
        print(f"error: {message}".encode(errors="backslashreplace").decode(), file=sys.stderr)
    return status


@contextmanager
def interrupt_handlers(received: list):
    """Make SIGINT and SIGTERM raise KeyboardInterrupt and record them in `received`. Python's
    "Exception ignored" print of one is dropped, since the caller sees it in `received`. Main
    thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def unraisable(info):
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous_hook(info)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        sys.unraisablehook = previous_hook


@contextmanager
def held_signals(escape: bool = True):
    """Hold SIGINT and SIGTERM until the block ends, then deliver them.

    This guards work that must finish or leave nothing. With `escape`, a second signal arrives at
    once. Yields the signals held. Main thread only. Elsewhere the block runs unguarded."""
    received = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def hold(signum, frame):
        received.append(signum)
        if escape and len(received) == 2:  # Asked twice, so stop now. The caller cleans up.
            restore()
            signal.raise_signal(signum)

    def restore():
        for s, old in previous.items():
            signal.signal(s, old)

    for s in previous:
        signal.signal(s, hold)
    try:
        yield received
    finally:
        restore()
        if received and not (escape and len(received) > 1):  # Else it was delivered already.
            signal.raise_signal(received[0])  # Now a KeyboardInterrupt, or the default action.
