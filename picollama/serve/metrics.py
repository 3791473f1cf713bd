"""The server's Prometheus metrics, which GET /metrics serves in Prometheus' text format.

This module owns the metrics' names, help texts and buckets, and one registry an app, so two apps
in one process never mix their counts. It never runs the model and never reads a request. The
app reports each request's outcome and prompt tokens (Watch). The engine's jobs report their
tokens, and the engine the time of each decode step. Gauges read the engine when scraped."""

import time
from contextlib import contextmanager
from functools import partial

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder

from picollama.serve.protocol import ApiError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # the requests counted
# How a request ended: answered, its client gone, refused (4xx), refused for its key (401), the
# queue full or the server going down (503), or failed while decoding (500).
OUTCOMES = ("ok", "cancelled", "refused", "unauthorized", "unavailable", "failed")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)  # seconds
# The engine's attributes for the prefixes it keeps for reuse (KV cache prefix reuse). An engine
# without them reports 0.
KEPT_PREFIXES = "kept_prefixes"
KEPT_PREFIX_TOKENS = "kept_prefix_tokens"


def outcome_of(status: int) -> str:
    """The outcome an HTTP status says."""
    if status < 400:
        return "ok"
    if status == 401:
        return "unauthorized"
    if status == 499:
        return "cancelled"
    if status < 500:
        return "refused"
    return "unavailable" if status == 503 else "failed"


class Metrics:
    """The metrics of one app and its engine, in a registry of their own."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "picollama_requests",
            "Completion requests, by endpoint and how they ended",
            ["endpoint", "outcome"],
            registry=registry,
        )
        for endpoint in ENDPOINTS:  # every series from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        self.prompt_tokens = Counter(
            "picollama_prompt_tokens", "Prompt tokens of the requests queued", registry=registry
        )
        self.completion_tokens = Counter(
            "picollama_completion_tokens",
            "Tokens the model chose, as usage counts them (a final end-of-turn token included)",
            registry=registry,
        )
        self.ttft = Histogram(
            "picollama_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.steps = Histogram(
            "picollama_decode_step_seconds",
            "One decode step: a token for every row decoding (continuous batching)",
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.gauges(registry)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)

    def gauges(self, registry: CollectorRegistry):
        """The gauges, read from the engine when scraped."""
        Gauge(
            "picollama_queued_requests", "Requests waiting for the engine", registry=registry
        ).set_function(self.queued)
        Gauge(
            "picollama_running_rows",
            "Rows decoding (a request's n choices are n rows)",
            registry=registry,
        ).set_function(self.running_rows)
        Gauge(
            "picollama_kept_prefixes", "Prompt prefixes kept for reuse", registry=registry
        ).set_function(partial(self.engine_number, KEPT_PREFIXES))
        Gauge(
            "picollama_kept_prefix_tokens", "Tokens the kept prefixes hold", registry=registry
        ).set_function(partial(self.engine_number, KEPT_PREFIX_TOKENS))

    def queued(self) -> float:
        return self.engine.status()["queued"]

    def running_rows(self) -> float:
        return self.engine.stats["active_rows"]

    def engine_number(self, name: str) -> float:
        """The engine's attribute `name`, or 0 where it has none."""
        return getattr(self.engine, name, 0) or 0

    @contextmanager
    def request(self, endpoint: str):
        """A request's Watch. A refusal raised in it counts as its outcome."""
        watch = Watch(self, endpoint)
        try:
            yield watch
        except ApiError as e:
            watch.end(outcome_of(e.status))
            raise
        except Exception:
            watch.end("failed")
            raise

    def unauthorized(self, path: str):
        """A request refused for its key before it reached its endpoint."""
        if path in ENDPOINTS:
            self.requests.labels(path, "unauthorized").inc()

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """(the metrics now, their content type), in the text format, or OpenMetrics where the
        Accept header asks for it, as prometheus_client's own handlers answer."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class Watch:
    """One request's metrics: its outcome (the first said), prompt tokens, first token and
    tokens. The engine thread calls token and finished, the app the others."""

    def __init__(self, metrics: Metrics, endpoint: str):
        self.metrics, self.endpoint = metrics, endpoint
        self.arrived = time.perf_counter()
        self.first_token: float | None = None
        self.outcome: str | None = None

    def queued(self, prompt_tokens: int):
        self.metrics.prompt_tokens.inc(prompt_tokens)

    def token(self):
        """A token chosen. The first one's time since arrival is the TTFT."""
        if self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.first_token - self.arrived)

    def finished(self, tokens: int):
        """A choice ended with `tokens` tokens (an end-of-turn token alone is a first token)."""
        if tokens:
            self.token()
            self.metrics.completion_tokens.inc(tokens)

    def end(self, outcome: str):
        if self.outcome is None:
            self.outcome = outcome
            self.metrics.requests.labels(self.endpoint, outcome).inc()
