"""A bounded load on an OpenAI-compatible server on loopback: a fixed list of streamed
`/v1/completions` requests (mixed prompt and output lengths) sent by `concurrency` clients at
once, stopped at a duration cap; what each request saw, and the figures a serving benchmark
reports (output tokens/s, time to first token and inter-token latency, p50 and p99).

Any server that speaks OpenAI's streamed completions is measured the same way: a token chunk is
one whose choice has no `finish_reason`; TTFT is the time to the first, ITL the gaps between the
next ones (between chunks, as vLLM's `bench serve` counts it, whatever a chunk holds), TPOT a
request's time after its first token over the tokens after it; tokens are counted from `usage`
(or the chunks' `token_ids`, else one a chunk, where a server sends none).

The chat workload (`chat_workload`, `run_chat_load`) is a client a conversation: every client
sends its turns one after another, each prompt the shared system prompt and the conversation so
far with the answers as the server streamed them, the way a chat front end calls a completions
API; what a server keeps of a prompt it saw before is what it saves.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import numpy as np

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int
    response_format: dict | None = None  # OpenAI's, sent as it is


@dataclass
class Record:
    """One request as its client saw it (seconds from its own send)."""

    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    last: float = 0.0  # the last token chunk's time
    error: str | None = None
    text: str = ""  # the answer's text, as streamed
    cached: int = 0  # prompt tokens the server kept from an earlier request (usage's cached_tokens)


def workload(
    tokenizer: Any, vocab_size: int, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[LoadRequest]:
    """`count` requests with prompt lengths (tokens) and max_tokens drawn uniformly from the
    ranges; a prompt is the text of random token ids, so every server tokenizes the same text."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(count):
        ids = rng.integers(0, vocab_size, size=int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
        requests.append(LoadRequest(tokenizer.decode(ids), int(rng.integers(output_range[0], output_range[1] + 1))))
    return requests


def chat_workload(
    tokenizer: Any,
    vocab_size: int,
    clients: int,
    turns: int,
    system_len: int,
    user_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> tuple[str, list[list[LoadRequest]]]:
    """A system prompt of `system_len` random tokens' text, and for each of `clients` a
    conversation of `turns` user turns (lengths and max_tokens drawn from the ranges): each
    request's `prompt` is the turn's own text, which the client adds to its conversation."""
    rng = np.random.default_rng(seed)
    text = lambda n: tokenizer.decode(rng.integers(0, vocab_size, size=n).tolist())  # noqa: E731
    system = text(system_len)
    conversations = [
        [
            LoadRequest(
                text(int(rng.integers(user_range[0], user_range[1] + 1))),
                int(rng.integers(output_range[0], output_range[1] + 1)),
            )
            for _ in range(turns)
        ]
        for _ in range(clients)
    ]
    return system, conversations


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"the load generator only targets loopback servers; {url} is on {host}")


async def _one(client: Any, url: str, model: str, request: LoadRequest) -> Record:
    record = Record()
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.response_format is not None:
        body["response_format"] = request.response_format
    start = last = time.perf_counter()
    chunks = 0
    try:
        reply = await _sent(client, f"{url}/v1/completions", body)
        try:
            if reply.status_code != 200:
                record.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.tokens = int(chunk["usage"]["completion_tokens"])
                    record.cached = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                choices = chunk.get("choices") or []
                if choices:
                    record.text += choices[0].get("text") or ""
                if choices and choices[0].get("finish_reason") is None:
                    if record.ttft is None:
                        record.ttft = now - start
                    else:
                        record.gaps.append(now - last)
                    last, chunks = now, chunks + len(choices[0].get("token_ids") or [0])
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
        finally:
            await reply.aclose()
    except Exception as err:  # a failed request is a result too, reported with the rest
        record.error = f"{type(err).__name__}: {err}"
    record.tokens, record.last = record.tokens or chunks, last - start
    return record


# A kept-alive connection the server closed as the request went out on it has no answer (httpx:
# "Server disconnected without sending a response"; llama-server did so to 5 of 64 requests from 16
# clients): sent again, as the `openai` client sends again on a connection error (twice by default).
CONNECTION_RETRIES = 2


async def _sent(client: Any, url: str, body: dict) -> Any:
    """The response to the POST of `body`, its body still to read (the caller closes it); sent
    again where the connection failed before any answer."""
    import httpx

    failed = 0
    while True:
        try:
            return await client.send(client.build_request("POST", url, json=body), stream=True)
        except (httpx.RemoteProtocolError, httpx.ConnectError):
            failed += 1
            if failed > CONNECTION_RETRIES:
                raise


async def _load(
    url: str, model: str, requests: list[LoadRequest], concurrency: int, duration_s: float
) -> tuple[list[Record], float]:
    import httpx

    pending = list(reversed(requests))
    records: list[Record] = []
    start = time.perf_counter()
    deadline = start + duration_s

    async def client_loop(client: Any) -> None:
        while pending and time.perf_counter() < deadline:
            records.append(await _one(client, url, model, pending.pop()))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + 60), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return records, time.perf_counter() - start


async def _chat_load(
    url: str, model: str, system: str, conversations: list[list[LoadRequest]], duration_s: float
) -> tuple[list[Record], float]:
    import httpx

    records: list[Record] = []
    start = time.perf_counter()
    deadline = start + duration_s

    async def client_loop(client: Any, turns: list[LoadRequest]) -> None:
        conversation = system
        for turn in turns:
            if time.perf_counter() >= deadline:
                return
            conversation += turn.prompt
            record = await _one(client, url, model, LoadRequest(conversation, turn.max_tokens))
            records.append(record)
            if record.error is not None:
                return
            conversation += record.text

    limits = httpx.Limits(max_connections=len(conversations))
    async with httpx.AsyncClient(timeout=httpx.Timeout(duration_s + 60), limits=limits) as client:
        await asyncio.gather(*(client_loop(client, turns) for turns in conversations))
    return records, time.perf_counter() - start


def run_chat_load(
    url: str, model: str, system: str, conversations: list[list[LoadRequest]], duration_s: float
) -> dict[str, Any]:
    """Each conversation of `chat_workload` from its own client, all at once; no turn starts after
    `duration_s`. The summary (`summary`), with the prompt tokens the server said it kept."""
    check_loopback(url)
    records, wall = asyncio.run(_chat_load(url, model, system, conversations, duration_s))
    report = summary(records, wall, sum(map(len, conversations)))
    report["cached_prompt_tokens"] = sum(r.cached for r in records if r.error is None)
    return report


def run_load(url: str, model: str, requests: list[LoadRequest], concurrency: int, duration_s: float) -> dict[str, Any]:
    """Send `requests` to the server at `url` from `concurrency` clients; no request starts after
    `duration_s`. Returns the summary (`summary`)."""
    check_loopback(url)
    records, wall = asyncio.run(_load(url, model, requests, concurrency, duration_s))
    return summary(records, wall, len(requests))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": 1e3 * float(np.percentile(values, 50)), "p99_ms": 1e3 * float(np.percentile(values, 99))}


def summary(records: list[Record], wall_s: float, sent_of: int) -> dict[str, Any]:
    done = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in done)
    return {
        "requests": len(records),
        "requests_planned": sent_of,
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft": percentiles([r.ttft for r in done if r.ttft is not None]),
        "itl": percentiles([g for r in done for g in r.gaps]),
        "tpot": percentiles([(r.last - r.ttft) / (r.tokens - 1) for r in done if r.ttft is not None and r.tokens > 1]),
    }
