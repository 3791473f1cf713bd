"""The server's FastAPI app, which speaks OpenAI's HTTP API.

It owns the endpoints, the bearer key, the Host check, the error shapes and streaming. It never
runs the model. It queues jobs for the engine and relays what comes back."""

import asyncio
import hmac
import logging
from pathlib import Path

import anyio
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from picollama.serve import responses as shapes
from picollama.serve.engine import Finished, Job, QueueFull
from picollama.serve.metrics import Metrics, Watch, outcome_of
from picollama.serve.protocol import ApiError, Ask, chat_request, completion_request, read_json
from picollama.serve.rows import ServedModel

MAX_BODY = 8 << 20  # Bytes in a request body. A larger one is refused before it is read.
PAGE = Path(__file__).parent / "web" / "chat.html"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log, so its lines look alike.


def create_app(
    served: ServedModel, api_key: str | None = None, hosts: frozenset[str] | None = None
) -> FastAPI:
    """The app serving `served`: the chat page at /, /health, /metrics and OpenAI's /v1 endpoints.

    Given a key, /v1 and /metrics need `Authorization: Bearer api_key`. Given `hosts`, every
    request must name one of them in its Host header (HostCheck). None: any Host."""
    app = FastAPI(title="picollama", docs_url=None, redoc_url=None, openapi_url=None)
    add_errors(app)
    metrics = Metrics(served.engine)
    served.engine.on_step = metrics.steps.observe
    if api_key:
        app.add_middleware(BearerKey, key=api_key, metrics=metrics)
    if hosts is not None:
        app.add_middleware(HostCheck, hosts=hosts)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "engine": served.engine.status()}

    @app.get("/metrics")
    async def prometheus(request: Request):
        content, media_type = metrics.exposition(request.headers.get("accept", ""))
        return Response(content, media_type=media_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        served_as(served, name)
        return served.card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        with metrics.request("/v1/chat/completions") as watch:
            ask = chat_request(await json_of(request), served.engine.max_batch)
            served_as(served, ask.model)
            return await answer(served, request, ask, watch)

    @app.post("/v1/completions")
    async def completions(request: Request):
        with metrics.request("/v1/completions") as watch:
            ask = completion_request(await json_of(request), served.engine.max_batch)
            served_as(served, ask.model)
            return await answer(served, request, ask, watch)

    return app


def served_as(served, name: str | None):
    """404 in OpenAI's shape unless `name` is the served model's. A request may leave it out."""
    if name is not None and name != served.name:
        raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")


class Server(uvicorn.Server):
    """uvicorn's server, closing the engine as soon as it is told to stop.

    Answers under way then end with a 503 rather than hold up the shutdown."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.close()
        super().handle_exit(sig, frame)


class Http(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (a negative Content-Length,
    a broken header) in OpenAI's error shape rather than as plain text."""

    def send_400_response(self, msg: str) -> None:
        response = error_response(
            ApiError(400, "the request is not valid HTTP/1.1", code="bad_http")
        )
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=response.body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class BearerKey:
    """ASGI middleware. /v1/* and /metrics need `Authorization: Bearer KEY`, else a 401 in
    OpenAI's shape (counted in metrics)."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path == "/metrics"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            refusal = None
            if scheme.lower() != b"bearer" or not token.strip():
                refusal = "You didn't provide an API key: send it as Authorization: Bearer KEY"
            elif not hmac.compare_digest(token.strip(), self.key):
                refusal = "Incorrect API key provided"
            if refusal:
                self.metrics.unauthorized(path)
                response = error_response(ApiError(401, refusal, code="invalid_api_key"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class HostCheck:
    """ASGI middleware against DNS rebinding. An HTTP request whose Host header names none of
    `hosts` (port aside) is refused with a 421 in OpenAI's shape, the chat page too.

    A page of attacker.example, its name made to resolve to 127.0.0.1, reaches a server on this
    machine as its own origin, so the browser lets it read the answers. Its requests still say
    Host: attacker.example. A request with no Host (HTTP/1.0) names no site, so it passes."""

    def __init__(self, app, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"host")
            name = None if given is None else host_name(given.decode("latin-1"))
            if name is not None and name not in self.hosts:
                message = (
                    f"this server answers requests for {', '.join(sorted(self.hosts))}, not "
                    f"{name[:100]!r} (a page of another site may have sent it)"
                )
                response = error_response(ApiError(421, message, code="misdirected_request"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """A Host header's name, lower case, its port dropped: "[::1]:8000" is "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def add_errors(app: FastAPI):
    """Every error in OpenAI's shape: refusals, unknown URLs and methods, and failures."""

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{e.detail}: {request.method} {request.url.path}"
        return error_response(ApiError(e.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):
        message = f"the server failed on this request: {type(e).__name__}"
        return error_response(ApiError(500, message, code="internal_error"))


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def json_of(request: Request) -> dict:
    """The request's body, a JSON object (protocol.read_json). 415 unless it is sent as
    application/json: a page of another site can POST text/plain without asking (no CORS
    preflight), so a body of any other type is never read."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        said = f"'{media_type[:100]}'" if media_type else "none"
        message = f"the request body must be sent as Content-Type: application/json, not {said}"
        raise ApiError(415, message, code="unsupported_media_type")
    return read_json(await body_of(request))


async def body_of(request: Request) -> bytes:
    """The request's body. 413 if it is over MAX_BODY bytes, whether declared or sent."""
    too_large = ApiError(413, f"the request body is over {MAX_BODY:,} bytes", code="too_large")
    said = request.headers.get("content-length", "")
    if said.isdigit() and int(said) > MAX_BODY:
        raise too_large
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY:
                raise too_large
            parts.append(part)
    except ClientDisconnect:  # One line in the log, not a traceback. No one reads the answer.
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        LOG.warning(
            "%s left while sending %s's body (%d bytes came)", client, request.url.path, size
        )
        raise ApiError(400, "the client left while sending the request body") from None
    return b"".join(parts)


async def answer(served: ServedModel, request: Request, ask: Ask, watch: Watch) -> Response:
    """Queue the request's rows and answer, streamed as server-sent events or whole. The watch
    hears how it ends."""
    # Encoding a long prompt takes a while, so it runs off the event loop.
    rows, texts, prompt_tokens = await anyio.to_thread.run_sync(served.rows, ask)
    job = Job(rows, texts, watch)
    try:
        served.engine.submit(job)
    except QueueFull:
        waiting = served.engine.queue_size
        message = f"the server is busy ({waiting} requests waiting); retry shortly"
        raise ApiError(503, message, code="overloaded", headers={"Retry-After": "1"}) from None
    watch.queued(prompt_tokens)
    head = shapes.head_for(ask, served.name)
    if ask.stream:
        return EventStream(job, events(job, head, prompt_tokens))
    gathered = await gather(job, request)
    if gathered is None:  # The client left.
        watch.end("cancelled")
        return Response(status_code=499)
    if gathered.failed is not None:
        raise failure(gathered.failed)
    watch.end("ok")
    return JSONResponse(shapes.whole(head, gathered, prompt_tokens))


def failure(failed: shapes.Failed) -> ApiError:
    if failed.status == 503:
        return ApiError(503, failed.message, code="unavailable", headers={"Retry-After": "1"})
    return ApiError(failed.status, f"decoding failed: {failed.message}", code="internal_error")


async def gather(job: Job, request: Request) -> shapes.Gathered | None:
    """The job's choices once all are over. None if the client leaves, and the job is cancelled."""
    gathered = shapes.Gathered(len(job.rows))

    async def collect():
        while not gathered.over:
            gathered.add(await job.events.get())

    collecting = asyncio.ensure_future(collect())
    leaving = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        collecting.cancel()
        leaving.cancel()
        job.cancel()  # Harmless if it is already over.
    return gathered if gathered.over else None


async def disconnected(request: Request):
    """Return when the client closes the connection. The body must already be read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A stream of server-sent events that cancels its job however it ends.

    It may finish, lose its client (starlette cancels the stream) or never start. One that ends
    before events() has said how counts as cancelled: its client left."""

    def __init__(self, job: Job, content):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.job.watch.end("cancelled")  # No change if events() has said how it ended.


async def events(job: Job, head: shapes.Head, prompt_tokens: int):
    """The job's events as OpenAI's chunks.

    Chat sends the role first. Then come text and each choice's finish_reason, the usage where
    asked, and [DONE]. A failure is sent as an error event."""
    if head.kind == "chat":
        for index in range(len(job.rows)):
            yield shapes.chunk(head, index, role=True)
    over, tokens = 0, 0
    while over < len(job.rows):
        event = await job.events.get()
        if isinstance(event, shapes.Failed):
            job.watch.end(outcome_of(event.status))
            yield shapes.sse(failure(event).body())
            return
        if isinstance(event, Finished):
            over, tokens = over + 1, tokens + event.tokens
            yield shapes.chunk(head, event.choice, reason=event.reason)
        elif event.text or event.entries:
            yield shapes.chunk(head, event.choice, event.text, event.entries)
    if head.include_usage:
        yield shapes.usage_chunk(head, prompt_tokens, tokens)
    job.watch.end("ok")  # Before [DONE], so a client that then reads /metrics finds it counted.
    yield shapes.DONE
