"""A minute of mixed load on one server (issue 68's short form): clients that read whole answers,
read streams to their end, cancel streams mid-way, send and leave without reading, arrive in
bursts past the queue, send prompts near the end of the context and send garbage, greedy and
sampled. No answer is a 5xx, every stream read to its end ends with a finish reason, and at the
end every row and the queue are free, and the server holds no more threads (but for the event
loop's bounded executor) or file descriptors than after its first requests."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import staticrt

pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")

from serving import running  # noqa: E402

from staticrt.serve import serve_backend  # noqa: E402

MODEL, ROWS, QUEUE, CONTEXT = "tiny-llama", 4, 4, 128
SOAK_S, CLIENTS = 60.0, 8


# the event loop's default executor (asyncio.to_thread: the server parses bodies there) grows on
# demand to this many threads, its bound, named uvloop_N or asyncio_N
EXECUTOR = min(32, (os.cpu_count() or 1) + 4)


def _threads() -> tuple[int, int]:
    """This process's threads: (outside the loop's executor, in it)."""
    pool = sum(bool(re.fullmatch(r"(uvloop|asyncio)_\d+", t.name)) for t in threading.enumerate())
    return threading.active_count() - pool, pool


def _metric(url: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M).group(1))


def _body(rng: random.Random, long: bool = False) -> dict:
    prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(90, 120) if long else rng.randrange(1, 40))]
    body = dict(model=MODEL, prompt=prompt, max_tokens=rng.randrange(1, 8 if long else 24), temperature=0)
    if rng.random() < 0.4:
        body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1000))
    return body


def _whole(url: str, rng: random.Random) -> int:
    return httpx.post(f"{url}/v1/completions", json=_body(rng, long=rng.random() < 0.3), timeout=60).status_code


def _stream(url: str, rng: random.Random, cancel: bool) -> int:
    """A stream read to its `[DONE]` (its last chunk carries a finish reason), or left after its
    first chunk while it has the rest of the context to go."""
    body = _body(rng) | {"stream": True}
    if cancel:
        body["max_tokens"] = CONTEXT - len(body["prompt"])
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
        if reply.status_code != 200:
            return reply.status_code
        events = [line for line in reply.iter_lines() if line.startswith("data: ")][: 1 if cancel else None]
        if not cancel:
            assert events[-1] == "data: [DONE]" and '"finish_reason":"' in events[-2].replace(" ", ""), events[-3:]
        return 200


def _leave(url: str, rng: random.Random) -> int:
    """Sends a request and goes away without reading a byte of the answer."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**_body(rng), "stream": True}, timeout=60) as reply:
        return reply.status_code


def _burst(url: str, rng: random.Random) -> list[int]:
    with ThreadPoolExecutor(ROWS + QUEUE + 4) as pool:
        return list(pool.map(lambda _: _whole(url, random.Random(rng.random())), range(ROWS + QUEUE + 4)))


def _garbage(url: str, rng: random.Random) -> int:
    bodies = [b"{", b"[]", b'{"model": "tiny-llama", "prompt": "x"}', b'{"model": 3}', bytes(rng.randbytes(64))]
    return httpx.post(f"{url}/v1/completions", content=rng.choice(bodies), timeout=60).status_code


def _client(url: str, seed: int, deadline: float, statuses: Counter, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind = rng.choice(["whole", "whole", "stream", "cancel", "leave", "burst", "garbage"])
        if kind == "burst":
            got = _burst(url, rng)
        elif kind in ("stream", "cancel"):
            got = [_stream(url, rng, cancel=kind == "cancel")]
        else:
            got = [{"whole": _whole, "leave": _leave, "garbage": _garbage}[kind](url, rng)]
        with lock:
            statuses.update((kind, status) for status in got)


def test_a_minute_of_mixed_load_leaves_no_5xx_no_busy_row_and_no_growth():
    gen = staticrt.Generator(staticrt.load_model(MODEL), max_batch_size=ROWS, max_cache_len=CONTEXT)
    app, _ = serve_backend(gen.backend, name=MODEL, max_queue=QUEUE)
    with running(app) as url:
        _burst(url, random.Random(0))  # the server as it is once it has served
        threads, fds = _threads(), len(os.listdir("/proc/self/fd"))
        statuses: Counter = Counter()
        lock, deadline = threading.Lock(), time.monotonic() + SOAK_S
        with ThreadPoolExecutor(CLIENTS) as pool:
            for future in [pool.submit(_client, url, seed, deadline, statuses, lock) for seed in range(CLIENTS)]:
                future.result()
        assert not [key for key in statuses if key[1] >= 500], statuses
        assert statuses[("whole", 200)] and statuses[("stream", 200)] and statuses[("burst", 429)], statuses
        assert {status for (kind, status) in statuses if kind == "garbage"} == {400}, statuses
        settle = time.monotonic() + 30
        busy = lambda: (_metric(url, "staticrt_busy_rows"), _metric(url, "staticrt_queue_length"))  # noqa: E731
        while busy() != (0.0, 0.0) and time.monotonic() < settle:
            time.sleep(0.1)
        assert busy() == (0.0, 0.0)
        assert statuses[("cancel", 200)] and _metric(url, 'staticrt_requests_finished_total{outcome="cancelled"}')
        now = (_threads(), len(os.listdir("/proc/self/fd")))
        assert now[0][0] <= threads[0] and now[0][1] <= EXECUTOR and now[1] <= fds + 8, (now, threads, fds)
