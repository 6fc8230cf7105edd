"""A request's answer from its jobs' events: one job a choice (`n` of them), each event tagged with
its choice's index; whole (one JSON body when every choice has ended) or as server-sent events.
With tools, each choice's text is read for calls (tools.py, text/tool_calls.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from ..text.tool_calls import ToolCallStream
from .job import Event
from .protocol import error_body
from .reply import Reply
from .tools import Tools

Tagged = tuple[int, Event]  # (the choice's index, what its job said)


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    kind = "server_error" if status >= 500 else kind
    return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


class Choices(list):
    """The jobs of one request, choice i at index i; cancelled together (a client gone, an error)."""

    def cancel(self) -> None:
        for job in self:
            job.cancel()


def usage_of(usages: list[dict]) -> dict:
    """One request's usage from its choices': the prompt counted once, as OpenAI counts it, the
    completions summed; cached_tokens the most any choice's row kept."""
    prompt, made = usages[0]["prompt_tokens"], sum(u["completion_tokens"] for u in usages)
    cached = max(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": made,
        "total_tokens": prompt + made,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def whole(events: asyncio.Queue[Tagged], n: int, reply: Reply, tools: Tools | None) -> Response:
    texts: list[list[str]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list | None] = [None] * n  # a choice's entries, where asked
    choices: list[dict | None] = [None] * n
    usages = []
    while any(c is None for c in choices):
        i, event = await events.get()
        if event.kind == "error":
            return error_response(event.status, event.message)
        if event.kind == "token":
            texts[i].append(event.text)
            tokens[i].extend(event.tokens)
            if event.logprobs is not None:
                logprobs[i] = (logprobs[i] or []) + event.logprobs
            continue
        content, calls = ("".join(texts[i]), []) if tools is None else tools.read("".join(texts[i]))
        finish = "tool_calls" if calls else event.finish_reason
        choices[i] = reply.choice(i, content, tokens[i], finish, calls, logprobs[i])
        usages.append(event.usage)
    return JSONResponse(reply.whole(choices, usage_of(usages)))


async def stream(
    jobs: Choices, events: asyncio.Queue[Tagged], reply: Reply, include_usage: bool, tools: Tools | None
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, each choice's by its index, then `[DONE]`;
    leaving early cancels every choice. With tools, text that may be a call is held until its
    choice ends (`ToolCallStream`)."""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    readers = [None if tools is None else ToolCallStream(tools.names) for _ in jobs]
    usages: list[dict] = []
    try:
        if reply.chat:
            for i in range(len(jobs)):
                yield sse(reply.chunk("", [], first=True, index=i))
        while len(usages) < len(jobs):
            i, event = await events.get()
            reader = readers[i]
            if event.kind == "token":
                text = event.text if reader is None else reader.push(event.text)
                yield sse(reply.chunk(text, event.tokens, index=i, logprobs=event.logprobs))
            elif event.kind == "error":
                yield sse(error_body(event.message, "server_error"))
                break
            else:
                rest, found = ("", []) if reader is None else reader.finish()
                found = found if tools is None else tools.kept(found)
                if rest or found:
                    yield sse(reply.chunk(rest or None, [], calls=found, index=i))
                finish = "tool_calls" if found else event.finish_reason
                yield sse(reply.chunk(None if reply.chat else "", [], finish, index=i))
                usages.append(event.usage)
        if include_usage and len(usages) == len(jobs):
            yield sse(reply.usage_chunk(usage_of(usages)))
        yield "data: [DONE]\n\n"
    finally:
        jobs.cancel()  # a no-op for the choices that have finished
