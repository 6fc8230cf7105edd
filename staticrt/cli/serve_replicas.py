"""`staticrt serve --replicas N`: the server as a Ray Serve application (serve/ray.py) on a local
Ray instance, or on a running cluster with --ray-address; Ctrl-C or SIGTERM drains and stops it."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .console import console
from .serve import api_key, build_scheduler

APP = "staticrt"
# Ray's controller kills an HTTP proxy that is not ready in 5 s (or misses health checks of 10 s),
# and `serve.start` then fails: on 2 cores with two busy loops beside it the proxy took longer.
PATIENT_RAY = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")
PATIENT_RAY_S = 60


def replica_plan(args: argparse.Namespace) -> Any:
    """The replicas the command line asks for, checked before Ray starts."""
    from ..serve.ray import ReplicaPlan

    if args.warmup_only:
        raise ConfigError(
            "--warmup-only builds the compile cache in this process: run it without --replicas, then start the replicas"
        )
    if args.max_queue < 1:
        raise ConfigError("Ray queues at least one request for a replica's rows: pass --max-queue 1 or more")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise ConfigError(
            f"--max-replicas {args.max_replicas} is below --replicas {args.replicas}, the least Ray keeps; "
            "raise it, or leave it out for a fixed count"
        )
    return ReplicaPlan(
        replicas=args.replicas,
        rows=rows(args),
        max_queue=args.max_queue,
        max_replicas=args.max_replicas,
        target_ongoing=args.target_ongoing_requests,
        cpus=args.replica_cpus,
        gpus=args.replica_gpus,
        drain_s=args.drain_timeout,
        prefix_routing=not args.no_prefix_reuse,
    )


def rows(args: argparse.Namespace) -> int:
    """A replica's rows: --max-batch-size, or the batch size an artifact was exported with."""
    if args.artifact is None:
        return args.max_batch_size
    from ..artifacts.manifest import field, read_manifest

    return int(field(read_manifest(Path(args.artifact), verify=False), "cache.max_batch_size"))


def cmd_serve_replicas(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve

        from ..serve.ray import application
    except ImportError as err:
        missing = f"--replicas needs the ray extra ({err.name} is missing)"
        raise ConfigError(f"{missing}: pip install 'staticrt[ray]'") from None
    args.replicas = args.replicas or 1  # --ray-address alone: one replica on that cluster
    key, plan = api_key(args), replica_plan(args)
    if args.threads is None:  # each replica's torch or ONNX Runtime on the cores Ray gives it
        args.threads = max(1, int(plan.cpus))
    app = application(functools.partial(build_scheduler, args), plan, key, args.stream_interval)
    for name in PATIENT_RAY:  # a local instance's processes inherit them; a cluster keeps its own
        os.environ.setdefault(name, str(PATIENT_RAY_S))
    # "local": an instance of this command's own, never one another process left running here
    ray.init(address=args.ray_address or "local", include_dashboard=False, namespace=APP, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        started = True
        console.print(f"starting {plan.replicas} replicas on Ray (each builds its graphs before it is healthy) ...")
        serve.run(app, name=APP, route_prefix="/")
        console.print(banner(args, plan), soft_wrap=True)
        while not stop.wait(0.5):
            pass
        console.print(f"stopping: open requests have {args.drain_timeout} s to finish")
    finally:  # where serve.start failed there is nothing to delete, and its error is the one to see
        if started:
            serve.delete(APP)  # Ray waits for each replica's open requests, up to graceful_shutdown_timeout_s
        if started and args.ray_address is None:  # the local instance this command started
            serve.shutdown()
        ray.shutdown()
    return 0


def banner(args: argparse.Namespace, plan: Any) -> str:
    scaling = f"{plan.replicas} to {plan.max_replicas}" if plan.max_replicas else f"{plan.replicas}"
    where = f"Ray at {args.ray_address}" if args.ray_address else "a local Ray instance"
    return (
        f"serving {args.served_model_name or args.artifact or args.model} on http://{args.host}:{args.port}/v1: "
        f"{scaling} replicas of {plan.rows} rows on {where} ({plan.cpus:g} CPUs, {plan.gpus:g} GPUs, "
        f"{args.threads} threads each; {plan.max_queue} requests queue for a row, and Ray holds up to "
        f"{plan.ray_queue} while it routes them); Ctrl-C or SIGTERM drains and stops"
    )
