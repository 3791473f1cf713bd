"""Running a command: its one `error:` line and exit status, Ctrl-C and SIGTERM, held signals."""

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
    """main(argv)'s exit status; user mistakes, OS errors and exhausted memory become one `error:`
    line and status 2; Ctrl-C (130) and SIGTERM (143) at any moment become one `error:` line too,
    even where Python would swallow the KeyboardInterrupt (in a __del__ or a callback). Only rank 0
    of a torchrun job prints."""
    received = []
    with interrupt_handlers(received):
        try:
            status = main(sys.argv[1:] if argv is None else list(argv)) or 0
            if not received:
                return status
            # a signal whose KeyboardInterrupt was swallowed: the work may be incomplete
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
    if os.environ.get("RANK", "0") == "0":  # text from argv may hold lone surrogates: escaped
        print(f"error: {message}".encode(errors="backslashreplace").decode(), file=sys.stderr)
    return status


@contextmanager
def interrupt_handlers(received: list):
    """SIGINT and SIGTERM raise KeyboardInterrupt and are recorded in `received`; a
    KeyboardInterrupt that Python reports as "Exception ignored" is not printed (the caller sees it
    in `received`). Main thread only."""
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
    """SIGINT and SIGTERM wait until the block ends (work that must finish, or leave nothing), then
    arrive as if sent then; with `escape`, a second one while waiting arrives at once. Yields the
    signals received while holding. Main thread only (elsewhere the block runs as it is)."""
    received = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def hold(signum, frame):
        received.append(signum)
        if escape and len(received) == 2:  # asked twice: stop now (the caller cleans up)
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
        if received and not (escape and len(received) > 1):  # else delivered already
            signal.raise_signal(received[0])  # its own handler: a KeyboardInterrupt, or the default
