"""The ingress side of `staticrt serve --replicas`: the OpenAI app (app.py) over `Replicas`, which
sends each request to the engine replicas through a streaming handle as an `EngineCall`.

A replica that dies before a request streamed anything has the request sent to another (`RETRIES`
times); one that dies after ends the stream with an error event, since the tokens sent cannot be
taken back. `/health` says what each replica admitted, holds and is streaming.

Imports Ray: only serve/ray.py imports this module.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from ..errors import GenerationError, StaticrtError
from .job import Completion, Event
from .scheduler import NotAdmitting, QueueFull

# Other replicas a request is sent to when its replica dies before it streamed a token.
RETRIES, RETRY_WAIT_S = 4, 0.25
LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class EngineCall:
    """One request as a replica takes it. `prompt` is what Ray's prefix router matches: the
    prompt's token ids, one character each (U+E000 on, past the surrogates), so that a shared
    prefix of characters is a shared prefix of tokens, which is what a row can keep."""

    prompt: str
    completion: Completion
    interval: int


def call_for(completion: Completion, interval: int) -> EngineCall:
    return EngineCall("".join(chr(0xE000 + t) for t in completion.prompt), completion, interval)


def _count(names: Iterable[str]) -> dict[str, int]:
    return dict(collections.Counter(names))


def refusal_status(err: StaticrtError) -> int:
    """The HTTP status of a scheduler's refusal."""
    return 429 if isinstance(err, QueueFull) else 503 if isinstance(err, NotAdmitting) else 400


class ReplicaMetrics:
    """The ingress's `/metrics`: requests by the replica that served them, retries, lost streams."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.served = Counter("staticrt_replica_requests", "requests admitted, by replica", ["replica"], registry=r)
        self.retried = Counter("staticrt_replica_retries", "requests sent again after their replica died", registry=r)
        self.lost = Counter(
            "staticrt_replica_lost_streams", "streams ended by an error because their replica died", registry=r
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Replicas:
    """What app.py needs of a scheduler, over the engine deployment's replicas."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine.options(stream=True)
        self.tokenizer = tokenizer
        self.metrics = ReplicaMetrics()
        self.admitting = True
        self.open: set[RemoteJob] = set()
        self.seen: dict[str, int] = {}  # replica -> requests it admitted

    def start(self) -> None:  # Ray runs the replicas
        pass

    def stop(self) -> None:
        self.admitting = False

    def health(self) -> dict[str, Any]:
        """`replicas`: requests each replica admitted; `holding`: its requests still open; `streaming`:
        those of them that streamed a token, which its death would end with an error (the rest are
        sent again)."""
        jobs = list(self.open)
        return {
            "status": "ok",
            "open_requests": len(jobs),
            "replicas": dict(self.seen),
            "holding": _count(job.replica for job in jobs),
            "streaming": _count(job.replica for job in jobs if job.tokens),
        }

    async def submit(self, completion: Completion, emit: Callable[[Event], None], interval: int = 1) -> RemoteJob:
        """Admitted by a replica, or QueueFull / NotAdmitting / GenerationError as a scheduler raises."""
        if not self.admitting:
            raise NotAdmitting("the server is shutting down and takes no new requests; retry shortly")
        job = RemoteJob(self, call_for(completion, interval), emit)
        await job.open()
        job.task = asyncio.create_task(job.pump())
        self.open.add(job)
        job.task.add_done_callback(lambda _: self.open.discard(job))
        return job


class RemoteJob:
    """A request on a replica: its stream of events, sent again elsewhere while nothing has streamed."""

    def __init__(self, replicas: Replicas, call: EngineCall, emit: Callable[[Event], None]) -> None:
        self.replicas, self.call, self.emit = replicas, call, emit
        self.stream: Any = None
        self.task: asyncio.Task | None = None
        self.tokens = 0  # streamed to the client
        self.replica = ""  # the one that admitted it

    async def open(self, tries: int = RETRIES + 1) -> None:
        for attempt in range(tries):
            self.stream = self.replicas.engine.generate.remote(self.call)
            try:
                first = await self.stream.__anext__()
            except BackPressureError as err:
                raise QueueFull(f"every replica's rows and the queue are full ({err}); retry shortly") from None
            except LOST as err:
                if attempt + 1 == tries:
                    raise NotAdmitting(f"{tries} replicas died before taking this request ({err}); retry") from None
                self.replicas.metrics.retried.inc()
                await asyncio.sleep(RETRY_WAIT_S * 2**attempt)  # while Ray's router learns the replica is gone
                continue
            if first.kind == "error":
                raise {429: QueueFull, 503: NotAdmitting}.get(first.status, GenerationError)(first.message)
            self.replica = first.message
            self.replicas.seen[first.message] = self.replicas.seen.get(first.message, 0) + 1
            self.replicas.metrics.served.labels(first.message).inc()
            return

    async def pump(self) -> None:
        """The replica's events to the client; a lost replica's request goes to another until a token went."""
        while True:
            try:
                async for event in self.stream:
                    self.tokens += len(event.tokens)
                    self.emit(event)
                return
            except LOST as err:
                if self.tokens:
                    self.replicas.metrics.lost.inc()
                    message = (
                        f"the replica serving this request died after {self.tokens} streamed tokens "
                        f"({type(err).__name__}); send the request again"
                    )
                    self.emit(Event("error", status=502, message=message))
                    return
                self.replicas.metrics.retried.inc()
                try:
                    await self.open(RETRIES)
                except StaticrtError as refusal:
                    self.emit(Event("error", status=refusal_status(refusal), message=str(refusal)))
                    return

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.stream is not None:
            self.stream.cancel()


@serve.ingress()
class Ingress:
    """The OpenAI app (app.py) over `Replicas`; its limits and tokenizer come from a replica."""

    def __init__(self, engine: Any, api_key: str | None, stream_interval: int) -> None:
        self.engine, self.api_key, self.stream_interval = engine, api_key, stream_interval

    async def __serve_build_asgi_app__(self) -> Any:
        from .app import create_app

        limits, tokenizer = await self.engine.describe.remote()
        replicas = Replicas(self.engine, tokenizer)
        return create_app(replicas, limits, api_key=self.api_key, stream_interval=self.stream_interval)
