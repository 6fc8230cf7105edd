"""Speculative decoding in fixed shapes: tokens drafted on the host, checked in one step.

A decode step at small batch reads every weight for one token a row. A verify step feeds each
row its next token and up to k drafted tokens (one graph of width k + 1; a row's missing drafts
are padding) and returns the greedy token after every position. The row keeps its drafts up to
the first one the model would not have chosen, plus the model's choice there: 1 to k + 1 tokens
for one read of the weights. Nothing is rolled back: masks come from positions, so the next step
writes over a rejected draft's K/V (a rotating layer holds that only where it is exact:
`prefix.draft_room`).

Worked example, k = 3: a row's next token is "d" (chosen, not yet fed) and its tokens hold
"c d e f g" earlier, so it drafts "e f g". The step feeds [d, e, f, g] at positions P..P+3 and
returns [e, f, x, y]: "e" and "f" are what the model chooses, "g" is not (it chose "x" after
"f"). The row emits e, f, x; d, e, f are held (P..P+2) and x is the next token, fed at P+3 over
g's K/V. The emitted tokens are plain greedy decoding's, up to floating point: a verify step's
GEMMs have k + 1 rows a row where a decode step's have one, so a near-tie between two tokens
may resolve differently (as prefill against decode already may).

A sampling generation verifies by speculative sampling's rule (`sampling.verify_sample`): a
draft is kept with the probability the model gives it, and a rejected position draws from the
model's distribution without the draft, so each emitted token follows the model's distribution
as plain sampling's does (not the same tokens for a seed: the draws differ). The host reads the
step's tokens as in the greedy case: a rejected position's token is never its draft.

Drafts come from the row's own tokens (prompt lookup): what followed the latest earlier
occurrence of its last n tokens, n from `max_ngram` down to 1, as transformers'
`prompt_lookup_num_tokens` and llama.cpp's lookup decoding draft. Imports no torch.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GenerationError
from .prefix import draft_room

DEFAULT_DRAFT = 4  # tokens drafted a step: the verify graph is 5 wide (a measured choice: docs/measurements.md)


@dataclass(frozen=True)
class Speculation:
    """How a generation speculates: `draft` "ngram" (prompt lookup), `k` tokens a step at most."""

    draft: str = "ngram"
    k: int = DEFAULT_DRAFT
    max_ngram: int = 3  # the longest suffix of a row's tokens looked up

    @classmethod
    def parse(cls, text: str | Speculation) -> Speculation:
        """ "ngram" or "ngram:K" (the CLI's `--speculative`), or a Speculation as it is."""
        if isinstance(text, Speculation):
            spec = text
        else:
            kind, _, k = str(text).partition(":")
            if kind != "ngram" or (k and not k.isdigit()):
                raise GenerationError(
                    f"speculative is {text!r}; give 'ngram' or 'ngram:K' (prompt lookup, K drafted tokens a step, "
                    f"default {DEFAULT_DRAFT})"
                )
            spec = cls(kind, int(k) if k else DEFAULT_DRAFT)
        if not 1 <= spec.k <= 32 or spec.max_ngram < 1:
            raise GenerationError(f"speculative k is {spec.k}; it must lie in [1, 32] (a verify step is k + 1 wide)")
        return spec


def ngram_draft(tokens: np.ndarray, k: int, max_ngram: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n of `tokens [N]`
    (n from `max_ngram` down to 1); empty where none occurs."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        # Windows start at 0 .. N-1-n, so each is followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


def draft_for(context: np.ndarray, position: int, spec: Speculation, layouts: Any) -> np.ndarray:
    """The draft of a row whose tokens are `context [N]` (its last one chosen, not yet fed, fed
    next at `position`): up to `spec.k` tokens, as many as its rotating layers allow (`draft_room`)."""
    room = draft_room(position, spec.k, layouts)
    return ngram_draft(context, room, spec.max_ngram) if room else context[:0]


def accepted(draft: np.ndarray, chosen: np.ndarray) -> int:
    """How many of `draft [d]` the model chose too: `chosen [>= d]` is its token after each fed
    position (the row's next token, then each draft), so draft i stands where chosen[i] equals it."""
    mismatch = np.flatnonzero(draft != chosen[: len(draft)])
    return int(mismatch[0]) if mismatch.size else len(draft)


class DraftPolicy:
    """When drafting pays, from the steps' measured times.

    A verify step costs more than a decode step (k + 1 positions through every GEMM), so it must
    yield enough tokens. After each verify step the policy compares the recent verify steps' time
    a token yielded with the recent decode steps' time; where drafting loses it pauses for a
    number of steps that doubles while it keeps losing (at most 64), then tries again. Open-ended
    text that drafts badly then runs at about decode speed."""

    def __init__(self) -> None:
        self.decode_s: collections.deque[float] = collections.deque(maxlen=8)
        self.verify_s: collections.deque[float] = collections.deque(maxlen=4)
        self.yields: collections.deque[float] = collections.deque(maxlen=4)  # mean tokens a row a verify step
        self.pause, self.wait = 0, 0

    def ready(self) -> bool:
        """Whether this step may verify drafts (counts a paused step down); never before a decode step was timed."""
        if self.wait > 0:
            self.wait -= 1
            return False
        return bool(self.decode_s)

    def timed(self, seconds: float, tokens: list[int] | None) -> None:
        """A step's time, and for a verify step the tokens each live row took from it."""
        if tokens is None:
            self.decode_s.append(seconds)
            return
        self.verify_s.append(seconds)
        if tokens:
            self.yields.append(sum(tokens) / len(tokens))
        per_token = statistics.median(self.verify_s) / max(statistics.fmean(self.yields or [1.0]), 1e-9)
        if len(self.yields) >= 2 and per_token > statistics.median(self.decode_s):
            self.pause = min(max(2 * self.pause, 4), 64)
            self.wait = self.pause
            self.yields.clear()
        elif len(self.yields) >= 2:
            self.pause = 0


class Speculator:
    """Drafts and verifies for one generation's rows (`DraftPolicy` decides when)."""

    def __init__(self, spec: Speculation, backend: Any, held: list[list[int]], n_rows: int, do_sample: bool) -> None:
        self.spec, self.backend, self.held, self.n_rows, self.do_sample = spec, backend, held, n_rows, do_sample
        self.policy = DraftPolicy()
        self.written = [0] * n_rows  # each row's last position written (rejected drafts included)

    def prepare(self) -> float:
        """Build the verify graph (`StepBackend.prepare`); the seconds it took."""
        return self.backend.prepare((self.spec.k + 1,), self.do_sample, continuing=True, fresh=False, verify=True)

    def drafts(self, pending: np.ndarray, write_index: np.ndarray, done: list[bool]) -> list[np.ndarray] | None:
        """Each of the request's rows' draft (empty for a finished row), or None: take a decode step
        (nothing drafted, drafting paused, no decode step timed yet, or no room in the cache)."""
        if not self.policy.ready():
            return None
        limit, layouts = self.backend.max_sequence_len, self.backend.rotating_layouts
        if limit is not None and int(write_index.max()) + self.spec.k + 1 > limit:
            return None
        found = [
            np.zeros(0, dtype=np.int64)
            if done[r]
            else draft_for(
                np.array([*self.held[r], int(pending[r])], dtype=np.int64), int(write_index[r]), self.spec, layouts
            )
            for r in range(self.n_rows)
        ]
        return found if any(len(d) for d in found) else None

    def verify(
        self, drafts: list[np.ndarray], pending: np.ndarray, write_index: np.ndarray, run: Any
    ) -> tuple[np.ndarray, list[list[int]]]:
        """One verify step through `run(input_ids [B, k+1], num_new [B]) -> [B, k+1]`: the rows'
        next tokens `[B]` and each request row's emitted tokens; advances `write_index` and `held`."""
        input_ids, num_new = verify_inputs(pending, drafts, self.spec.k)
        chosen = run(input_ids, num_new)  # [B, k+1]: the token after each position (greedy, or sampled by the rule)
        emitted, next_ids = [], chosen[:, 0].copy()
        for r, draft in enumerate(drafts):
            took = accepted(draft, chosen[r])
            emitted.append(chosen[r, : took + 1].tolist())
            next_ids[r] = chosen[r, took]
            self.written[r] = max(self.written[r], int(write_index[r]) + len(draft))
            del self.held[r][int(write_index[r]) + took + 1 :]  # the step held every fed token
            write_index[r] += took + 1
        write_index[len(drafts) :] += 1
        return next_ids, emitted

    def finish(self) -> None:
        """Mark in `held` the positions past each row's tokens that hold a rejected draft's K/V
        (-1, never a token id): a later prompt reuses no more than it may (prefix.kept_prefix)."""
        for r in range(self.n_rows):
            self.held[r].extend([-1] * (self.written[r] - len(self.held[r])))


def verify_inputs(pending: np.ndarray, drafts: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """A verify step's `input_ids [B, k+1]` (each row's next token, then its draft, right-padded)
    and `num_new [B]` (1 + its draft); rows past `drafts` feed their next token alone."""
    batch = len(pending)
    input_ids = np.zeros((batch, k + 1), dtype=np.int64)
    input_ids[:, 0] = pending
    num_new = np.ones(batch, dtype=np.int64)
    for r, draft in enumerate(drafts):
        input_ids[r, 1 : 1 + len(draft)] = draft
        num_new[r] += len(draft)
    return input_ids, num_new


def speculator_for(
    backend: Any, speculative: Any, do_sample: bool, held: list[list[int]], n_rows: int
) -> Speculator | None:
    """The generation's Speculator, or None without speculation; refused, before anything runs,
    where it cannot speculate."""
    if speculative is None:
        return None
    spec = Speculation.parse(speculative)
    check_verifies(backend)
    return Speculator(spec, backend, held, n_rows, do_sample)


def check_verifies(backend: Any) -> None:
    """Refuse, by name, a backend without a verify step."""
    if not hasattr(backend, "verify_step"):
        raise GenerationError(
            f"the {backend.name} backend has no verify step for speculative decoding; use a torch model "
            "backend (eager, compiled, cudagraph), or no speculation (drop --speculative; speculative=None)"
        )
