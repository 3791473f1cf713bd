"""Long forwards that Ctrl-C and SIGTERM stop at once.

The forward runs in a worker thread while the main thread waits. Python only handles signals on
the main thread between bytecodes, so a long torch call would otherwise block them."""

import atexit
import os
import signal
import sys
import threading
from contextlib import ExitStack

import torch

WAIT_SECONDS = 0.1  # How often the waiting main thread wakes, so how late a signal can be.


def interruptible(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a worker thread, while this one waits.

    So Ctrl-C or SIGTERM is answered within WAIT_SECONDS, even if one torch operation takes
    minutes. Python runs signal handlers on the main thread only, between bytecodes. On an
    interrupt the worker is abandoned. The process ends (exit_abandoned) once the caller's
    cleanup and `error:` line are done. The worker uses the caller's grad, inference and autocast
    modes, which torch keeps per thread. Off the main thread, fn is simply called."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    done, finished = {}, threading.Event()
    modes = caller_modes()

    def work():
        try:
            with modes():
                done["value"] = fn(*args, **kwargs)
        except BaseException as e:  # Handed to the caller.
            done["error"] = e
        finally:
            finished.set()

    worker = threading.Thread(target=work, name="interruptible forward", daemon=True)
    received = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def note(signum, frame):
        received.append(signum)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        else:  # The default action, or ignored. Act as if this handler were not there.
            signal.signal(signum, handler)
            signal.raise_signal(signum)

    for s in previous:
        signal.signal(s, note)
    try:
        worker.start()
        # Not worker.join. If interrupted, Python 3.11's join marks a running thread as ended.
        while not finished.wait(WAIT_SECONDS):
            pass
    except BaseException:
        if not finished.is_set():
            atexit.register(exit_abandoned, finished, 128 + (received or [signal.SIGINT])[0])
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if "error" in done:
        raise done["error"]
    return done["value"]


def caller_modes():
    """A function that enters this thread's grad, inference and autocast modes in another.

    Torch keeps these modes per thread. The function returns an ExitStack to leave them by."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    casts = [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]

    def enter() -> ExitStack:
        stack = ExitStack()
        stack.enter_context(torch.inference_mode(inference))
        stack.enter_context(torch.set_grad_enabled(grad))
        for device, dtype in casts:
            stack.enter_context(torch.autocast(device, dtype))
        return stack

    return enter


def exit_abandoned(finished: threading.Event, status: int):
    """At exit, end the process now with `status` if an abandoned worker still computes.

    A normal exit would destroy torch's thread pools under the running operation, and abort."""
    if not finished.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
