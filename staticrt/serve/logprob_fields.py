"""OpenAI's `logprobs` and `top_logprobs` read from a request body (how many top tokens a choice
wants beside each chosen one; None where it wants none), their OpenAPI schema, and a choice's or a
chunk's `logprobs` object in each endpoint's shape from the scheduler's entries
(generation/logprobs.py: the model's log-softmax, as vLLM's default).

Chat takes `logprobs: true` and `top_logprobs` 0-20, and answers `{"content": [{token, logprob,
bytes, top_logprobs: [...]}]}`; completions take `logprobs` 0-20 (OpenAI's own limit is 5, vLLM's
and ours the 20 a step returns) and answer the legacy `{tokens, token_logprobs, top_logprobs,
text_offset}`. A token's text is the tokenizer's decoding of it alone, so a byte-level token that
holds part of a UTF-8 character reads as U+FFFD (`bytes` then encodes that); without a tokenizer a
token is written `token_id:<id>`, as vLLM's `return_tokens_as_token_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..generation.logprobs import TOP_LOGPROBS, TokenLogprob
from .bad_request import BadRequest, shown


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """The top tokens a choice wants beside each chosen token, or None for no log-probabilities."""
    if not chat:
        return _count(body, "logprobs")
    flag, top = body.get("logprobs"), _count(body, "top_logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise BadRequest(f"logprobs is {shown(flag)}; it must be true or false", "logprobs")
    if top is not None and not flag:
        raise BadRequest(f"top_logprobs is {top}; it needs logprobs: true beside it", "top_logprobs")
    return (top or 0) if flag else None


def _count(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= TOP_LOGPROBS):
        raise BadRequest(f"{name} is {shown(value)}; it must be an integer in [0, {TOP_LOGPROBS}]", name)
    return value


def logprobs_schema(chat: bool) -> dict[str, Any]:
    """The fields' OpenAPI schema for an endpoint."""
    count = {"type": ["integer", "null"], "minimum": 0, "maximum": TOP_LOGPROBS}
    if chat:
        return {"logprobs": {"type": ["boolean", "null"]}, "top_logprobs": count}
    return {"logprobs": count}


class LogprobWriter:
    """One choice's `logprobs` objects, chunk after chunk: a completion's `text_offset` runs on
    from the chunk before."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # characters of the choice's token texts so far

    def text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def write(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The `logprobs` object of `entries`, the chunk's (or the whole choice's) tokens in order."""
        if self.chat:
            return {"content": [self._chat_entry(e.token, e.logprob, e.top) for e in entries]}
        texts = [self.text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.text(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: int, logprob: float, top: Sequence[tuple[int, float]] | None) -> dict[str, Any]:
        text = self.text(token)
        entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(i, v, None) for i, v in top]
        return entry
