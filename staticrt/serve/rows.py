"""What each row of a server's cache holds, and where a request keeps the most of it.

A row remembers the token ids its cache holds, as fed (generation/prefix.py). A request is seated
in the free row that shares the longest prefix with its prompt (ties: the least recently used
row) and prefills only the rest, as llama.cpp's slots do: clients that share a system prompt, or
send a conversation one turn longer, pay for what is new. A free row keeps its contents until it
is reused; the steps it sits out write at its end (the position after what it holds), where a
continuation overwrites them before any query sees them.

A rotating layer may also hold entries past what the row holds: a speculative step's rejected
drafts, or the tail of the request before, which the row's request cut back to a kept prefix.
`kept` counts them as written (prefix.continues' `over`) until the row's own writes since it was
seated span every rotating slot. Imports no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..generation.buckets import chunk_end
from ..generation.loop import StepBackend
from ..generation.prefix import kept_prefix


class RowMemory:
    """The ids each of `backend`'s rows holds; with `reuse` False (or a backend that writes one
    column for every row, whose waves start over), it never keeps anything. `widest`: the widest
    step that continues a kept prefix (the prefiller's widest continuing graph; None: any bucket),
    so the rest is prefilled in chunks of at most that many tokens."""

    def __init__(self, backend: StepBackend, reuse: bool, widest: int | None = None) -> None:
        self.backend = backend
        self.reuse = reuse and backend.row_positions
        self.widest = widest
        self.held: list[list[int]] = [[] for _ in range(backend.batch_size)]
        self.used = [-1] * backend.batch_size  # the order of each row's last request: ties go to the oldest
        self.beyond = [0] * backend.batch_size  # the furthest position a row may have written (rotating layers)
        self.since = [0] * backend.batch_size  # where the row's writes have run without a gap since it was seated
        self.span = max((slots for slots, _ in backend.rotating_layouts), default=0)

    def kept(self, prompt: list[int], row: int) -> int:
        """Prompt tokens a request keeps in `row`, where the rest's chunks fit after them."""
        if not self.reuse:
            return 0
        limit, buckets = self.backend.max_sequence_len, self.backend.buckets
        if self.widest is not None:
            buckets = tuple(b for b in buckets if b <= self.widest)
        held = self.held[row] + [-1] * (self.beyond[row] - len(self.held[row]))  # -1: never a token id
        kept = kept_prefix(held, prompt, self.backend.rotating_layouts)
        return kept if limit is None or kept + chunk_end(buckets, len(prompt) - kept) <= limit else 0

    def best(self, prompt: list[int], free: list[int]) -> tuple[int, int]:
        """The free row that keeps the most of `prompt` (the least recently used of equals), and how much."""
        kept = {r: self.kept(prompt, r) for r in free}
        row = max(free, key=lambda r: (kept[r], -self.used[r]))
        return row, kept[row]

    def seat(self, row: int, kept: int, order: int) -> None:
        self._cut(row, kept)
        self.used[row] = order

    def fed(self, row: int, ids: np.ndarray, rejected: int = 0) -> None:
        """`row` was fed `ids` at its end, and after them `rejected` drafts (speculative.py) whose
        K/V now lie past what it holds."""
        if self.reuse:
            held = self.held[row]
            held.extend(ids.tolist())
            if len(held) - self.since[row] >= self.span:  # every rotating slot written since: nothing older left
                self.beyond[row] = 0
            self.beyond[row] = max(self.beyond[row], len(held) + rejected - 1)

    def forget(self, row: int | None = None) -> None:
        """`row` (None: every row) holds nothing known: a step cut short, or no room at its end."""
        for r in range(len(self.held)) if row is None else (row,):
            self._cut(r, 0)

    def _cut(self, row: int, kept: int) -> None:
        """`row` holds its first `kept` ids; what it held past them may still lie in its slots."""
        self.beyond[row] = max(self.beyond[row], len(self.held[row]))
        self.held[row] = self.held[row][:kept]
        self.since[row] = kept

    def park(self, write_index: np.ndarray, jobs: list[Any], width: int) -> None:
        """Where the free rows (`jobs[r]` None) write a step's `width` entries: right after what they
        hold, or at 0, forgetting it, where that leaves no room."""
        if not self.reuse:
            return  # at position 0, as any row that holds nothing
        limit = self.backend.max_sequence_len
        for r, job in enumerate(jobs):
            if job is None:
                if limit is not None and len(self.held[r]) + width > limit:
                    self.forget(r)
                write_index[r] = len(self.held[r])
