"""Serving: the rows of one cache as slots (scheduler.py), OpenAI's HTTP API over them (app.py,
protocol.py), Prometheus metrics (metrics.py). Needs the `serve` extra (FastAPI, uvicorn,
prometheus_client); imports no torch, so an ONNX artifact serves without it."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import GenerationError
from ..generation.builds import counting
from ..generation.speculative import Speculation, check_drafter, check_verifies
from ..text.generation_config import GenerationDefaults
from .http_limits import protocol_class


def serve_backend(
    backend: Any,
    tokenizer: Any = None,
    name: str = "model",
    defaults: GenerationDefaults | None = None,
    max_queue: int = 64,
    api_key: str | None = None,
    prefiller: Any = None,
    stream_interval: int = 1,
    reuse_prefix: bool = True,
    speculative: Any = None,
    cache_ram_mb: float = 0,
) -> tuple[Any, Any]:
    """The app serving `backend` (a Generator's `.backend`) as model `name`, and its scheduler
    (`schedule_backend` says what the other arguments do)."""
    scheduler, limits = schedule_backend(
        backend, tokenizer, name, defaults, max_queue, prefiller, reuse_prefix, speculative, cache_ram_mb
    )
    from .app import create_app

    return create_app(scheduler, limits, api_key=api_key, stream_interval=stream_interval), scheduler


def _warn_of_the_longrope_switch(restart: int | None) -> None:
    """generation/prefill.py: a generation computes a row again from position 0 at LongRoPE's
    switch, as transformers does; a server's rows do not, and the log says so."""
    if restart is not None:
        logging.getLogger("staticrt").warning(
            "this model's LongRoPE switches to its long factors at position %d; a request that runs past it "
            "keeps what its row wrote before with the short ones (as vLLM does), where transformers computes "
            "the sequence again from position 0: its tokens past %d may differ from transformers'",
            restart,
            restart,
        )


def schedule_backend(
    backend: Any,
    tokenizer: Any = None,
    name: str = "model",
    defaults: GenerationDefaults | None = None,
    max_queue: int = 64,
    prefiller: Any = None,
    reuse_prefix: bool = True,
    speculative: Any = None,
    cache_ram_mb: float = 0,
) -> tuple[Any, Any]:
    """A scheduler over `backend`'s rows with every graph it needs built, and the limits its
    requests are checked against: what a server (`serve_backend`) or a Ray replica (ray.py) runs.
    `prefiller`: a batch-1 backend over the same model and cache layout (a model backend's, built
    like `backend`), which prefills each prompt alone; without it prompts prefill in `backend`.
    `reuse_prefix`: a request keeps the prefix its row holds (rows.py) and prefills the rest from
    there, in chunks of the prefiller's continuing graphs up to REUSE_WIDTH (`reuse_widths`).
    `cache_ram_mb`: a host pool of that many MB (0: none) keeps the rows new requests overwrite
    and restores one where a prompt continues it (rows.py; a model backend or a torch artifact).
    `speculative` ("ngram[:K]", or a draft model's Speculation): rows verify drafted tokens, greedy
    ones keeping what the argmax agrees with, sampled ones by speculative sampling's rule (planning.py).
    Every graph is built first (announced in the log): no request waits for a compile."""
    try:
        from . import app  # noqa: F401  (FastAPI: the extra is whole before anything is built)
        from .planning import Drafting
        from .protocol import Limits
        from .scheduler import Scheduler
    except ImportError as err:
        raise GenerationError(
            f"serving needs the serve extra ({err.name} is missing): pip install 'staticrt[serve]'"
        ) from None
    defaults = defaults or GenerationDefaults()
    drafting = None if speculative is None else Drafting(Speculation.parse(speculative))
    if drafting is not None:
        check_verifies(backend)
        if drafting.spec.drafter is not None:  # its row r drafts for our row r
            check_drafter(backend, drafting.spec.drafter.backend, backend.batch_size)
    narrow = narrow_backends(backend) if prefiller is not None and drafting is None else ()  # verify steps: all rows
    plan = _graph_plan(backend, prefiller, reuse_prefix, None if drafting is None else drafting.spec, narrow)
    graphs = {(id(b), key) for b, widths, how in plan for key in b.unbuilt(widths, **how)}
    with counting(len(graphs)):  # "graph 3 of 16"
        for b, widths, how in plan:
            b.prepare(widths, **how)
    _warn_of_the_longrope_switch(backend.rope_restart)
    limits = Limits(
        name, backend.max_sequence_len, backend.vocab_size, backend.eos_token_ids, defaults, backend.batch_size
    )
    widest = None if prefiller is None else max(reuse_widths(prefiller))  # an artifact's programs take both
    scheduler = Scheduler(
        backend,
        tokenizer,
        max_queue,
        prefiller=prefiller,
        reuse_prefix=reuse_prefix,
        widest=widest,
        drafting=drafting,
        cache_ram_bytes=int(cache_ram_mb * 2**20),
        narrow=narrow,
    )
    return scheduler, limits


def narrow_backends(backend: Any) -> tuple[Any, ...]:
    """Twins of a model backend over its first 2, 4, ... rows (fewer than all; the same cache
    storage, `EagerBackend.narrowed`): with fewer clients than rows, a decode step computes the rows
    that are busy, not all (SmolLM2 int4 on 8 rows, 4 clients: 104 -> 149 tok/s, docs/measurements.md).
    Requests take free rows within the narrowest twin that holds the busy ones and them (rows.py)."""
    if not hasattr(backend, "narrowed"):
        return ()  # an artifact: its programs have one batch size
    widths = [2**k for k in range(1, backend.batch_size.bit_length()) if 2**k < backend.batch_size]
    return tuple(twin for twin in map(backend.narrowed, widths) if twin is not None)


def _graph_plan(
    backend: Any, prefiller: Any, reuse_prefix: bool, spec: Speculation | None, narrow: tuple[Any, ...] = ()
) -> list[tuple[Any, tuple[int, ...], dict[str, Any]]]:
    """Every graph serving needs, as (backend, widths, how to build them); the `narrow` twins'
    decode steps; with speculation (`spec`), the verify steps (greedy, and sampling for a step where
    a row samples) and a draft model's: its decode step and the prefill of a row's rest, from 0 or
    continuing what it holds."""
    plan = []
    for do_sample in (False, True):
        plan += [(twin, (1,), {"do_sample": do_sample}) for twin in narrow]
        if prefiller is None:
            plan.append((backend, (*backend.buckets, 1), {"do_sample": do_sample, "continuing": True}))
        else:
            plan.append((backend, (1,), {"do_sample": do_sample}))
            plan.append((prefiller, (*prefiller.buckets, 1), {"do_sample": do_sample}))  # 1: a row decoding alone
            widths = {*chunk_widths(prefiller), *(reuse_widths(prefiller) if reuse_prefix else ())}
            plan.append((prefiller, tuple(sorted(widths)), {"do_sample": do_sample, "continuing": True}))
        if spec is not None:
            verify = {"do_sample": do_sample, "continuing": True, "fresh": False, "verify": True}
            plan.append((backend, (spec.k + 1,), verify))
    if spec is not None and spec.drafter is not None:
        drafter = spec.drafter.backend
        plan.append((drafter, (*drafter.buckets, 1), {"do_sample": False, "continuing": True}))
    return plan


# The widest step that continues a kept prefix in a model's prefiller (a longer rest goes in chunks
# of it). A chat turn or a question after a shared system prompt is tens of tokens, and each width
# is a graph to build at start-up (SmolLM2's default buckets: 4 more graphs, not 6).
REUSE_WIDTH = 128


def reuse_widths(prefiller: Any) -> tuple[int, ...]:
    """The prefiller's buckets that continue a kept prefix: up to REUSE_WIDTH (at least the smallest)."""
    return tuple(w for w in prefiller.buckets if w <= REUSE_WIDTH) or prefiller.buckets[:1]


def chunk_widths(prefiller: Any) -> tuple[int, ...]:
    """The buckets a prompt's later chunks can take in a batch-1 prefiller: a chunk after the
    first starts at a multiple of the largest bucket, so only a bucket that fits after one does.
    Where the largest bucket spans the context, no prompt is chunked and no continuing graph is
    built (SmolLM2 served with 512 positions: 10 of 24 graphs, 139 of the 500 s start-up)."""
    limit, largest = prefiller.max_sequence_len, prefiller.buckets[-1]
    return tuple(w for w in prefiller.buckets if limit is None or largest + w <= limit)


# Seconds uvicorn waits past the drain for the answers it ended (503, or an error event and
# [DONE]) to reach their clients, before it cancels what is still open.
SEND_GRACE_S = 5.0


def run_server(app: Any, scheduler: Any, host: str, port: int, drain_s: float, log_level: str = "info") -> None:
    """Serve `app` until SIGINT or SIGTERM; then admit nothing new, let open requests finish for up
    to `drain_s` seconds, and stop (requests still running then end with 503). The scheduler
    steps in this thread, the one that loaded and compiled the model (scheduler.py says why);
    uvicorn serves from another, and the signals are caught here and re-raised once drained."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                scheduler.refuse_new()  # at once: the drain thread below may start after a request
                logging.getLogger("staticrt").info("stopping: no new requests; open ones have %g s to finish", drain_s)
                threading.Thread(target=scheduler.stop, args=(drain_s,), name="staticrt-drain", daemon=True).start()
            super().handle_exit(sig, frame)

    grace = drain_s + SEND_GRACE_S
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=grace, log_level=log_level, http=protocol_class()
    )
    server = Draining(config)

    def serve_http() -> None:
        try:
            server.run()
        finally:
            scheduler.stop()  # the stepping loop below returns

    http = threading.Thread(target=serve_http, name="staticrt-http", daemon=True)
    with server.capture_signals():
        scheduler.run(ready=http.start)
        http.join()
    if not server.started:
        raise GenerationError(f"could not serve on {host}:{port} (uvicorn's message is above); choose another --port")


@contextmanager
def serving_on_loopback(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a free 127.0.0.1 port, in a thread of this process (tests,
    `bench-serve`); yields its base URL and stops the server on leaving."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol_class()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
