"""GET /metrics of `python -m picollama.serve`, read with prometheus_client's own parser, against
the usage the openai client got back."""

import time
from types import SimpleNamespace

import pytest
from test_serve import CONTEXT, KEY, Server, build_run, chat

openai = pytest.importorskip("openai", reason="the openai client: pip install -e '.[dev]'")
parser = pytest.importorskip("prometheus_client.parser", reason="pip install -e '.[serve]'")
metrics = pytest.importorskip("picollama.serve.metrics")

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    server = Server(root / "server", build_run(root), "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


class Scrape:
    """One read of /metrics, parsed: each sample's value by its name and labels."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in parser.text_string_to_metric_families(text)}
        self.values = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in self.families.values()
            for s in family.samples
        }

    def __call__(self, name: str, **labels) -> float:
        return self.values[(name, frozenset(labels.items()))]

    def requests(self, endpoint: str, outcome: str) -> float:
        return self("picollama_requests_total", endpoint=endpoint, outcome=outcome)


def scrape(server, key: str = KEY) -> Scrape:
    answer = server.http.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return Scrape(answer.text)


def scrape_when(server, want: float, name: str, **labels) -> Scrape:
    """/metrics once the sample reads `want` (or 10 s on). The engine records a decode step just
    after the tokens it chose have gone to their clients, and notices a client gone at its next
    token, so either may come a moment after the client has its answer."""
    deadline = time.monotonic() + 10
    while True:
        now = scrape(server)
        if now(name, **labels) == want or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def test_the_counters_move_by_what_the_api_returned(server, client):
    before = scrape(server)
    whole = chat(client, max_tokens=8, temperature=0)
    prompts = ["op gum", "gum op op"]
    text = client.completions.create(model="run", prompt=prompts, max_tokens=5, temperature=0)
    chunks = list(
        chat(
            client, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = chunks[-1].usage
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=CONTEXT)
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("wrong-key"), max_tokens=2)
    reasons = [c.finish_reason for c in [*whole.choices, *text.choices]]
    assert reasons == ["length"] * 3 and chunks[-2].choices[0].finish_reason == "length"
    # each row's first token comes as it joins, each later one from a decode step
    steps = (8 - 1) + (5 - 1) + (6 - 1)
    old = before("picollama_decode_step_seconds_count")
    after = scrape_when(server, old + steps, "picollama_decode_step_seconds_count")

    def moved(name: str, **labels) -> float:
        return after(name, **labels) - before(name, **labels)

    usages = [whole.usage, text.usage, streamed]
    assert moved("picollama_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("picollama_completion_tokens_total") == sum(u.completion_tokens for u in usages)
    assert moved("picollama_completion_tokens_total") == 8 + 2 * 5 + 6
    counted = {
        (endpoint, outcome): after.requests(endpoint, outcome) - before.requests(endpoint, outcome)
        for endpoint in (CHAT, TEXT)
        for outcome in metrics.OUTCOMES
    }
    assert {key: n for key, n in counted.items() if n} == {
        (CHAT, "ok"): 2,
        (TEXT, "ok"): 1,
        (CHAT, "refused"): 1,
        (CHAT, "unauthorized"): 1,
    }
    assert moved("picollama_time_to_first_token_seconds_count") == 3
    assert moved("picollama_time_to_first_token_seconds_sum") > 0
    assert moved("picollama_decode_step_seconds_count") == steps
    assert after("picollama_decode_step_seconds_count") == server.health()["engine"]["steps"]
    assert after("picollama_queued_requests") == 0 == after("picollama_running_rows")
    assert after("picollama_kept_prefixes") >= 0 and after("picollama_kept_prefix_tokens") >= 0
    families = after.families
    assert families["picollama_time_to_first_token_seconds"].type == "histogram"
    assert families["picollama_requests"].type == "counter"


def test_metrics_need_the_key_and_speak_both_formats(server):
    refused = server.http.get("/metrics")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert server.http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    plain = server.http.get("/metrics", headers=auth)
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE picollama_decode_step_seconds histogram" in plain.text
    accept = {**auth, "Accept": "application/openmetrics-text; version=1.0.0"}
    rich = server.http.get("/metrics", headers=accept)
    assert rich.headers["content-type"].startswith("application/openmetrics-text")
    assert rich.text.endswith("# EOF\n")


def test_a_client_that_leaves_is_counted_cancelled(server, client):
    first = scrape(server)
    before = first.requests(CHAT, "cancelled")
    stream = chat(client, max_tokens=CONTEXT // 2, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    labels = dict(endpoint=CHAT, outcome="cancelled")
    after = scrape_when(server, before + 1, "picollama_requests_total", **labels)
    assert after.requests(CHAT, "cancelled") == before + 1
    assert after.requests(CHAT, "ok") == first.requests(CHAT, "ok")  # counted once
    settled = scrape_when(server, 0, "picollama_running_rows")
    assert settled("picollama_running_rows") == 0


class Engine(SimpleNamespace):
    def status(self) -> dict:
        return {"queued": self.queued}


def test_gauges_read_the_engine_and_each_app_has_its_own_registry():
    kept = Engine(
        queued=3,
        stats={"active_rows": 5},
        **{metrics.KEPT_PREFIXES: 2, metrics.KEPT_PREFIX_TOKENS: 90},
    )
    bare = Engine(queued=0, stats={"active_rows": 0})
    first, second = metrics.Metrics(kept), metrics.Metrics(bare)  # two registries: no name collides
    read = Scrape(first.exposition("")[0].decode())
    assert read("picollama_queued_requests") == 3 and read("picollama_running_rows") == 5
    assert read("picollama_kept_prefixes") == 2 and read("picollama_kept_prefix_tokens") == 90
    read = Scrape(second.exposition("")[0].decode())
    assert read("picollama_kept_prefixes") == 0 == read("picollama_kept_prefix_tokens")
    assert read.requests(CHAT, "ok") == 0 == read.requests(TEXT, "failed")
    statuses = (200, 400, 401, 413, 499, 500, 503)
    assert [metrics.outcome_of(status) for status in statuses] == [
        "ok",
        "refused",
        "unauthorized",
        "refused",
        "cancelled",
        "failed",
        "unavailable",
    ]
