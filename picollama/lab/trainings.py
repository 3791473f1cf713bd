"""The study's train.py processes as a group: once stopped, none starts and none runs on."""

import os
import signal
import subprocess
import threading

from picollama.cli import UserError


class Trainings:
    """The training processes of a queue. After stop() (Ctrl-C, SIGTERM or a failed run) start()
    refuses, so a queued run never begins, and the running ones are sent SIGTERM (train.py's own
    interrupt: it says where --resume continues): the study ends in seconds, not after every queued
    run trained (82 s after a Ctrl-C)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopped = False

    def start(self, command: list[str], **kwargs) -> subprocess.Popen:
        """subprocess.Popen(command, **kwargs), tracked until ended; UserError once stopped."""
        with self.lock:  # one lock with stop(): a process starts before it, or not at all
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
        """No training starts from now on; SIGTERM to each running one."""
        with self.lock:
            self.stopped = True
            for process in self.running:  # os.kill: Popen.terminate() would reap it (poll)
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
