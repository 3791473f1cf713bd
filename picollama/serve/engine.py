"""The engine: one thread owns the model and decodes the waiting requests together in batches."""

import asyncio
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

from picollama.cli.command import one_line
from picollama.kernels.fused_step import DecodeStep
from picollama.sampling.completion_text import ChoiceText, Entry
from picollama.sampling.decode import DecodeOptions, decode_rows
from picollama.sampling.rows import Row, Token
from picollama.sampling.slots import Slots, padded_batch


class QueueFull(Exception):
    """Every place in the engine's queue is taken."""


@dataclass
class Delta:
    """New text for a choice, and the logprob entries of the tokens that make it."""

    choice: int
    text: str
    entries: list[Entry]


@dataclass
class Finished:
    """A choice ended: "stop" (an end-of-turn token or a stop string), "length" or "cancelled";
    tokens: the tokens the model chose for it, a final end-of-turn token included."""

    choice: int
    reason: str
    tokens: int


@dataclass
class Failed:
    """The request failed (the message says why: its batch failed, the server is going down);
    its choices are over. status: the HTTP status that says so."""

    message: str
    status: int = 500


class Job:
    """One request in the engine: its rows (one a choice), their texts, and the asyncio queue its
    handler reads events (Delta, Finished, Failed) from. The engine thread calls on_token and
    on_done; cancel() (a client gone) ends its rows at their next token. watch (metrics.Watch, or
    None) hears of each token and each choice's tokens."""

    def __init__(self, rows: list[Row], texts: list[ChoiceText], watch=None):
        self.rows, self.texts, self.watch = rows, texts, watch
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended = [False] * len(rows)

    def cancel(self):
        self.cancelled = True

    def push(self, event):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going down
            self.cancelled = True

    def on_token(self, choice: int, token: Token) -> bool:
        """Pass the token's text on; whether the choice is over (a stop string, a client gone, its
        grammar failed)."""
        if self.cancelled or self.grammar_error(choice):
            return True
        if self.watch:
            self.watch.token()
        text, entries = self.texts[choice].add(token)
        if text or entries:
            self.push(Delta(choice, text, entries))
        return self.texts[choice].stopped

    def on_done(self, choice: int, reason: str):
        """The choice ended. Where its grammar failed on the way, the request fails (500)."""
        if self.ended[choice]:
            return
        error = self.grammar_error(choice)
        if error:
            return self.fail(f"structured output failed mid-answer: {error}")
        self.ended[choice] = True
        tokens = self.texts[choice].tokens + (reason == "stop")  # the end-of-turn token
        if self.watch:
            self.watch.finished(tokens)
        if reason == "halted":
            reason = "cancelled" if self.cancelled and not self.texts[choice].stopped else "stop"
        text, entries = self.texts[choice].finish()
        if text or entries:
            self.push(Delta(choice, text, entries))
        self.push(Finished(choice, reason, tokens))

    def grammar_error(self, choice: int) -> str | None:
        """Why the choice's grammar (grammar.Constraint) failed, or None."""
        constraint = self.rows[choice].sampling.constraint
        return None if constraint is None else constraint.error

    def fail(self, message: str, status: int = 500):
        """End every choice with a failure; the rows still decoding end at their next token."""
        self.ended = [True] * len(self.rows)
        self.cancelled = True
        self.push(Failed(message, status))


class Engine:
    """Owns the model on one thread. Requests (Jobs) wait in a queue of at most queue_size. With a
    DecodeStep, batching is continuous (run_continuous): a request joins the rows decoding at the
    next step where its rows fit, and each row leaves as it ends. Without one (a model that decodes
    with its own forward), batching is static: when the engine is free it takes those waiting,
    oldest first, whose rows fit together (fits_with: max_batch rows, memory, prompts within
    max_spread tokens), waiting up to `window` seconds after the first for more, and decodes them
    in one batch (decode.decode_rows); a request that comes meanwhile waits for the next.
    `stats` says what it has done. prefixes: a PrefixStore (sampling/prefixes.py) where prompts
    find the keys and values of earlier ones and rows that end are kept (None: none kept);
    kept_prefixes and kept_prefix_tokens say what it holds."""

    def __init__(
        self,
        model,
        step=None,
        vocab_limit=None,
        max_batch: int = 8,
        queue_size: int = 64,
        window: float = 0.01,
        fits=None,
        max_spread: int = 64,
        prefixes=None,
    ):
        self.model, self.step, self.vocab_limit = model, step, vocab_limit
        self.max_batch, self.queue_size, self.window = max_batch, queue_size, window
        self.fits = fits or (lambda rows: True)
        self.max_spread = max_spread
        self.prefixes = prefixes
        self.waiting: deque[Job] = deque()
        self.condition = threading.Condition()
        self.closed = False
        self.running: list[Job] = []  # the batch decoding now
        self.on_step = None  # told each continuous decode step's seconds (the metrics), or None
        self.cores = None  # a device.CoreShare: the threads follow the free cores, or None
        self.stats = dict(
            batches=0, steps=0, largest_batch=0, rows=0, tokens=0, active_rows=0, cancelled_rows=0
        )
        self.thread = threading.Thread(target=self.run, name="picollama-engine", daemon=True)

    def start(self) -> "Engine":
        self.thread.start()
        return self

    def close(self):
        """Stop: the requests waiting or decoding fail with 503 (the server is going down)."""
        with self.condition:
            self.closed = True
            for job in [*self.waiting, *self.running]:
                job.fail("the server is shutting down", 503)
            self.waiting.clear()
            self.condition.notify_all()

    def submit(self, job: Job):
        """Queue a job; QueueFull when queue_size are waiting (those whose clients left while
        they waited behind a batch are dropped first: they hold no place)."""
        with self.condition:
            self.waiting = deque(other for other in self.waiting if not other.cancelled)
            if len(self.waiting) >= self.queue_size or self.closed:
                raise QueueFull
            self.waiting.append(job)
            self.condition.notify_all()

    def status(self) -> dict:
        with self.condition:
            queued = sum(not job.cancelled for job in self.waiting)
        kept = dict(kept_prefixes=self.kept_prefixes, kept_prefix_tokens=self.kept_prefix_tokens)
        kept["reused_prefix_tokens"] = 0 if self.prefixes is None else self.prefixes.reused
        return {**self.stats, "queued": queued, "max_batch": self.max_batch, **kept}

    @property
    def kept_prefixes(self) -> int:
        """How many token sequences the prefix store keeps (0 without one)."""
        return 0 if self.prefixes is None else self.prefixes.count

    @property
    def kept_prefix_tokens(self) -> int:
        """How many tokens' keys and values the prefix store keeps (0 without one)."""
        return 0 if self.prefixes is None else self.prefixes.tokens

    def run(self):
        """Decode until closed: continuously where the step takes a position a row (a DecodeStep),
        else in static batches."""
        if isinstance(self.step, DecodeStep):
            return self.run_continuous()
        while True:
            batch = self.take()
            if batch is None:
                return
            self.run_batch(batch)
            with self.condition:
                self.running = []

    def run_continuous(self):
        """Continuous batching (slots.Slots): between two steps the jobs waiting join, oldest first,
        as long as their rows fit (max_batch rows, memory); rows that end leave at once."""
        slots = Slots(self.model, self.step, self.vocab_limit, self.prefixes)
        while True:
            joining = self.admit(slots)
            if joining is None:
                return
            for job in joining:
                self.join(slots, job)
            if slots.slots:
                self.advance(slots)

    def admit(self, slots: Slots) -> list[Job] | None:
        """The jobs waiting that join now (oldest first, while their rows fit beside the rows
        decoding), once there is work (None once closed)."""
        with self.condition:
            while not self.closed:
                self.waiting = deque(job for job in self.waiting if not job.cancelled)
                joining, rows = [], slots.rows
                while self.waiting:
                    more = rows + self.waiting[0].rows
                    cached = more + more[:1] * (padded_batch(len(more)) - len(more))  # the cache's
                    if rows and (len(more) > self.max_batch or not self.fits(cached)):
                        break
                    joining.append(self.waiting.popleft())
                    rows = more
                if joining or slots.slots:
                    self.running += joining
                    return joining
                self.condition.wait()
            return None

    def join(self, slots: Slots, job: Job):
        """Each row of the job joins the slots (its prompt prefilled); a failure fails the job."""
        self.stats["rows"] += len(job.rows)
        self.stats["active_rows"] += len(job.rows)
        for choice, row in enumerate(job.rows):
            try:
                slots.join(
                    row, partial(self.row_token, job, choice), partial(self.row_done, job, choice)
                )
            except Exception as e:  # e.g. out of memory: this request fails, the server goes on
                job.fail(one_line(e))
        self.note_rows(len(slots.slots))

    def advance(self, slots: Slots):
        """A token for every row. A failure fails every job decoding."""
        if self.cores is not None and (note := self.cores.check()):
            print(note, file=sys.stderr)
        started = time.perf_counter()
        try:
            slots.advance()
        except Exception as e:
            with self.condition:
                for job in self.running:
                    job.fail(one_line(e))
                self.running = []
            slots.slots.clear()
            self.stats["active_rows"] = 0
        self.stats["steps"] += 1
        if self.on_step:
            self.on_step(time.perf_counter() - started)
        self.note_rows(len(slots.slots))

    def row_token(self, job: Job, choice: int, token: Token) -> bool:
        """A row's new token, counted and passed to its job (whether the row goes on)."""
        self.stats["tokens"] += 1
        return job.on_token(choice, token)

    def row_done(self, job: Job, choice: int, reason: str):
        """A row left the slots: its job is told, and once its rows all have, it is done."""
        self.stats["active_rows"] -= 1
        self.stats["cancelled_rows"] += job.cancelled
        job.on_done(choice, reason)
        if all(job.ended):
            with self.condition:
                if job in self.running:
                    self.running.remove(job)

    def note_rows(self, rows: int):
        self.stats["largest_batch"] = max(self.stats["largest_batch"], rows)

    def take(self) -> list[Job] | None:
        """The next batch: the jobs waiting that fit together, oldest first, gathered for up to
        `window` seconds after the first (None once closed)."""
        with self.condition:
            batch, deadline = [], None
            while not self.closed:
                for job in list(self.waiting):
                    if job.cancelled:
                        self.waiting.remove(job)
                    elif self.fits_with(batch, job):
                        self.waiting.remove(job)
                        batch.append(job)
                if batch and deadline is None:
                    deadline = time.monotonic() + self.window
                full = sum(len(job.rows) for job in batch) >= self.max_batch
                if batch and (full or time.monotonic() >= deadline):
                    self.running = batch
                    return batch
                self.condition.wait(None if deadline is None else deadline - time.monotonic())
            return None

    def fits_with(self, batch: list[Job], job: Job) -> bool:
        """Whether job's rows can join the batch: within max_batch rows, memory, and max_spread
        tokens of prompt length (rows step together from the shortest prompt's end, so a longer
        prompt is read a token a step: its first token comes that many steps later)."""
        if not batch:
            return True
        rows = [row for other in batch for row in other.rows] + job.rows
        lengths = [len(row.prompt) for row in rows]
        spread = max(lengths) - min(lengths)
        return len(rows) <= self.max_batch and spread <= self.max_spread and self.fits(rows)

    def run_batch(self, batch: list[Job]):
        """Decode a static batch, each row's tokens to its job. A failure fails its jobs only."""
        owners = [(job, i) for job in batch for i in range(len(job.rows))]
        rows = [row for job in batch for row in job.rows]
        stats = self.stats
        stats.update(batches=stats["batches"] + 1, active_rows=len(rows))
        stats.update(largest_batch=max(stats["largest_batch"], len(rows)))
        stats["rows"] += len(rows)

        def on_token(row: int, token: Token) -> bool:
            stats["tokens"] += 1
            job, choice = owners[row]
            return job.on_token(choice, token)

        def on_done(row: int, reason: str):
            if row < len(owners):
                job, choice = owners[row]
                stats["active_rows"] -= 1
                stats["cancelled_rows"] += job.cancelled
                job.on_done(choice, reason)

        try:
            options = DecodeOptions(self.step, self.vocab_limit, prefixes=self.prefixes)
            decode_rows(self.model, rows, on_token, on_done, options)
        except Exception as e:  # e.g. out of memory: those requests fail, the server goes on
            for job in batch:
                job.fail(one_line(e))
        stats["active_rows"] = 0


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes of the slots' cache (padded_batch), up to max_batch rows."""
    return sorted({padded_batch(rows) for rows in range(1, max_batch + 1)})
