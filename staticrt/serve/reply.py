"""OpenAI's response objects and stream chunks for one request, built from the scheduler's events
(answers.py): each choice also carries `token_ids` (the ids behind its text, as vLLM's
`return_token_ids`), so a client can check tokens without a tokenizer."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..generation.logprobs import TokenLogprob
from ..text.tool_calls import ToolCall
from .logprob_fields import LogprobWriter


class Reply:
    """The response object, or its stream chunks, for one request; `tokenizer` writes the tokens
    of its log-probabilities (logprob_fields.py)."""

    def __init__(self, model: str, chat: bool, tokenizer: Any = None) -> None:
        self.model, self.chat, self.tokenizer = model, chat, tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.writers: dict[int, LogprobWriter] = {}  # a choice's, by its index

    def _head(
        self, index: int, finish_reason: str | None, tokens: list[int], entries: Sequence[TokenLogprob] | None
    ) -> dict[str, Any]:
        """What every choice and chunk holds: its `logprobs` object of `entries`, None where the
        request asked for none."""
        writer = None if entries is None else self.writers.setdefault(index, LogprobWriter(self.tokenizer, self.chat))
        logprobs = None if writer is None else writer.write(entries)
        return {"index": index, "finish_reason": finish_reason, "token_ids": tokens, "logprobs": logprobs}

    def _wrap(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def choice(
        self,
        index: int,
        text: str | None,
        tokens: list[int],
        finish_reason: str,
        calls: Sequence[ToolCall] = (),
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> dict:
        """One choice of a whole answer; `calls`: the tool calls read out of it (`text` then what is
        left, None if nothing); `logprobs`: its tokens' entries, where asked."""
        choice = self._head(index, finish_reason, tokens, logprobs)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if calls:
                choice["message"]["tool_calls"] = [_call(c) for c in calls]
        else:
            choice["text"] = text
        return choice

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return self._wrap(self.object, choices, usage=usage)

    def chunk(
        self,
        text: str | None,
        tokens: list[int],
        finish_reason: str | None = None,
        first: bool = False,
        calls: Sequence[ToolCall] = (),
        index: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> dict:
        choice = self._head(index, finish_reason, tokens, logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if calls:  # each call whole in one delta, as vLLM sends a call it read at the end
                delta["tool_calls"] = [{"index": i, **_call(c)} for i, c in enumerate(calls)]
            choice["delta"] = delta
            return self._wrap("chat.completion.chunk", [choice])
        choice["text"] = text or ""
        return self._wrap("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)


def _call(call: ToolCall) -> dict:
    """A tool call in OpenAI's shape, with an id a `role: tool` answer names it by."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": dataclasses.asdict(call)}
