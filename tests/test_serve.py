"""python -m picollama.serve: a subprocess on a free 127.0.0.1 port, driven by the openai client."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import write_corpus

from data.tokenizer import open_tokenizer
from model import ModelArgs, Transformer
from picollama.chat_template import DEFAULT_TEMPLATE, encode_chat, render_chat
from picollama.run_files import load_model, save_model

openai = pytest.importorskip("openai", reason="the openai client: pip install -e '.[dev]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the server: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the server: pip install -e '.[serve]'")

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-5b1e"
CONTEXT = 4096  # room for a request that decodes long enough to hold the engine
HELLO = [{"role": "user", "content": "hello there"}]
SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")


def build_run(root: Path) -> Path:
    """A run the server can load in a moment: a byte-fallback BPE tokenizer and a 2-layer model
    trained a few steps on pseudo-English (word-like text), with a long context."""
    import sentencepiece as spm

    torch.set_num_threads(1)
    corpus = write_corpus(root / "corpus", num_docs=3, words_per_doc=1200)
    lines = [line for path in sorted(corpus.iterdir()) for line in path.read_text().splitlines()]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    (root / "tokenizer.model").write_bytes(proto.getvalue())
    tokenizer = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    ids = torch.tensor([t for line in lines for t in tokenizer.encode(line + "\n")])
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320)
    model = Transformer(ModelArgs(**{**args.to_dict(), "max_seq_len": CONTEXT, "multiple_of": 16}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):
        starts = torch.randint(0, len(ids) - 65, (16,)).tolist()
        x = torch.stack([ids[s : s + 64] for s in starts])
        y = torch.stack([ids[s + 1 : s + 65] for s in starts])
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    return save_model(model.eval(), root / "run", {}, tokenizer=root / "tokenizer.model")


class Server:
    """`python -m picollama.serve` in a subprocess, on the port it reports (it picks a free one)."""

    def __init__(self, root: Path, run, *flags: str):
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / "server.log"
        command = [sys.executable, "-m", "picollama.serve", "--run", str(run), "--port", "0"]
        command += ["--model-name", "run"]  # the name the tests' requests call it by
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PICOLLAMA_API_KEY", None)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [*command, *flags], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.url = self.wait_for_port(120)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def wait_for_port(self, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/", self.log.read_text())
            if found:
                return found[1]
            if self.process.poll() is not None:
                pytest.fail(f"the server exited: {self.log.read_text()}")
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"the server did not start in {seconds} s: {self.log.read_text()}")

    def client(self, key: str | None = KEY, timeout: float = 60):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def post(self, path: str, content: bytes, key: str | None = KEY) -> httpx.Response:
        headers = {"Content-Type": "application/json"}
        headers |= {"Authorization": f"Bearer {key}"} if key else {}
        return self.http.post(path, content=content, headers=headers)

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if hasattr(self, "http"):
            self.http.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return build_run(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("server"), run, "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(run):
    return open_tokenizer(run / "tokenizer.model")


def chat(client, messages=HELLO, **kwargs):
    return client.chat.completions.create(model="run", messages=messages, **kwargs)


def streamed(client, **kwargs) -> tuple[str, list]:
    """(the streamed text of choice 0, every chunk)."""
    chunks = list(chat(client, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_one_model_and_the_page_needs_no_key(server, client):
    assert [m.id for m in client.models.list().data] == ["run"]
    assert client.models.retrieve("run").id == "run"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    page = server.http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert server.health()["status"] == "ok"


def test_usage_counts_are_exact_and_max_tokens_is_the_length(client, tokenizer):
    answer = chat(client, max_tokens=8, temperature=0, logprobs=True)
    prompt = encode_chat(tokenizer, render_chat(DEFAULT_TEMPLATE, HELLO, tokenizer))
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == 8 == len(answer.choices[0].logprobs.content)
    assert answer.usage.total_tokens == len(prompt) + 8
    assert answer.choices[0].finish_reason == "length"
    text = client.completions.create(model="run", prompt="op gum", max_tokens=5, temperature=0)
    assert text.usage.prompt_tokens == len([tokenizer.bos_id(), *tokenizer.encode("op gum")])
    assert text.usage.completion_tokens == 5 and text.choices[0].finish_reason == "length"


def test_streamed_text_is_the_whole_text_at_temperature_0(client):
    whole = chat(client, max_tokens=40, temperature=0).choices[0].message.content
    text, chunks = streamed(
        client, max_tokens=40, temperature=0, stream_options={"include_usage": True}
    )
    assert text == whole and len(whole) > 10
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])
    kwargs = dict(model="run", prompt="op gum", max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    parts = client.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in parts) == whole


def test_stop_strings_never_appear_even_split_across_tokens(client):
    answer = chat(client, max_tokens=60, temperature=0, logprobs=True).choices[0]
    text, tokens = answer.message.content, [t.token for t in answer.logprobs.content]
    # a stop string that starts inside one token and ends inside a later one
    cut = len(tokens[0]) + len(tokens[1]) + len(tokens[2])
    stop = text[cut - 1 : cut + 2]
    assert len(tokens[2]) >= 1 and len(stop) == 3
    before = text[: text.index(stop)]
    for stream in (False, True):
        kwargs = dict(max_tokens=60, temperature=0, stop=[stop, "never-there"])
        if stream:
            got, chunks = streamed(client, **kwargs)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            answer = chat(client, **kwargs).choices[0]
            got, reason = answer.message.content, answer.finish_reason
        assert got == before and stop not in got and reason == "stop"
    whole = chat(client, max_tokens=60, temperature=0, stop="never-there").choices[0]
    assert whole.message.content == text and whole.finish_reason == "length"


def test_n_choices_and_logprobs_that_join_into_the_content(client):
    answer = chat(
        client, max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == 24
    first = chat(client, max_tokens=12, temperature=1.0, seed=7).choices[0].message.content
    assert answer.choices[0].message.content == first  # choice i draws with seed + i
    assert answer.choices[1].message.content != first
    for choice in answer.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    text = client.completions.create(model="run", prompt="op", max_tokens=6, seed=1, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert "".join(logprobs.tokens) == text.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_too_long_prompts_and_wrong_keys_are_refused(server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, messages=[{"role": "user", "content": "op gum " * CONTEXT}])
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, max_tokens=CONTEXT)
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("wrong-key"), max_tokens=2)
    assert server.post("/v1/completions", b"{}", key=None).status_code == 401
    assert server.http.get("/v1/models").status_code == 401


REQUESTS = [  # seeded samples and greedy rows, of different prompt lengths, settings and lengths
    dict(messages=HELLO, max_tokens=30, temperature=0.9, seed=1),
    dict(messages=[{"role": "user", "content": "op gum " * 20}], max_tokens=12, temperature=0),
    dict(messages=HELLO, max_tokens=25, temperature=1.2, top_k=20, seed=2),
    dict(
        messages=[{"role": "system", "content": "be op"}] + HELLO, max_tokens=20, top_p=0.8, seed=3
    ),
]


def answer_of(client, request: dict) -> str:
    extra = {"top_k": request["top_k"]} if "top_k" in request else {}
    kwargs = {k: v for k, v in request.items() if k != "top_k"}
    return chat(client, extra_body=extra, **kwargs).choices[0].message.content


def test_concurrent_clients_join_the_rows_decoding_and_each_gets_what_it_gets_alone(server, client):
    """Continuous batching: four requests sent while a long answer streams join it between two
    steps and are answered while it goes on (static batching would queue them behind it), each
    exactly as when alone: seeds, samplers and lengths of its own."""
    alone = [answer_of(client, request) for request in REQUESTS]
    blocker = chat(client, max_tokens=CONTEXT - 30, temperature=0, stream=True)
    chunks = iter(blocker)
    next(chunks), next(chunks)  # the role, then text: the engine is decoding it
    before = server.health()["engine"]
    got = [None] * len(REQUESTS)

    def ask(i):
        got[i] = answer_of(server.client(), REQUESTS[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(REQUESTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    during = server.health()["engine"]
    streamed_on = next(chunks).choices[0].finish_reason is None  # the blocker never stopped
    blocker.close()
    assert got == alone
    assert streamed_on and during["rows"] == before["rows"] + len(REQUESTS)
    assert during["batches"] == 0 and during["largest_batch"] >= 2  # continuous: no batches
    assert during["tokens"] >= before["tokens"] + len(REQUESTS)  # continuous steps count too
    deadline = time.monotonic() + 30
    while server.health()["engine"]["active_rows"]:  # the blocker's row ends at its next token
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.01)


def test_a_client_that_leaves_frees_the_engine(server, client):
    """Streamed (the client closes the stream) and whole (the client gives up waiting): each
    leaves its row ended long before its max_tokens, and the engine free for the next request."""
    before = server.health()["engine"]
    stream = chat(client, max_tokens=CONTEXT - 30, temperature=0, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    with pytest.raises(openai.APITimeoutError):
        chat(server.client(timeout=0.5), max_tokens=CONTEXT - 30, temperature=0)
    answer = chat(client, max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    after = server.health()["engine"]
    assert after["cancelled_rows"] == before["cancelled_rows"] + 2
    assert after["tokens"] - before["tokens"] < CONTEXT  # both ended long before max_tokens
    assert after["active_rows"] == 0 and after["queued"] == 0


RAW = [  # bodies that are not a JSON object of UTF-8 text
    b"{not json",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4',
    b'["a list"]',
    b"[" * 100_000,
    '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
    b'{"prompt": "op", "temperature": NaN}',
]
CHAT_BAD = [  # (body, the param its error names)
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user", "content": "x" * 1_000_000}]}, "messages"),
    ({"messages": HELLO, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": HELLO, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": "8"}, "max_tokens"),
    ({"messages": HELLO, "n": 1000}, "n"),
    ({"messages": HELLO, "temperature": -1}, "temperature"),
    ({"messages": HELLO, "temperature": True}, "temperature"),
    ({"messages": HELLO, "top_p": 1.5}, "top_p"),
    ({"messages": HELLO, "seed": "x"}, "seed"),
    ({"messages": HELLO, "seed": 2**40}, "seed"),  # torch keeps 32 bits: it would be seed 0
    ({"messages": HELLO, "seed": -1}, "seed"),
    # past int64: top_k was a 500 ("Overflow when unpacking long long"); every integer is bounded
    *[({"messages": HELLO, name: 2**64}, name) for name in ("top_k", "n", "max_tokens", "seed")],
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),  # dropped
    (
        {"messages": [{"role": "user", "content": "hi", "reasoning": ["x"]}]},
        "messages[0].reasoning",
    ),
    ({"messages": HELLO, "model": "gpt-4o"}, "model"),  # 404: not the model served
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": HELLO, "stop": 3}, "stop"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": HELLO, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": HELLO, "best_friend": 1}, "best_friend"),
    ({"prompt": "op"}, "prompt"),
    # lone surrogates, sent as JSON escapes like "\ud800": not UTF-8 text
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ({"messages": HELLO, "model": "\ud800"}, "model"),
    ({"messages": HELLO, "stop": ["ok", "\udfff"]}, "stop[1]"),
    ({"messages": HELLO, "\ud800": 1}, "\\ud800"),
]
TEXT_BAD = [
    ({}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": "x" * 1_000_000}, "prompt"),
    ({"prompt": "op " * CONTEXT}, "prompt"),
    ({"prompt": "op", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "op", "n": 1000}, "n"),
    ({"prompt": ["op"] * 5, "n": 2}, "n"),
    ({"prompt": "op", "temperature": -1}, "temperature"),
    ({"prompt": "op", "logprobs": 6}, "logprobs"),
    ({"prompt": "op", "logprobs": True}, "logprobs"),
    ({"prompt": "op", "logprobs": 2**64}, "logprobs"),
    ({"prompt": "op", "top_k": 2**64}, "top_k"),
    ({"prompt": "op", "echo": True}, "echo"),
    ({"prompt": "op", "suffix": "x"}, "suffix"),
    ({"prompt": "op", "messages": HELLO}, "messages"),
    ({"prompt": "op \ud83d"}, "prompt"),
    ({"prompt": ["op", "\udc80"]}, "prompt[1]"),
]


@pytest.mark.parametrize(
    "path, bad, good",
    [
        ("/v1/chat/completions", CHAT_BAD, {"messages": HELLO}),
        ("/v1/completions", TEXT_BAD, {"prompt": "op"}),
    ],
    ids=["chat", "completions"],
)
def test_bad_input_is_a_4xx_in_openais_shape_and_the_next_request_is_served(
    server, path, bad, good
):
    for body, param in [(raw, None) for raw in RAW] + bad:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = server.post(path, content)
        assert 400 <= response.status_code < 500, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert param is None or error["param"] == param, (str(body)[:200], error)
    assert server.health()["status"] == "ok"
    response = server.post(path, json.dumps({**good, "max_tokens": 3, "temperature": 0}).encode())
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_a_body_not_sent_as_json_is_a_415_and_the_next_request_is_served(server):
    """A page of another site can POST text/plain or a form to any address without asking (no
    CORS preflight): a no-cors fetch made the model answer it. Only application/json is read."""
    body = json.dumps({"messages": HELLO, "max_tokens": 2, "top_k": 2**63 - 1}).encode()
    key = {"Authorization": f"Bearer {KEY}"}
    for kind in ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "", None]:
        headers = key if kind is None else key | {"Content-Type": kind}
        for path in ("/v1/chat/completions", "/v1/completions"):
            response = server.http.post(path, content=body, headers=headers)
            assert response.status_code == 415, (kind, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["code"] == "unsupported_media_type", error
    for kind in ["application/json; charset=utf-8", "Application/JSON"]:
        response = server.http.post(
            "/v1/chat/completions", content=body, headers=key | {"Content-Type": kind}
        )
        assert response.status_code == 200, (kind, response.text)


def test_with_no_key_only_requests_naming_this_machine_are_answered(run, server, tmp_path):
    """DNS rebinding (Ollama's CVE-2024-28224): a page of attacker.example, its name then made to
    resolve to 127.0.0.1, reaches a no-key server on this machine as its own origin, so the
    browser lets it read the answers. Only its Host header gives it away. With a key, the key
    guards the server and any Host passes."""
    open_server = Server(tmp_path, run)
    body = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
    json_body = {"Content-Type": "application/json"}
    try:
        port = open_server.url.rsplit(":", 1)[1]
        for host in ["attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io", "::2"]:
            for method, path in [("GET", "/"), ("GET", "/v1/models"), ("GET", "/health")]:
                response = open_server.http.request(method, path, headers={"Host": host})
                assert response.status_code == 421, (host, path, response.text)
                assert response.json()["error"]["code"] == "misdirected_request"
            headers = json_body | {"Host": host}
            response = open_server.http.post("/v1/chat/completions", content=body, headers=headers)
            assert response.status_code == 421, response.text
        for host in [f"127.0.0.1:{port}", "localhost", f"LocalHost:{port}", "[::1]:80", "::1"]:
            response = open_server.http.get("/v1/models", headers={"Host": host})
            assert response.status_code == 200, (host, response.text)
        headers = json_body | {"Host": "localhost"}
        response = open_server.http.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 200, response.text
    finally:
        open_server.stop()
    headers = {"Host": "attacker.example", "Authorization": f"Bearer {KEY}"}
    assert server.http.get("/v1/models", headers=headers).status_code == 200


def test_a_client_that_leaves_mid_body_is_one_line_in_the_log(server):
    """A body cut short by the client (it sent 10 of 1,000 bytes) was a 40-line traceback."""
    import socket

    port = int(server.url.rsplit(":", 1)[1].strip("/"))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + b'{"messages"')
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "left while sending" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.05)
    time.sleep(0.3)
    log = server.log.read_text()
    lines = [line for line in log.splitlines() if "left while sending" in line]
    assert len(lines) == 1 and "/v1/chat/completions's body (11 bytes came)" in lines[0], log
    assert "Traceback" not in log and "ClientDisconnect" not in log, log
    assert server.health()["status"] == "ok"


def test_a_request_that_is_not_http_is_a_400_in_openais_shape(server):
    """A negative Content-Length or a broken header was uvicorn's plain-text 400."""
    import socket

    port = int(server.url.rsplit(":", 1)[1].strip("/"))
    for head in [
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
        "GET / HTTP/1.1\r\nHost x\r\n\r\n",
    ]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head.encode())
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and b"application/json" in status, answer
        error = json.loads(body)["error"]
        assert error["message"] == "the request is not valid HTTP/1.1", error
        assert set(error) == {"message", "type", "param", "code"}
    assert server.health()["status"] == "ok"


def test_the_engine_batches_the_oldest_first_and_frees_the_places_of_clients_gone():
    import asyncio

    from picollama.sampling.rows import Row
    from picollama.sampling.sampler import Sampling
    from picollama.serve.engine import Engine, Job, QueueFull

    def job(length: int, n: int = 1) -> Job:
        return Job([Row([1] * length, Sampling(4, 0.0))] * n, [None] * n)

    async def batches():
        engine = Engine(model=None, max_batch=4, window=0, max_spread=10)
        jobs = [job(20), job(50), job(25, 2), job(28, 2), job(52), job(21)]
        jobs[5].cancel()  # its client left while it waited
        for waiting in jobs:
            engine.submit(waiting)
        taken = [engine.take() for _ in range(3)]
        return [[jobs.index(j) for j in batch] for batch in taken], engine.status()["queued"]

    # rows <= 4, prompts within 10 tokens of each other, the oldest first
    assert asyncio.run(batches()) == ([[0, 2], [1, 4], [3]], 0)

    async def places():
        engine = Engine(model=None, queue_size=2)
        left = [job(20), job(20)]
        for waiting in left:
            engine.submit(waiting)
            waiting.cancel()  # its client left while it waited
        engine.submit(job(20))  # the places they held are free again
        engine.submit(job(20))
        with pytest.raises(QueueFull):
            engine.submit(job(20))

    asyncio.run(places())


def test_a_full_queue_is_503_with_retry_after(run):
    """In-process: an engine that never starts, so the second request finds the queue full."""
    import asyncio

    from picollama.run_files import load_run
    from picollama.serve.app import create_app
    from picollama.serve.engine import Engine
    from picollama.serve.rows import ServedModel

    model, _, tokenizer = load_run(run, torch.device("cpu"), torch.float32)
    served = ServedModel(model, tokenizer, DEFAULT_TEMPLATE, "run")
    served.engine = Engine(model, queue_size=1)
    body = {"prompt": "op", "max_tokens": 2}

    async def scenario():
        transport = httpx.ASGITransport(app=create_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while served.engine.status()["queued"] < 1:
                await asyncio.sleep(0.01)
            second = await http.post("/v1/completions", json=body)
            first.cancel()
        return second

    second = asyncio.run(scenario())
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "overloaded"


# The page's readEvents, run by node on a body that arrives a byte at a time (lines and a
# character's bytes split across reads), then on the server's own stream.
PAGE_CHECK = """
(async () => {
  const bytes = new TextEncoder().encode(
    'data: {"t": "caf\\u00e9 \\u{1F600}"}\\r\\n\\r\\ndata: [DONE]\\n\\n');
  const body = new ReadableStream({ start(c) {
    for (const b of bytes) c.enqueue(new Uint8Array([b]));
    c.close();
  } });
  const split = [];
  await readEvents({ body }, (data) => split.push(data));
  const response = await fetch(process.env.URL + "/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: "Bearer " + process.env.KEY },
    body: JSON.stringify({ messages: [{ role: "user", content: "hello there" }], stream: true,
                           max_tokens: 30, temperature: 0 }),
  });
  let text = "";
  await readEvents(response, (data) => {
    if (data !== "[DONE]") text += JSON.parse(data).choices[0].delta.content || "";
  });
  console.log(JSON.stringify({ split, text }));
})();
"""


@pytest.mark.skipif(not shutil.which("node"), reason="node runs the chat page's script")
def test_the_chat_pages_script_parses_and_reads_split_events(server, client, tmp_path):
    page = (REPO / "picollama" / "serve" / "web" / "chat.html").read_text()
    script = re.search(r"<script>(.*)</script>", page, re.S)[1]
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    (tmp_path / "page.js").write_text(script)
    checked = subprocess.run(["node", "--check", tmp_path / "page.js"], capture_output=True)
    assert checked.returncode == 0, checked.stderr
    reader = re.search(r"async function readEvents.*?\n}\n", script, re.S)[0]
    env = {**os.environ, "URL": server.url, "KEY": KEY}
    done = subprocess.run(
        ["node", "-e", reader + PAGE_CHECK], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["split"] == ['{"t": "caf\u00e9 \U0001f600"}', "[DONE]"]
    assert got["text"] == chat(client, max_tokens=30, temperature=0).choices[0].message.content


def browser_executable() -> str | None:
    """A Chromium for playwright: the system's, else playwright's own download, else None."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    try:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            path = p.chromium.executable_path
        return path if Path(path).is_file() else None
    except Exception:  # no playwright, or no browser for it
        return None


@pytest.fixture(scope="module")
def browser():
    """Chromium driven by playwright, for the module's page tests."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    executable = browser_executable()
    if executable is None:
        pytest.skip("no Chromium for playwright (apt install chromium, or playwright install)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield browser
        browser.close()


IDLE = "!document.getElementById('send').disabled"
LAST_TEXT = "document.querySelector('.message:last-child span:last-child')"
# the texts the reply in the last message shows as it streams, each one kept
WATCH = f"""() => {{
  window.shown = new Set();
  new MutationObserver(() => window.shown.add({LAST_TEXT}.textContent))
    .observe(document.getElementById('log'), {{ subtree: true, childList: true,
                                               characterData: true }});
}}"""


def watched_page(browser, url: str, expected_401: bool = False):
    """(a new page at url, the list its script errors, dialogs and console errors go to; a wrong
    key's 401 is the one console error expected where expected_401)."""
    page = browser.new_page()
    failures = []
    page.on("pageerror", lambda e: failures.append(str(e)))
    page.on("dialog", lambda d: (failures.append(d.message), d.dismiss()))

    def console(message):
        if message.type == "error" and not (expected_401 and "status of 401" in message.text):
            failures.append(message.text)

    page.on("console", console)
    page.goto(f"{url}/")
    return page, failures


def test_the_chat_page_in_a_browser(server, client, browser, tmp_path):
    reply = chat(client, max_tokens=30, temperature=0).choices[0].message.content
    page, failures = watched_page(browser, server.url, expected_401=True)
    for field, value in (("#key", "wrong"), ("#temperature", "0"), ("#max-tokens", "30")):
        page.fill(field, value)
        page.dispatch_event(field, "change")
    page.fill("#input", HELLO[0]["content"])
    page.press("#input", "Enter")
    assert "Incorrect API key" in page.wait_for_selector(".message.error").text_content()
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.click("#regenerate")  # the error goes; the reply streams in
    page.wait_for_function(f"document.querySelectorAll('.message').length == 2 && {IDLE}")
    page.reload()  # the conversation is kept
    assert page.text_content(".message.assistant span:last-child") == reply
    before = server.health()["engine"]["cancelled_rows"]
    markup = "<b>bold</b><img src=x onerror=alert(1)> caf\u00e9 \U0001f600"
    page.fill("#max-tokens", "")
    page.fill("#input", markup)
    page.evaluate(WATCH)
    page.click("#send")
    page.wait_for_function(f"{LAST_TEXT}.textContent.length > 9")
    page.click("#stop")
    page.wait_for_function(IDLE)
    # the reply grew in several steps as it streamed, then stopped where it was
    assert len(set(page.evaluate("[...window.shown]")) - {""}) >= 2
    assert page.text_content(".message.user:nth-last-child(2) span:last-child") == markup
    assert not page.query_selector_all("#log img, #log b") and not failures
    assert page.text_content(".message:last-child .role") == "assistant (stopped)"
    page.screenshot(path=tmp_path / "chat.png")
    deadline = time.monotonic() + 10  # the stream closed by the browser: its row ends
    while server.health()["engine"]["cancelled_rows"] == before:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.01)
    assert server.health()["engine"]["cancelled_rows"] == before + 1


def scripted_run(run: Path, root: Path) -> tuple[Path, str]:
    """(a copy of `run` whose model answers every prompt alike, then ends its turn, and that
    answer's text): a word, "\u00e9", a word, "\U0001f600", each character's UTF-8 bytes byte
    tokens of their own. The model is a table of what follows each token (greedy): its blocks
    pass their input on, the embedding says which of the answer's tokens came (column 0: none),
    the output layer which token follows."""
    model, _ = load_model(run)
    tokenizer = open_tokenizer(run / "tokenizer.model")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())]
    words = [i for i, piece in enumerate(pieces) if piece[:1] == "\u2581" and len(piece) >= 4]
    e_acute = [pieces.index(f"<0x{b:02X}>") for b in "\u00e9".encode()]
    smile = [pieces.index(f"<0x{b:02X}>") for b in "\U0001f600".encode()]
    reply = [words[0], *e_acute, words[1], *smile]
    with torch.no_grad():
        for block in model.layers:
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        embedding, output = model.tok_embeddings.weight, model.output.weight
        embedding.zero_()
        output.zero_()
        embedding[:, 0] = 1
        for state, token in enumerate(reply, 1):
            embedding[token, 0], embedding[token, state] = 0, 1
        for state, token in enumerate([*reply, tokenizer.eos_id()]):
            output[token, state] = 10  # sure even at the page's temperature
    return save_model(model, root, None, run / "tokenizer.model"), tokenizer.decode(reply)


@pytest.fixture(scope="module")
def scripted(run, tmp_path_factory):
    """(a server without a key on scripted_run's model, its answer)."""
    root = tmp_path_factory.mktemp("scripted")
    scripted_dir, answer = scripted_run(run, root / "run")
    server = Server(root, scripted_dir)
    yield server, answer
    server.stop()


def test_the_chat_page_shows_a_reply_of_20000_chunks_in_time_linear_in_it(server, browser):
    """The page re-rendered the whole reply on every chunk: 8,000 chunks took ~30 s and 20,000
    froze it. Here a route answers 20,000 chunks at once, and the page shows them all."""
    chunks = 20_000
    events = "".join(
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) + "\n\n"
        for i in range(chunks)
    )
    page, failures = watched_page(browser, server.url)
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=events + "data: [DONE]\n\n"
        ),
    )
    page.fill("#input", "count")
    started = time.monotonic()
    page.press("#input", "Enter")
    page.wait_for_function(f"document.querySelectorAll('.message').length == 2 && {IDLE}")
    took = time.monotonic() - started
    shown = page.query_selector(".message:last-child span:last-child").text_content()
    assert shown == "".join(f"w{i} " for i in range(chunks)) and not failures
    assert took < 15, took  # a few tenths of a second here, where it took minutes
    page.close()


def test_accents_and_emoji_split_across_tokens_arrive_intact(scripted, browser, tmp_path):
    server, answer = scripted
    assert "\u00e9" in answer and answer.endswith("\U0001f600")
    client = server.client("unused")
    whole = chat(client, max_tokens=20, temperature=0).choices[0]
    assert whole.message.content == answer and whole.finish_reason == "stop"
    text, chunks = streamed(client, max_tokens=20, temperature=0)
    parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert text == answer and len(parts) >= 3 and not any("\ufffd" in part for part in parts)
    page, failures = watched_page(browser, server.url)
    sent = []
    page.on("request", lambda r: r.method == "POST" and sent.append(json.loads(r.post_data)))
    typed = ["caf\u00e9 \U0001f600 na\u00efve", "and again"]
    for turn, text in enumerate(typed, 1):
        page.fill("#input", text)
        page.press("#input", "Enter")
        page.wait_for_function(
            f"document.querySelectorAll('.message').length == {2 * turn} && {IDLE}"
        )
    shown = page.query_selector_all(".message span:last-child")
    assert [element.text_content() for element in shown] == [typed[0], answer, typed[1], answer]
    # each request holds the conversation so far, and no reply of its own
    first = {"role": "user", "content": typed[0]}
    conversation = [first, {"role": "assistant", "content": answer}, {**first, "content": typed[1]}]
    assert [body["messages"] for body in sent] == [conversation[:1], conversation]
    page.screenshot(path=tmp_path / "chat.png")
    assert not failures


def test_logprobs_join_into_a_text_cut_inside_a_character(scripted):
    """max_tokens ends the answer after two of the emoji's four bytes: the text ends before the
    emoji, with no U+FFFD, and the logprob entries still join into it (streamed or not, chat or
    completion). The tokens of the emoji's two bytes keep their entries, with no text."""
    server, answer = scripted
    client = server.client("unused")
    whole = chat(client, max_tokens=6, temperature=0, logprobs=True).choices[0]
    cut = whole.message.content
    assert cut == answer[:-1] and whole.finish_reason == "length"
    assert [t.token for t in whole.logprobs.content][-2:] == ["", ""]
    assert "".join(t.token for t in whole.logprobs.content) == cut
    text, chunks = streamed(client, max_tokens=6, temperature=0, logprobs=True)
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    entries = [t.token for chunk in logprobs for t in chunk.content]
    assert text == cut and "".join(entries) == cut and len(entries) == 6
    plain = client.completions.create(
        model="run", prompt="op", max_tokens=6, temperature=0, logprobs=1
    )
    assert "".join(plain.choices[0].logprobs.tokens) == plain.choices[0].text
    text = plain.choices[0].text
    assert text.strip() == answer[:-1] and len(plain.choices[0].logprobs.tokens) == 6


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smollm2_names_the_capital_of_france_through_the_server(tmp_path):
    # In float: in its file's Q4_1 the model names another city, as llama.cpp's does on that file.
    server = Server(tmp_path, SMOLLM2, "--quantize", "none")
    try:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        client = server.client("no key needed")
        answer = chat(client, messages=question, max_tokens=30, temperature=0, logprobs=True)
        choice = answer.choices[0]
        assert "Paris" in choice.message.content and choice.finish_reason == "stop", answer
        # every token the model chose: the reply's, and the end of its turn
        assert answer.usage.completion_tokens == len(choice.logprobs.content) + 1
    finally:
        server.stop()


def test_the_model_is_loaded_on_the_thread_that_decodes(monkeypatch):
    """One thread makes every torch call (libgomp's spin-wait, cut short with a second thread's
    pool on 2 cores, made each step 2.3x slower): load and the engine run on the same thread."""
    import picollama.serve.main as serve

    threads = {}

    class Engine:
        def run(self):
            threads["run"] = threading.current_thread()

    class Served:
        engine = Engine()

    def load(args):
        threads["load"] = threading.current_thread()
        return Served()

    monkeypatch.setattr(serve, "load", load)
    served = serve.load_on_engine_thread(None)
    deadline = time.monotonic() + 10
    while "run" not in threads:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert isinstance(served, Served) and threads["load"] is threads["run"]
    assert threads["load"] is not threading.main_thread()

    def failing(args):
        raise serve.UserError("no such run")

    monkeypatch.setattr(serve, "load", failing)
    with pytest.raises(serve.UserError, match="no such run"):
        serve.load_on_engine_thread(None)
