"""The server's FastAPI app, which speaks OpenAI's HTTP API.

It owns the endpoints, the bearer key, the error shapes and streaming. It never runs the model.
It queues jobs for the engine and relays what comes back."""

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
from picollama.serve.protocol import ApiError, Ask, chat_request, completion_request, read_json
from picollama.serve.rows import ServedModel

MAX_BODY = 8 << 20  # Bytes in a request body. A larger one is refused before it is read.
PAGE = Path(__file__).parent / "web" / "chat.html"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log, so its lines look alike.


def create_app(served: ServedModel, api_key: str | None = None) -> FastAPI:
    """The app serving `served`: the chat page at /, /health, and OpenAI's /v1 endpoints.

    Given a key, /v1 needs `Authorization: Bearer api_key`."""
    app = FastAPI(title="picollama", docs_url=None, redoc_url=None, openapi_url=None)
    add_errors(app)
    if api_key:
        app.add_middleware(BearerKey, key=api_key)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "engine": served.engine.status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        served_as(served, name)
        return served.card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        ask = chat_request(read_json(await body_of(request)), served.engine.max_batch)
        served_as(served, ask.model)
        return await answer(served, request, ask)

    @app.post("/v1/completions")
    async def completions(request: Request):
        ask = completion_request(read_json(await body_of(request)), served.engine.max_batch)
        served_as(served, ask.model)
        return await answer(served, request, ask)

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
    """ASGI middleware. /v1/* needs `Authorization: Bearer KEY`, else a 401 in OpenAI's shape."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            refusal = None
            if scheme.lower() != b"bearer" or not token.strip():
                refusal = "You didn't provide an API key: send it as Authorization: Bearer KEY"
            elif not hmac.compare_digest(token.strip(), self.key):
                refusal = "Incorrect API key provided"
            if refusal:
                response = error_response(ApiError(401, refusal, code="invalid_api_key"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


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


async def answer(served: ServedModel, request: Request, ask: Ask) -> Response:
    """Queue the request's rows and answer, streamed as server-sent events or whole."""
    # Encoding a long prompt takes a while, so it runs off the event loop.
    rows, texts, prompt_tokens = await anyio.to_thread.run_sync(served.rows, ask)
    job = Job(rows, texts)
    try:
        served.engine.submit(job)
    except QueueFull:
        waiting = served.engine.queue_size
        message = f"the server is busy ({waiting} requests waiting); retry shortly"
        raise ApiError(503, message, code="overloaded", headers={"Retry-After": "1"}) from None
    head = shapes.Head(ask.kind, served.name, ask.logprobs is not None, ask.include_usage)
    if ask.stream:
        return EventStream(job, events(job, head, prompt_tokens))
    gathered = await gather(job, request)
    if gathered is None:  # The client left.
        return Response(status_code=499)
    if gathered.failed is not None:
        raise failure(gathered.failed)
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

    It may finish, lose its client (starlette cancels the stream) or never start."""

    def __init__(self, job: Job, content):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


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
            yield shapes.sse(failure(event).body())
            return
        if isinstance(event, Finished):
            over, tokens = over + 1, tokens + event.tokens
            yield shapes.chunk(head, event.choice, reason=event.reason)
        elif event.text or event.entries:
            yield shapes.chunk(head, event.choice, event.text, event.entries)
    if head.include_usage:
        yield shapes.usage_chunk(head, prompt_tokens, tokens)
    yield shapes.DONE
