"""A generation's sampling parameters as the loop and every backend read them: one value for
every row, or one a row (a server's step); checked once, before anything runs. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GenerationError, as_int, as_real
from .logit_bias import BiasRule
from .logprobs import TOP_LOGPROBS, LogprobSink


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    rule: BiasRule | None = None  # logit_bias and penalties (logit_bias.py), a request's
    bias: np.ndarray | None = field(default=None, compare=False)  # a step's [B, V] float32 added to the logits
    logprobs: int | None = None  # a request's ask: each token's log-probability and this many top ones (logprobs.py)
    logprobs_to: LogprobSink | None = field(default=None, compare=False)  # where a step puts them, if asked

    def checked(self, vocab_size: int) -> SamplingParams:
        """These parameters as plain Python numbers, or a GenerationError naming the one at fault.
        Types are checked always, ranges when sampling; a top_k of the vocabulary or more keeps
        every token, so it becomes 0 (and never overflows a tensor)."""
        if not isinstance(self.do_sample, bool) and type(self.do_sample).__name__ != "bool_":
            raise GenerationError(f"do_sample is {self.do_sample!r}; it must be True or False")
        temperature = as_real(self.temperature, "temperature")
        top_k = as_int(self.top_k, "top_k", 0)
        top_p = as_real(self.top_p, "top_p")
        seed = None if self.seed is None else as_int(self.seed, "seed", 0)
        if self.do_sample:
            if not temperature > 0:
                raise GenerationError(f"temperature is {temperature}; it must be > 0 (use do_sample=False for greedy)")
            if not 0 < top_p <= 1:
                raise GenerationError(f"top_p is {top_p}; it must be in (0, 1]")
        rule = None if self.rule is None else self.rule.checked(vocab_size)
        top_k = 0 if top_k >= vocab_size else top_k
        logprobs = None if self.logprobs is None else as_int(self.logprobs, "logprobs", 0)
        if logprobs is not None and logprobs > TOP_LOGPROBS:
            raise GenerationError(f"logprobs is {logprobs}; at most {TOP_LOGPROBS} top tokens a token: ask for fewer")
        return SamplingParams(bool(self.do_sample), temperature, top_k, top_p, seed, rule, logprobs=logprobs)


def per_row(value: Any, batch: int, dtype: Any) -> np.ndarray:
    """A sampling parameter as `[batch]` values: one number for every row, or already one a row."""
    return np.array(np.broadcast_to(np.asarray(value, dtype=dtype), (batch,)))  # a writable copy
