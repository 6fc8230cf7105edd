"""Beam search over the rows of one fixed-shape cache. It never imports torch.

B prompts with N beams each take B*N rows of the cache, item b's beams in rows b*N .. b*N + N-1.
Every row is prefilled with its item's prompt; each step the backend returns each row's K best
next tokens and their log-probabilities (`beam_step`), the host keeps the N best continuations
of each item, and the backend reorders the cache rows in place (`reorder_rows`: row r takes the
contents of the row its beam continues), so no buffer moves and graphs stay valid.

The bookkeeping is transformers' vectorised beam search (`GenerationMixin._beam_search`, v4.50
and later), step for step, in float32 NumPy: K = max(2, 1 + stop tokens) * N candidates an item;
a candidate that ends in a stop token, or reaches `max_new_tokens`, is finished when it ranks in
the top N and scores `log p / new_tokens ** length_penalty`; the N best unfinished ones run on;
`early_stopping` is True (stop once N are finished), False (stop when the best running beam,
scored at its current length, cannot beat the worst finished one) or "never" (the same with the
longest length the beam could reach, when length_penalty > 0). The best finished beam is returned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import GenerationError, as_int, as_real
from .buckets import bucket_for
from .loop import GenerationStats, StepBackend
from .params import SamplingParams
from .prefill import crossing
from .request import validate_request

NEG = np.float32(-1.0e9)  # transformers' score for "not a candidate"


class BeamBackend(StepBackend, Protocol):
    """A backend that runs beam steps: the torch backends over a model (eager, compiled, cudagraph)."""

    def beam_step(
        self, input_ids: np.ndarray, write_index: np.ndarray, num_new: np.ndarray, candidates: int
    ) -> tuple[np.ndarray, np.ndarray]: ...  # [B, k] float32 log-probabilities (descending), [B, k] int64 ids

    def reorder_rows(self, rows: np.ndarray) -> None: ...  # row b takes row rows[b]'s K/V, in place

    def prepare(self, widths: Any, do_sample: bool, continuing: bool = False, candidates: int = 0) -> float: ...


@dataclass(frozen=True)
class BeamParams:
    """transformers' beam-search knobs, with its defaults."""

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def checked(self) -> BeamParams:
        """Plain values, or a GenerationError naming the one at fault."""
        num_beams = as_int(self.num_beams, "num_beams", 1)
        if self.early_stopping not in (True, False, "never") or type(self.early_stopping) not in (bool, str):
            raise GenerationError(f"early_stopping is {self.early_stopping!r}; it must be True, False or 'never'")
        return BeamParams(num_beams, as_real(self.length_penalty, "length_penalty"), self.early_stopping)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest of each row of `scores [R, M]`, best first (ties: lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


class BeamState:
    """The running and finished beams of every item: transformers' `running_*` and `sequences`,
    `beam_scores`, `is_sent_finished` tensors, `[items, N]` each (tokens `[items, N, max_new]`)."""

    def __init__(self, items: int, beams: int, max_new_tokens: int, stops: frozenset[int], params: BeamParams):
        self.beams, self.max_new, self.stops, self.params = beams, max_new_tokens, stops, params
        self.k = max(2, 1 + len(stops)) * beams
        self.running_scores = np.zeros((items, beams), dtype=np.float32)
        self.running_scores[:, 1:] = NEG  # every beam starts as the prompt: only beam 0's continuations count
        self.running = np.zeros((items, beams, max_new_tokens), dtype=np.int64)
        self.finished = np.zeros((items, beams, max_new_tokens), dtype=np.int64)
        self.finished_len = np.zeros((items, beams), dtype=np.int64)
        self.finished_scores = np.full((items, beams), NEG, dtype=np.float32)
        self.is_finished = np.zeros((items, beams), dtype=bool)
        self.improvable = np.ones(items, dtype=bool)  # transformers' is_early_stop_heuristic_unsatisfied
        self.all_hit = False

    def advance(self, step: int, log_probs: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Take step `step`'s candidates (`[items*N, k]` each, the beams' rows) and return, per
        beam row, the row whose beam it continues; `self.running[..., step]` holds its new token."""
        items, n, k = self.running_scores.shape[0], self.beams, self.k
        totals = (log_probs.reshape(items, n, k) + self.running_scores[:, :, None]).reshape(items, n * k)
        pick = top_k(totals, k)  # [items, k]: the item's best k over all its beams
        scores = np.take_along_axis(totals, pick, axis=1)
        source = pick // k  # the beam each candidate continues
        tokens = np.take_along_axis(ids.reshape(items, n * k), pick, axis=1)
        sequences = np.take_along_axis(self.running, source[:, :, None], axis=1)  # [items, k, max_new]
        sequences[:, :, step] = tokens
        hits = np.isin(tokens, list(self.stops)) | (step + 1 == self.max_new)
        self._finish(step, scores, sequences, hits)
        running = scores + hits.astype(np.float32) * NEG
        keep = top_k(running, n)
        self.running = np.take_along_axis(sequences, keep[:, :, None], axis=1)
        self.running_scores = np.take_along_axis(running, keep, axis=1)
        self.all_hit = bool(hits.all())
        self._check_improvable(step + 1)
        offsets = np.arange(items)[:, None] * n
        return (np.take_along_axis(source, keep, axis=1) + offsets).reshape(-1)

    def _finish(self, step: int, scores: np.ndarray, sequences: np.ndarray, hits: np.ndarray) -> None:
        """transformers' `_update_finished_beams`: finished candidates in the top N, scored with the
        length penalty, replace worse finished beams."""
        n = self.beams
        just_finished = hits & (np.arange(self.k) < n)[None, :]
        scored = scores / np.float32((step + 1) ** self.params.length_penalty)
        full = self.is_finished.all(axis=1, keepdims=True) & (self.params.early_stopping is True)
        scored = scored + full.astype(np.float32) * NEG
        scored = scored + (~self.improvable[:, None]).astype(np.float32) * NEG
        scored = scored + (~just_finished).astype(np.float32) * NEG
        merged_scores = np.concatenate([self.finished_scores, scored], axis=1)
        best = top_k(merged_scores, n)
        merged = np.concatenate([self.finished, sequences], axis=1)
        lengths = np.concatenate([self.finished_len, np.full(hits.shape, step + 1)], axis=1)
        self.finished = np.take_along_axis(merged, best[:, :, None], axis=1)
        self.finished_len = np.take_along_axis(lengths, best, axis=1)
        self.finished_scores = np.take_along_axis(merged_scores, best, axis=1)
        self.is_finished = np.take_along_axis(np.concatenate([self.is_finished, just_finished], axis=1), best, axis=1)

    def _check_improvable(self, generated: int) -> None:
        """transformers' `_check_early_stop_heuristic`, after `generated` new tokens."""
        params = self.params
        length = self.max_new if params.early_stopping == "never" and params.length_penalty > 0 else generated
        best_running = self.running_scores[:, :1] / np.float32(length**params.length_penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(axis=1, keepdims=True), NEG)
        self.improvable &= (best_running > worst).any(axis=1)

    def done(self) -> bool:
        """transformers' `_beam_search_has_unfinished_sequences`, negated."""
        all_full = bool(self.is_finished.all()) and self.params.early_stopping is True
        return not self.improvable.any() or all_full or self.all_hit

    def best(self) -> list[list[int]]:
        """Each item's best finished beam: its new tokens, the stop token included."""
        return [self.finished[i, 0, : self.finished_len[i, 0]].tolist() for i in range(len(self.finished))]


def beam_search_tokens(
    backend: Any,
    prompts: Any,
    max_new_tokens: Any,
    params: BeamParams,
    stop_token_ids: Any = (),
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """Each prompt's best beam of up to `max_new_tokens` new tokens, as transformers'
    `generate(num_beams=N, do_sample=False)` chooses it; the cache's rows hold the beams."""
    params = params.checked()
    if not hasattr(backend, "beam_step"):
        raise GenerationError(
            f"beam search runs on the eager, compiled and cudagraph backends; backend {backend.name!r} returns "
            "one chosen token a row; use num_beams=1 here, or one of those backends"
        )
    n = params.num_beams
    count = len(prompts) if isinstance(prompts, (list, tuple)) else 1
    if count * n > backend.batch_size:
        raise GenerationError(
            f"{count} prompt(s) x num_beams={n} need {count * n} cache rows, beyond max_batch_size="
            f"{backend.batch_size}; {backend.remedy('max_batch_size')} (at least {count * n}) or pass fewer prompts"
        )
    request = validate_request(backend, prompts, max_new_tokens, SamplingParams(), stop_token_ids)
    if crossing(backend.rope_restart, [len(ids) for ids in request.rows], request.max_new_tokens):
        raise GenerationError(
            f"beam search past position {backend.rope_restart}, where this model's LongRoPE switches to its long "
            "factors, would compute every beam again from position 0 (prefill.py), which beam search does not do; "
            "keep prompt and new tokens within it, or use num_beams=1"
        )
    return _search(backend, request.rows, request.max_new_tokens, request.stops, params, stats or GenerationStats())


def _search(
    backend: BeamBackend,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: frozenset[int],
    params: BeamParams,
    stats: GenerationStats,
) -> list[list[int]]:
    batch, n = backend.batch_size, params.num_beams
    state = BeamState(len(prompts), n, max_new_tokens, stops, params)
    lengths = np.ones(batch, dtype=np.int64)  # rows beyond the beams hold one dummy token
    bucket = bucket_for(backend.buckets, max(len(p) for p in prompts))
    input_ids = np.zeros((batch, bucket), dtype=np.int64)
    for r in range(len(prompts) * n):
        lengths[r] = len(prompts[r // n])
        input_ids[r, : lengths[r]] = prompts[r // n]
    stats.compile_s = backend.prepare((bucket, 1) if max_new_tokens > 1 else (bucket,), False, candidates=state.k)
    stats.bucket, stats.decode_s = bucket, []
    backend.reset()
    beam_rows = slice(0, len(prompts) * n)
    rows = np.arange(batch)  # the cache row each row takes next; rows past the beams stay put
    write_index, ones = np.zeros(batch, dtype=np.int64), np.ones(batch, dtype=np.int64)
    for step in range(max_new_tokens):
        start = time.perf_counter()
        if step:  # a decode step: the reorder counts in its time
            backend.reorder_rows(rows)
            tokens = np.zeros((batch, 1), dtype=np.int64)
            tokens[beam_rows, 0] = state.running[:, :, step - 1].reshape(-1)
            log_probs, ids = backend.beam_step(tokens, write_index, ones, state.k)
            stats.decode_s.append(time.perf_counter() - start)
            write_index += 1
        else:
            log_probs, ids = backend.beam_step(input_ids, write_index, lengths, state.k)
            stats.prefill_s = time.perf_counter() - start
            write_index = lengths.copy()
        rows[beam_rows] = state.advance(step, log_probs[beam_rows], ids[beam_rows])
        if state.done():
            break
    return state.best()
