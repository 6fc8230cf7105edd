"""Replicas past one process: the scheduler as a Ray Serve deployment (`Engine`: one replica = one
cache's rows, `max_ongoing_requests` = rows), behind the same OpenAI app as `staticrt serve`
(`Ingress`, app.py), which reaches the replicas through a streaming handle (`Replicas`).

The handle call carries the prompt (`EngineCall.prompt`: its token ids as characters), so Ray's
prefix-cache-affinity router sends a request to the replica whose rows saw its prefix while the
replicas' loads are even. Ray queues what no replica has a row for, up to `max_queued_requests`,
and refuses the rest (HTTP 429). A replica that dies before a request streamed anything has the
request sent to another (`RETRIES` times); one that dies after ends the stream with an error event,
since the tokens sent cannot be taken back. Ray's controller replaces the dead replica.

Imports Ray: only `staticrt serve --replicas` (the `ray` extra) imports this module.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
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
# Ray's prefix-affinity router; importing it through ray.serve.llm would import pyarrow and more.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


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


class Engine:
    """One replica: a scheduler over one model's or artifact's rows, stepping in its own thread.
    `build` returns the scheduler, every graph built, and its requests' limits (cli/serve.py's
    `build_scheduler` over the command line's arguments)."""

    def __init__(self, build: Callable[[], tuple[Any, Any]]) -> None:
        self.scheduler, self.limits = build()
        self.scheduler.start()
        context = serve.get_replica_context()
        self.name = f"{context.replica_id.unique_id} (pid {os.getpid()})"

    def describe(self) -> tuple[Any, Any]:
        """The limits requests are checked against and the tokenizer (the ingress parses with them)."""
        return self.limits, self.scheduler.tokenizer

    async def generate(self, call: EngineCall) -> AsyncIterator[Event]:
        """`admitted` (naming this replica) or the refusal, then the job's events to its last."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            job = self.scheduler.submit(
                call.completion, lambda e: loop.call_soon_threadsafe(events.put_nowait, e), call.interval
            )
        except StaticrtError as err:
            yield Event("error", status=_status(err), message=str(err))
            return
        try:
            yield Event("admitted", message=self.name)
            while True:
                event = await events.get()
                yield event
                if event.kind != "token":
                    return
        finally:
            job.cancel()  # the client left, or the job is over (a no-op then)

    def __del__(self) -> None:  # Ray calls it once the replica's requests drained
        if hasattr(self, "scheduler"):  # not when `build` failed
            self.scheduler.stop()


def _status(err: StaticrtError) -> int:
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
        return {"status": "ok", "open_requests": len(self.open), "replicas": dict(self.seen)}

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
                    self.emit(Event("error", status=_status(refusal), message=str(refusal)))
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


# The ingress passes every request on at once; the engine's rows and Ray's queue bound them.
INGRESS_OPEN = 10_000
# Seconds a replica may take to answer Ray's health check (default 30) before it is replaced: a
# step holding the GIL on a loaded 2-core machine delays the answer, and a replacement costs a build.
HEALTH_CHECK_S = 60


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas, and what each holds: `rows` requests at once (its cache's rows), and
    `cpus`/`gpus` Ray reserves for it; `max_queue` requests wait for a row. With `max_replicas`
    above `replicas`, Ray scales between the two on `target_ongoing` requests a replica.

    Ray counts a request as queued until a replica has taken it, so a burst that arrives while
    rows are free is "queued" while it is routed (6 at once onto 4 free rows and a queue of 2 got
    a 429). Its limit is therefore `max_queue` plus every row: a burst from idle fills the rows and
    the queue, and under full load up to that many wait (`ray_queue`)."""

    replicas: int
    rows: int
    max_queue: int
    max_replicas: int | None = None
    target_ongoing: float | None = None
    cpus: float = 1.0
    gpus: float = 0.0
    drain_s: float = 30.0
    prefix_routing: bool = True

    @property
    def ray_queue(self) -> int:
        return self.max_queue + self.rows * max(self.replicas, self.max_replicas or 0)

    def engine_options(self) -> dict[str, Any]:
        from ray.serve.config import RequestRouterConfig

        options: dict[str, Any] = dict(
            name="StaticrtEngine",
            max_ongoing_requests=self.rows,
            max_queued_requests=self.ray_queue,
            ray_actor_options={"num_cpus": self.cpus, "num_gpus": self.gpus},
            graceful_shutdown_timeout_s=self.drain_s,
            health_check_timeout_s=HEALTH_CHECK_S,
        )
        if self.max_replicas is not None and self.max_replicas > self.replicas:
            target = self.target_ongoing or self.rows
            options["autoscaling_config"] = dict(
                min_replicas=self.replicas, max_replicas=self.max_replicas, target_ongoing_requests=target
            )
        else:
            options["num_replicas"] = self.replicas
        if self.prefix_routing:
            options["request_router_config"] = RequestRouterConfig(request_router_class=PREFIX_ROUTER)
        return options


def application(
    build: Callable[[], tuple[Any, Any]], plan: ReplicaPlan, api_key: str | None, stream_interval: int
) -> Any:
    """The Ray Serve application: the ingress over `plan`'s engine replicas, each running `build`."""
    engine = serve.deployment(Engine).options(**plan.engine_options()).bind(build)
    ingress = serve.deployment(Ingress).options(
        name="StaticrtIngress",
        max_ongoing_requests=INGRESS_OPEN,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=plan.drain_s + 5,
        health_check_timeout_s=HEALTH_CHECK_S,
    )
    return ingress.bind(engine, api_key, stream_interval)
