"""The study's train.py processes, handled as a group.

Once the group is stopped, no process starts and none runs on."""

import os
import signal
import subprocess
import threading

from picollama.cli import UserError


class Trainings:
    """The training processes of a queue.

    stop() comes on Ctrl-C, SIGTERM or a failed run. After it, start() refuses, so a queued run
    never begins. Running ones get SIGTERM, train.py's own interrupt, which says where --resume
    continues. So the study ends in seconds. Before, it ran on until every queued run had
    trained (82 s after a Ctrl-C)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopped = False

    def start(self, command: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen(command, **kwargs), tracked until it ends. UserError once stopped."""
        with self.lock:  # Shared with stop(), so a process starts before it or not at all.
            if self.stopped:
                raise UserError("interrupted: no further training starts")
            process = subprocess.Popen(command, **kwargs)
            self.running.add(process)
        return process

    def ended(self, process: subprocess.Popen):
        """Forget a process whose status its thread reaped (os.wait4)."""
        with self.lock:
            self.running.discard(process)

    def stop(self):
        """No training starts from now on. Each running one gets SIGTERM."""
        with self.lock:
            self.stopped = True
            for process in self.running:  # Not Popen.terminate(), which would reap it (poll).
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
