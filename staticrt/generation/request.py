"""A generation request checked before anything runs: prompts, counts, sampling and stop ids as
plain Python values the loop can trust, or a GenerationError that names what is wrong and the
way out, before the cache or the RNG is touched. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GenerationError, as_int

# A backend is loop.py's StepBackend and sampling params.py's SamplingParams; loop.py imports this module.
StepBackend = SamplingParams = Any


@dataclass(frozen=True)
class Request:
    """A generation request after every check: plain Python values the loop can trust."""

    rows: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    stops: frozenset[int]


def _token_ids(value: Any, what: str) -> list[int]:
    """A row of token ids from a list, tuple or 1-D integer array; each id an int (never a float,
    a bool or a string, which would run as some other token)."""
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise GenerationError(f"{what} is a {type(value).__name__}; pass a list of token ids")
    return [as_int(t, f"{what} token {i}") for i, t in enumerate(value)]


def check_bucket(backend: StepBackend, row: int, length: int, kept: int = 0) -> None:
    """Refuse prompt `row` when the `length` tokens it prefills (`kept` more held in the cache)
    pass the largest prefill bucket: a generation prefills in one step."""
    if length > backend.buckets[-1]:
        held = f" ({kept} more kept in the cache)" if kept else ""
        raise GenerationError(
            f"prompt {row} has {length} tokens to prefill{held}, beyond the largest prefill bucket "
            f"{backend.buckets[-1]}; shorten the prompt or {backend.remedy('prefill_buckets')}"
        )


def validate_request(
    backend: StepBackend,
    prompts: Any,
    max_new_tokens: Any,
    sampling: SamplingParams,
    stop_token_ids: Any = (),
    stream: Any = None,
    chunked: bool = False,
) -> Request:
    """Every check on a request, before the cache or the RNG is touched. `chunked`: prompts longer
    than the largest bucket are allowed (a server prefills them a bucket at a time)."""
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 2:
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a non-empty list of token-id lists")
    if len(prompts) > backend.batch_size:
        raise GenerationError(
            f"{len(prompts)} prompts exceed max_batch_size={backend.batch_size}; "
            f"split the batch or {backend.remedy('max_batch_size')}"
        )
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", 1)
    sampling = sampling.checked(backend.vocab_size)
    stops = frozenset(() if stop_token_ids is None else _token_ids(stop_token_ids, "stop_token_ids"))
    if stream is not None and not callable(stream):
        raise GenerationError(f"stream is a {type(stream).__name__}; pass a function (row, token id) or None")
    rows = []
    for r, prompt in enumerate(prompts):
        ids = _token_ids(prompt, f"prompt {r}")
        if not ids:
            raise GenerationError(f"prompt {r} is empty; every row needs at least one token")
        bad = [t for t in ids if not 0 <= t < backend.vocab_size]
        if bad:
            raise GenerationError(
                f"prompt {r} holds token id(s) {bad[:5]} outside the vocabulary [0, {backend.vocab_size})"
            )
        limit = backend.max_sequence_len
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt {r} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, beyond max_cache_len={limit}; shorten the prompt, ask for "
                f"fewer tokens or {backend.remedy('max_cache_len')}"
            )
        if not chunked:
            check_bucket(backend, r, len(ids))
        rows.append(ids)
    return Request(rows, max_new_tokens, sampling, stops)
