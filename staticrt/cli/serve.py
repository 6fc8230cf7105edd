"""`staticrt serve`: an OpenAI-compatible server over a model or an artifact, its requests batched
continuously in the rows of one fixed-shape cache."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import ConfigError
from .console import console
from .session import bind, open_source, speculation

API_KEY_ENV = "STATICRT_API_KEY"


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else STATICRT_API_KEY, else None (no key); an empty one is refused by name, since
    it would silently leave the server open."""
    named, key = ("--api-key", args.api_key) if args.api_key is not None else (API_KEY_ENV, os.environ.get(API_KEY_ENV))
    if key is not None and not key.strip():
        raise ConfigError(
            f"{named} is empty, which would leave the server open to anyone; set a key, or unset it for a "
            "server without one"
        )
    return key


def build_server(args: argparse.Namespace) -> tuple[Any, Any]:
    """The app and its scheduler over --model or the artifact."""
    from ..serve.app import create_app

    key = api_key(args)
    scheduler, limits = build_scheduler(args)
    return create_app(scheduler, limits, api_key=key, stream_interval=args.stream_interval), scheduler


def build_scheduler(args: argparse.Namespace) -> tuple[Any, Any]:
    """The scheduler over --model or the artifact, every graph built, and its requests' limits:
    what `staticrt serve` and each Ray replica (`--replicas`) run."""
    from ..serve import schedule_backend

    source = open_source(args)
    backend = bind(source, args, args.max_batch_size, None, args.prefill_buckets).backend
    # a model prefills each prompt alone in a batch-1 twin of the cache; an artifact has one batch size
    prefiller = None if source.artifact is not None else bind(source, args, 1, None, args.prefill_buckets).backend
    return schedule_backend(
        backend,
        source.tokenizer,
        args.served_model_name or os.path.basename(os.path.normpath(source.name)),
        source.defaults,
        args.max_queue,
        prefiller,
        not args.no_prefix_reuse,
        speculation(args, backend),
        args.cache_ram,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serve import run_server

    app, scheduler = build_server(args)
    if args.warmup_only:
        console.print("every graph the server needs is built; the compile cache holds them (staticrt cache list)")
        return 0
    console.print(banner(args, scheduler.backend), soft_wrap=True)
    run_server(app, scheduler, args.host, args.port, args.drain_timeout)
    return 0


def banner(args: argparse.Namespace, backend: Any) -> str:
    """The line a server starts with: where it listens and the shapes it runs. An ONNX graph takes
    a prompt of any width (its one "bucket" is the longest sequence), so it lists no buckets."""
    prompts = (
        f"prompts of any length up to {backend.buckets[-1]}"
        if backend.name == "onnx"
        else f"prefill buckets {list(backend.buckets)}"
    )
    return (
        f"serving {args.served_model_name or args.artifact or args.model} on http://{args.host}:{args.port}/v1 "
        f"({backend.name}, {backend.batch_size} rows of {backend.max_cache_len} positions, {prompts}); "
        "Ctrl-C or SIGTERM drains and stops"
    )
