"""One generation's speculation, as the decode loop drives it: whether a step drafts, the verify
step's inputs, and what each row keeps of its draft (speculative.py says how and why). Imports no torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from .draft_policy import DraftPolicy
from .prefix import draft_room
from .speculative import Speculation, accepted, check_drafter, check_verifies


class Speculator:
    """Drafts and verifies for one generation's rows (`DraftPolicy` decides when).

    A draft model's draft length adapts as transformers' assisted generation's "heuristic"
    schedule does: +2 after a step that kept every draft, -1 after one that did not, within
    [1, k]. Each drafted token costs a draft model's decode step, so a drafter that keeps missing
    spends one step a verify step; prompt lookup drafts for free and always offers all k."""

    def __init__(self, spec: Speculation, backend: Any, held: list[list[int]], n_rows: int, do_sample: bool) -> None:
        self.spec, self.backend, self.held, self.n_rows, self.do_sample = spec, backend, held, n_rows, do_sample
        self.policy = DraftPolicy()
        self.written = [0] * n_rows  # each row's last position written (rejected drafts included)
        self.length = spec.k  # tokens a row drafts at most this step

    def prepare(self, rows: list[list[int]]) -> float:
        """Build the verify graph (`StepBackend.prepare`) and warm the drafter (`Speculation.warm`:
        its graphs, and its prefill of the prompts `rows`); the seconds it took."""
        spent = self.backend.prepare((self.spec.k + 1,), self.do_sample, continuing=True, fresh=False, verify=True)
        return spent + self.spec.warm(rows)

    def drafts(self, pending: np.ndarray, write_index: np.ndarray, done: list[bool]) -> list[np.ndarray] | None:
        """Each of the request's rows' draft (empty for a finished row), or None: take a decode step
        (nothing drafted, drafting paused, no decode step timed yet, or no room in the cache)."""
        if not self.policy.ready():
            return None
        limit, layouts = self.backend.max_sequence_len, self.backend.rotating_layouts
        if limit is not None and int(write_index.max()) + self.spec.k + 1 > limit:
            return None
        rooms = [0 if done[r] else draft_room(int(write_index[r]), self.length, layouts) for r in range(self.n_rows)]
        restart = self.backend.rope_restart  # a verify step stays on one side of LongRoPE's switch (prefill.py)
        if restart is not None:
            if any(int(write_index[r]) == restart for r in range(self.n_rows) if not done[r]):
                return None  # the decode step restarts it
            below = [int(write_index[r]) < restart for r in range(self.n_rows)]
            rooms = [min(room, restart - 1 - int(write_index[r])) if below[r] else room for r, room in enumerate(rooms)]
        if not any(rooms):
            return None
        contexts = [np.array([*self.held[r], int(pending[r])], dtype=np.int64) for r in range(self.n_rows)]
        found = self.spec.propose(contexts, rooms)
        return found if any(len(d) for d in found) else None

    def verify(
        self, drafts: list[np.ndarray], pending: np.ndarray, write_index: np.ndarray, run: Any
    ) -> tuple[np.ndarray, list[list[int]]]:
        """One verify step through `run(input_ids [B, k+1], num_new [B]) -> [B, k+1]`: the rows'
        next tokens `[B]` and each request row's emitted tokens; advances `write_index` and `held`."""
        input_ids, num_new = verify_inputs(pending, drafts, self.spec.k)
        chosen = run(input_ids, num_new)  # [B, k+1]: the token after each position (greedy, or sampled by the rule)
        emitted, next_ids, kept_all = [], chosen[:, 0].copy(), True
        for r, draft in enumerate(drafts):
            took = accepted(draft, chosen[r])
            kept_all &= took == len(draft)
            emitted.append(chosen[r, : took + 1].tolist())
            next_ids[r] = chosen[r, took]
            self.written[r] = max(self.written[r], int(write_index[r]) + len(draft))
            del self.held[r][int(write_index[r]) + took + 1 :]  # the step held every fed token
            write_index[r] += took + 1
        write_index[len(drafts) :] += 1
        if self.spec.drafter is not None:
            self.length = min(self.length + 2, self.spec.k) if kept_all else max(self.length - 1, 1)
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
    if spec.drafter is not None:
        check_drafter(backend, spec.drafter.backend, n_rows)
    return Speculator(spec, backend, held, n_rows, do_sample)
