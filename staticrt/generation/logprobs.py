"""Log-probabilities of the tokens a step chose and of each row's most likely tokens, as OpenAI's
`logprobs` / `top_logprobs` return them. Imports no torch.

What they are: the log-softmax of the model's own logits at the position, float32 (vLLM's default,
`logprobs_mode="raw_logprobs"`): before the logit bias, penalties, grammar mask and temperature, so
a token's log-probability is the model's whatever the request did to choose it. A grammar-forced
token may then be unlikely; that is what the client asked to see.

Where they are computed: the torch backends inside the step graph (`sampling.token_logprobs`), a
graph of its own ("greedy_logprobs", ...: `step.step_choice`) that runs only for steps where some
row asked, so a step without them costs what it did; the artifact backends, whose graphs end at the
logits and choose on the host, on the host from the same logits (`host_logprobs`). Either way the
step returns `TOP_LOGPROBS` a row and the host keeps what each row asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import GenerationError

TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs: a step returns this many a row (fewer in a smaller vocabulary)


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability and the `top` most likely tokens there, (id, logprob) descending."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepLogprobs:
    """A step's log-probabilities: `chosen [B]` float32 (each row's chosen token's), `top [B, K]`
    float32 descending and `top_ids [B, K]` int64, K = min(TOP_LOGPROBS, V)."""

    chosen: np.ndarray
    top: np.ndarray
    top_ids: np.ndarray

    def entry(self, row: int, token: int, count: int) -> TokenLogprob:
        """Row `row`'s chosen `token` with its `count` most likely tokens."""
        top = tuple((int(i), float(v)) for i, v in zip(self.top_ids[row, :count], self.top[row, :count], strict=True))
        return TokenLogprob(token, float(self.chosen[row]), top)


class LogprobSink:
    """Where a step that was asked for log-probabilities puts them (`SamplingParams.logprobs_to`):
    the step's return stays its token ids, which every caller reads, and only callers that asked
    read this."""

    def __init__(self) -> None:
        self.last: StepLogprobs | None = None

    def put(self, step: StepLogprobs) -> None:
        self.last = step

    def entry(self, row: int, token: int, count: int) -> TokenLogprob:
        """The last step's entry for `row`, whose chosen token must be `token`."""
        assert self.last is not None, "a step asked for log-probabilities put none"
        return self.last.entry(row, token, count)


def host_logprobs(logits: np.ndarray, chosen: np.ndarray) -> StepLogprobs:
    """`StepLogprobs` of logits `[B, V]` and the chosen ids `[B]`, in NumPy: the top ids in a stable
    descending order (ties keep vocabulary order)."""
    scaled = logits.astype(np.float32)
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [B, V]
    k = min(TOP_LOGPROBS, logp.shape[-1])
    top_ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    rows = np.arange(len(logp))
    return StepLogprobs(logp[rows, chosen], np.take_along_axis(logp, top_ids, -1), top_ids.astype(np.int64))


def asking(sampling: Any, speculating: bool, out: list[list[TokenLogprob]] | None, rows: int) -> tuple[Any, Any]:
    """A generation's `sampling` with a sink where it asks for log-probabilities (refused beside
    speculation, whose verify steps take several tokens a row), and what wraps the loop's stream
    callback so that each of its `rows` rows' entries land in `out`; where it asks for none, the
    two as they are."""
    if sampling.logprobs is None:
        return sampling, lambda stream: stream
    if speculating:
        raise GenerationError(
            "logprobs are computed for one token a row a step, and a verify step takes several; drop speculative "
            "or logprobs"
        )
    sink, out = LogprobSink(), out if out is not None else []
    out[:] = [[] for _ in range(rows)]
    return replace(sampling, logprobs_to=sink), lambda stream: recording(sink, sampling.logprobs, out, stream)


def recording(
    sink: LogprobSink, count: int, out: list[list[TokenLogprob]], stream: Callable[[int, int], None] | None
) -> Callable[[int, int], None]:
    """`stream` (row, token id), after each token's entry joins its row's list in `out`: the loop
    emits a step's tokens before it runs the next step, so the sink still holds their step's."""

    def emit(r: int, token: int) -> None:
        out[r].append(sink.entry(r, token, count))
        if stream is not None:
            stream(r, token)

    return emit
