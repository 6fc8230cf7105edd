"""The soak's clients (soak.py runs them): what each sends to the server and how it reads the
answer: whole answers, streams read to their end, streams cancelled mid-way, requests left
unread, bursts past the queue, prompts near the end of the context and garbage, greedy and
sampled, every answer's status counted and the streams' latencies kept for the next sample.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("whole", "whole", "stream", "cancel", "leave", "burst", "garbage")
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0  # the openai client's first and longest pause between retries


@dataclass
class SoakLoad:
    """What the clients send to the server at `url`: token-id prompts in `vocab`, up to `context`
    positions, to a server of `rows` rows and a queue of `queue`; the long prompts end within 30
    tokens of `longest`, the longest it admits (default: 10 short of the context)."""

    url: str
    model: str
    vocab: int
    rows: int
    queue: int
    context: int
    longest: int | None = None
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    failures: Counter = field(default_factory=Counter)  # status 0's httpx exception -> count
    ttft_s: list[float] = field(default_factory=list)  # since the last sample
    itl_s: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)  # when each whole answer or stream came whole (monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _http: Any = None  # one httpx.Client for every simulated client (`http`)

    @property
    def http(self) -> Any:
        """The load's one httpx.Client, made on first use: `httpx.post` makes a client a request,
        34 ms of CPU each (its SSL context), and the load took 1.75 of 2 cores from the server it
        measured. Connections are pooled without a bound, as many as the clients and bursts hold."""
        import httpx

        with self.lock:
            if self._http is None:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
                self._http = httpx.Client(base_url=self.url, timeout=120, limits=limits)
            return self._http

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def body(self, rng: random.Random, long: bool = False) -> dict:
        longest = self.longest or self.context - 10
        size = rng.randrange(longest - 30, longest + 1) if long else rng.randrange(1, 40)
        prompt = [rng.randrange(3, self.vocab) for _ in range(size)]
        body = dict(model=self.model, prompt=prompt, max_tokens=rng.randrange(1, 8 if long else 24), temperature=0)
        if rng.random() < 0.4:
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1000))
        return body

    def whole(self, rng: random.Random) -> int:
        body = self.body(rng, long=rng.random() < 0.3)
        status = self.http.post("/v1/completions", json=body).status_code
        if status == 200:
            self._answered()
        return status

    def _answered(self) -> None:
        with self.lock:
            self.answered_at.append(time.monotonic())

    def stream(self, rng: random.Random, cancel: bool) -> int:
        """A stream read to its `[DONE]` (timed; its last chunk must carry a finish reason), or
        left after its first chunk while it has the rest of the context to go. One that ends in an
        error event (a replica that died after streaming) counts as 502, one that ends without
        either as 599."""
        body = self.body(rng) | {"stream": True}
        if cancel:
            body["max_tokens"] = self.context - len(body["prompt"])
        start, times, events = time.perf_counter(), [], []
        with self.http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return reply.status_code
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    times.append(time.perf_counter())
                    if cancel:
                        return 200
        if len(events) > 1 and events[-1] == "data: [DONE]" and events[-2].startswith('data: {"error"'):
            return 502  # ended by a named error: the stream was lost, not left hanging
        if events[-1] != "data: [DONE]" or '"finish_reason":"' not in events[-2].replace(" ", ""):
            return 599  # a stream that ended without its finish: counted as a server error
        self._answered()
        with self.lock:
            self.ttft_s.append(times[0] - start)
            self.itl_s.extend(np.diff(times[:-2]).tolist())  # between token chunks, not to the finish
        return 200

    def leave(self, rng: random.Random) -> int:
        """Sends a request and goes away without reading a byte of the answer."""
        body = {**self.body(rng), "stream": True}
        with self.http.stream("POST", "/v1/completions", json=body) as reply:
            return reply.status_code

    def burst(self, rng: random.Random) -> list[int]:
        size = self.rows + self.queue + 4
        with ThreadPoolExecutor(size) as pool:
            return list(pool.map(lambda _: self.whole(random.Random(rng.random())), range(size)))

    def garbage(self, rng: random.Random) -> int:
        bodies = [b"{", b"[]", b'{"model": "%s", "prompt": "x"}' % self.model.encode(), b'{"model": 3}']
        body = rng.choice([*bodies, bytes(rng.randbytes(64))])
        return self.http.post("/v1/completions", content=body).status_code

    def client(self, seed: int, deadline: float) -> None:
        """Requests until `deadline`; one the server does not answer within 120 s (or whose
        connection fails) counts as status 0, "no answer", and the client goes on. After a 429 a
        client backs off as the `openai` client does (0.5 s doubling to 8 s, jittered): 32 clients
        retrying at once sent ~1,800 requests a minute that only took CPU from the rows."""
        import httpx

        rng, refused = random.Random(seed), 0
        while time.monotonic() < deadline:
            if refused:
                pause = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (refused - 1)) * rng.uniform(0.75, 1.0)
                if time.monotonic() + pause >= deadline:
                    return
                time.sleep(pause)
            kind = rng.choice(KINDS)
            try:
                if kind == "burst":
                    got = self.burst(rng)
                elif kind in ("stream", "cancel"):
                    got = [self.stream(rng, cancel=kind == "cancel")]
                else:
                    got = [{"whole": self.whole, "leave": self.leave, "garbage": self.garbage}[kind](rng)]
            except httpx.HTTPError as err:  # what it was tells a hang (ReadTimeout) from a cut connection
                got = [0]
                with self.lock:
                    self.failures[type(err).__name__] += 1
            with self.lock:
                self.statuses.update((kind, status) for status in got)
            refused = refused + 1 if 429 in got else 0
