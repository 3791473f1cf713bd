"""The serving benchmark's load: servers as subprocesses on free ports, streaming clients and
one client's conversation, and the tokens they count."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from picollama import REPO_ROOT
from picollama.cli import UserError

READY_SECONDS = 600  # A first start may import the GGUF file or compile the decode steps.
REQUEST_SECONDS = 600  # One streamed request, including its wait behind the others.


def free_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server command run as a subprocess listening on 127.0.0.1:port, its output in log; ready
    once GET /v1/models answers (its one model's id is then `model`). A context manager: it is
    stopped (SIGTERM, then SIGKILL) however the block ends."""

    def __init__(self, name: str, command: list[str], port: int, log: Path):
        self.name, self.command, self.log = name, command, log
        self.url = f"http://127.0.0.1:{port}"
        self.model = None
        self.process = None

    def __enter__(self) -> "ServerProcess":
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                self.command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        self.stop()

    def wait_ready(self):
        """Poll /v1/models until it answers; UserError with the log's end if the server exits
        or takes longer than READY_SECONDS."""
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"{self.name} exited ({self.process.returncode}): {self.tail()}")
            try:
                answer = httpx.get(f"{self.url}/v1/models", timeout=5)
                if answer.status_code == 200:
                    self.model = answer.json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise UserError(f"{self.name} did not answer in {READY_SECONDS} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        said = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(said) or f"nothing in {self.log}"

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Sample:
    """One streamed request as its client saw it: perf_counter times of its sending, its first
    text and its end; the text; the finish reason; the completion and prompt tokens of the usage
    chunk where the server sent one (else None)."""

    start: float
    first: float | None
    end: float
    text: str
    finish: str | None
    usage_tokens: int | None
    prompt_tokens: int | None = None

    @property
    def ttft(self) -> float:
        """Seconds to the first text (the whole request where none came)."""
        return (self.first or self.end) - self.start


async def stream_chat(http: httpx.AsyncClient, server: ServerProcess, body: dict) -> Sample:
    """POST one streamed chat completion and read its server-sent events to [DONE]."""
    start = time.perf_counter()
    first, parts, finish, usage, prompt = None, [], None, None, None
    url = f"{server.url}/v1/chat/completions"
    async with http.stream("POST", url, json={**body, "model": server.model}) as response:
        if response.status_code != 200:
            said = (await response.aread())[:300].decode(errors="replace")
            raise UserError(f"{server.name} answered {response.status_code}: {said}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):  # Blank lines and `: ping` comments.
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise UserError(f"{server.name} failed a request: {chunk['error']}")
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            prompt = (chunk.get("usage") or {}).get("prompt_tokens", prompt)
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    parts.append(choice["delta"]["content"])
                finish = choice.get("finish_reason") or finish
    return Sample(start, first, time.perf_counter(), "".join(parts), finish, usage, prompt)


async def one_client(http, server: ServerProcess, bodies: list[dict], progress) -> list[Sample]:
    """A client sending its requests one after the other, each once the last has ended; UserError
    (with the end of the server's log) where the connection fails."""
    samples = []
    for body in bodies:
        try:
            samples.append(await stream_chat(http, server, body))
        except httpx.HTTPError as e:
            raise UserError(f"{server.name}: {e} ({type(e).__name__}); {server.tail()}") from None
        if progress is not None:
            progress.update(1)
    return samples


def run_clients(server: ServerProcess, bodies: list[list[dict]], progress=None):
    """(every request's Sample, the seconds from the first sent to the last ended): one client for
    each list of bodies, all at once."""

    async def all_clients():
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(timeout=REQUEST_SECONDS, limits=limits) as http:
            start = time.perf_counter()
            done = await asyncio.gather(
                *(one_client(http, server, mine, progress) for mine in bodies)
            )
            return [s for samples in done for s in samples], time.perf_counter() - start

    return asyncio.run(all_clients())


def conversation(server: ServerProcess, texts: "TurnText", turns: int, body: dict) -> list[Sample]:
    """One client's conversation of `turns` turns: each user message sent once the last answer
    has ended, after every turn before it and its answer as it came. A Sample a turn.

    Each message is texts.each tokens, and as many more as the answer before it fell short of
    max_tokens. So the conversation grows by the same tokens every turn, however its answers end.
    """
    history, samples, count = [], [], TokenCounter(texts.gguf, body["max_tokens"])
    for _ in range(turns):
        short = body["max_tokens"] - count(samples[-1]) if samples else 0
        history.append({"role": "user", "content": texts.next(texts.each + max(short, 0))})
        sample = run_clients(server, [[{**body, "messages": list(history)}]])[0][0]
        history.append({"role": "assistant", "content": sample.text})
        samples.append(sample)
    return samples


class TokenCounter:
    """A request's completion tokens: the usage chunk's where the server sent one (ours); else
    max_tokens where it ended by length, and otherwise its text re-encoded by the file's tokenizer
    and its end-of-turn token."""

    def __init__(self, gguf: Path, max_tokens: int):
        self.gguf, self.max_tokens = gguf, max_tokens
        self.tokenizer = None

    def __call__(self, sample) -> int:
        if sample.usage_tokens is not None:
            return sample.usage_tokens
        if sample.finish == "length":
            return self.max_tokens
        if self.tokenizer is None:
            self.tokenizer = gguf_tokenizer(self.gguf)
        return len(self.tokenizer.encode(sample.text)) + 1


def gguf_tokenizer(gguf: Path):
    """The GGUF file's tokenizer, from its imported run."""
    from picollama.convert.main import imported_run
    from picollama.run_files import read_tokenizer, tokenizer_file

    return read_tokenizer(tokenizer_file(imported_run(gguf)))


TURN_OVERHEAD = 10  # the tokens a chat template adds around a message and its answer, about


def message_tokens(cli) -> int:
    """Each --turns message's tokens: with its answer and template, a turn's share of the whole."""
    return max(1, cli.conversation_tokens // cli.turns - cli.max_tokens - TURN_OVERHEAD)


class TurnText:
    """User messages cut from `text` in the GGUF file's tokenizer, `each` tokens long unless
    asked otherwise, each ending with ASK_LONG. The text repeats as often as it takes, and every
    conversation starts it again (restart)."""

    ASK_LONG = "Answer at length."  # Without it, SmolLM2 answered a cut message in 5 tokens.

    def __init__(self, gguf: Path, text: str, each: int):
        self.gguf, self.each = gguf, each
        self.tokenizer = gguf_tokenizer(gguf)
        self.ids = self.tokenizer.encode(text + " ")
        self.asking = len(self.tokenizer.encode(" " + self.ASK_LONG))
        self.at = 0

    def restart(self) -> "TurnText":
        self.at = 0
        return self

    def next(self, tokens: int) -> str:
        """A message of about `tokens` tokens: the text's next ones, then ASK_LONG."""
        ids = []
        while len(ids) < tokens - self.asking:
            taken = self.ids[self.at : self.at + tokens - self.asking - len(ids)]
            ids += taken
            self.at = (self.at + len(taken)) % len(self.ids)
        return f"{self.tokenizer.decode(ids).strip()} {self.ASK_LONG}"


def python_module(module: str, *args) -> list[str]:
    """The command that runs `python -m module args` in this Python."""
    return [sys.executable, "-m", module, *map(str, args)]
