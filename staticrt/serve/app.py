"""The HTTP face of a scheduler: OpenAI's `/v1/chat/completions`, `/v1/completions` and
`/v1/models`, with `/health` and Prometheus `/metrics`, on FastAPI.

Every request is checked before it is queued (400 naming the field), a full queue answers 429
with Retry-After, a server shutting down 503; a client that goes away cancels its job, which
frees its row at the next step. With an API key every endpoint but /health needs
`Authorization: Bearer KEY`, compared in constant time. Bodies above `max_body` bytes are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import ConfigError, GenerationError
from . import http_limits
from .answers import Choices, Tagged, error_response, stream, whole
from .job import Completion, Event
from .openapi import KEY_REFUSAL, completion_route
from .protocol import (
    BadRequest,
    Limits,
    chat_prompt,
    check_fields,
    choices_asked,
    completion_prompt,
    completion_request,
)
from .reply import Reply
from .scheduler import NotAdmitting, QueueFull, Scheduler
from .tools import Tools

MAX_BODY = 1 << 20  # bytes; a prompt of the longest context is far below it


class Guard:
    """The API key and the body-size limit, checked from the headers before the app sees the
    request. Plain ASGI rather than `@app.middleware("http")`, whose wrapping of every streamed
    chunk in an anyio stream cost the HTTP thread as much CPU as the rest of a request."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.max_body = app, max_body
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope: dict) -> JSONResponse | None:
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return error_response(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            size = length.decode(errors="replace")
            return error_response(413, f"the request body is {size} bytes; the limit is {self.max_body}")
        return None


def create_app(
    scheduler: Scheduler | Any,
    limits: Limits,
    api_key: str | None = None,
    max_body: int = MAX_BODY,
    stream_interval: int = 1,
) -> FastAPI:
    """An app serving `scheduler`; its lifespan starts the scheduler and stops it. A streamed
    answer sends its first token at once, then `stream_interval` tokens a chunk. `scheduler` may
    also be Ray replicas (ray.py: `Replicas`), which admit a request asynchronously."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

    if api_key is not None and not api_key:  # "" would compare equal to an empty Bearer header
        raise ConfigError("the API key is empty, which would leave the server open; pass a key, or None for no key")
    app = FastAPI(title="staticrt", lifespan=lifespan)

    app.add_middleware(Guard, api_key=api_key, max_body=max_body)
    text = scheduler.tokenizer is not None  # what the routes' schemas allow (openapi.py)
    # the key in the schema: the Guard checks it, this only describes it (auto_error off)
    secured = dict(dependencies=[Depends(HTTPBearer(auto_error=False))]) if api_key else {}
    keyed = dict(secured, responses=KEY_REFUSAL) if api_key else {}  # the completions list every refusal

    @app.get("/health")
    async def health() -> dict:
        return scheduler.health()

    @app.get("/metrics", response_class=PlainTextResponse, **keyed)  # Prometheus' text format
    async def metrics() -> Response:
        return Response(scheduler.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", **keyed)
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": limits.model, "object": "model", "created": 0, "owned_by": "staticrt"}],
        }

    @app.post("/v1/completions", openapi_extra=completion_route(limits, False, text), **secured)
    async def completions(request: Request) -> Response:
        return await _complete(request, scheduler, limits, max_body, stream_interval, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=completion_route(limits, True, text), **secured)
    async def chat_completions(request: Request) -> Response:
        return await _complete(request, scheduler, limits, max_body, stream_interval, chat=True)

    return app


async def _complete(
    request: Request, scheduler: Scheduler, limits: Limits, max_body: int, stream_interval: int, chat: bool
) -> Response:
    """Check the body, queue its jobs (a choice each), and answer whole or as a stream of events.
    Everything a request sends is checked before a job exists; parsing, templating and tokenising
    run in a worker thread, so a megabyte of prompt never holds up the event loop's other clients."""
    try:
        raw = await asyncio.wait_for(_body(request, max_body), http_limits.BODY_S)
    except asyncio.TimeoutError:
        return error_response(408, f"the request body took over {http_limits.BODY_S:g} s to arrive; send it at once")
    if raw is None:
        return error_response(413, f"the request body is over {max_body} bytes, the limit; send less")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Tagged] = asyncio.Queue()

    def emitter(index: int) -> Any:
        def emit(event: Event) -> None:  # on the stepping thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the event loop has closed: the server is gone, and so is the client
                pass

        return emit

    jobs = Choices()
    try:
        asked = await asyncio.to_thread(_parse, bytes(raw), scheduler.tokenizer, limits, chat)
        for i, completion in enumerate(asked.completions):  # whole: one event at each choice's end
            job = scheduler.submit(completion, emitter(i), stream_interval if asked.stream else 0)
            jobs.append(await job if inspect.isawaitable(job) else job)  # replicas (ray.py) admit through a call
    except (BadRequest, GenerationError, QueueFull, NotAdmitting) as err:
        jobs.cancel()  # choices admitted before the one refused
        return _refusal(err)
    reply = Reply(limits.model, chat, scheduler.tokenizer)
    if asked.stream:
        return StreamingResponse(stream(jobs, events, reply, asked.usage, asked.tools), media_type="text/event-stream")
    watcher = asyncio.create_task(_watch_disconnect(request, jobs))
    try:
        return await whole(events, len(jobs), reply, asked.tools)
    finally:
        watcher.cancel()


async def _body(request: Request, max_body: int) -> bytearray | None:
    """The body, counted as it arrives (a chunked body has no content-length); None past `max_body`."""
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > max_body:
            return None
    return raw


def _refusal(err: Exception) -> Response:
    if isinstance(err, QueueFull):
        return error_response(429, str(err), headers={"Retry-After": "1"})
    if isinstance(err, NotAdmitting):
        return error_response(503, str(err))
    return error_response(400, str(err), getattr(err, "param", None))


@dataclass(frozen=True)
class Asked:
    """A checked request: whether to stream (and send usage), a completion a choice, the tools."""

    stream: bool
    usage: bool
    completions: list[Completion]
    tools: Tools | None


def _parse(raw: bytes, tokenizer: Any, limits: Limits, chat: bool) -> Asked:
    """The request from its raw body: BadRequest on any fault. Choice i of a seeded request samples
    with seed + i, as row i of a seeded `generate` does."""
    try:
        body = json.loads(raw)
    except ValueError as err:  # UnicodeDecodeError included
        raise BadRequest(f"the body is not JSON ({err})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}; send an object")
    stream, usage = check_fields(body)
    n = choices_asked(body, limits)
    if chat:
        prompt, tools = chat_prompt(body, tokenizer)
    else:
        prompt, tools = completion_prompt(body, tokenizer, limits.vocab_size), None
    one = completion_request(body, prompt, limits, chat, tokenizer)
    if tools is not None:
        one = tools.forcing(one, tokenizer, limits.vocab_size, limits.eos_token_ids)
    seed = one.sampling.seed
    seeds = [None if seed is None else seed + i for i in range(n)]
    completions = [dataclasses.replace(one, sampling=dataclasses.replace(one.sampling, seed=s)) for s in seeds]
    return Asked(stream, usage, completions, tools)


async def _watch_disconnect(request: Request, jobs: Choices) -> None:
    """Cancel every choice when the client goes away before the answer is whole."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    jobs.cancel()
