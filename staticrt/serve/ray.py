"""Replicas past one process: the scheduler as a Ray Serve deployment (`Engine`: one replica = one
cache's rows, `max_ongoing_requests` = rows), behind the same OpenAI app as `staticrt serve`
(`Ingress`, app.py), which reaches the replicas through a streaming handle (`Replicas`).

The handle call carries the prompt (`EngineCall.prompt`: its token ids as characters), so the
request router (ray_router.py: Ray's prefix-cache-affinity policy, kept in the ingress) sends a
request to the replica whose rows saw its prefix. Ray queues what no replica has a row for, up to `max_queued_requests`,
and refuses the rest (HTTP 429). Ray's controller replaces a replica that dies; what becomes of
the requests it held is ray_ingress.py's.

Imports Ray: only `staticrt serve --replicas` (the `ray` extra) imports this module.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from ..errors import StaticrtError
from .job import Event
from .ray_ingress import EngineCall, Ingress, refusal_status

PREFIX_ROUTER = "staticrt.serve.ray_router.PrefixRouter"  # Ray imports it in the ingress


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
            yield Event("error", status=refusal_status(err), message=str(err))
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
