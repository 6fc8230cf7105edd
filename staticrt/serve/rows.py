"""What each row of a server's cache holds, and where a request keeps the most of it.

A row remembers the token ids its cache holds, as fed (generation/prefix.py). A request is seated
in the free row that shares the longest prefix with its prompt (ties: a row within the narrowest of
the server's narrow twins that holds the busy rows and this one, then the least recently used) and
prefills only the rest, as llama.cpp's slots do: clients that share a system prompt, or send a
conversation one turn longer, pay for what is new. A free row keeps its contents until it is
reused; the steps it sits out write at its end (the position after what it holds), where a
continuation overwrites them before any query sees them.

A rotating layer may also hold entries past what the row holds: a speculative step's rejected
drafts, or the tail of the request before, which the row's request cut back to a kept prefix.
`kept` counts them as written (prefix.continues' `over`) until the row's own writes since it was
seated span every rotating slot.

With a host pool (`pool_bytes`, `serve --cache-ram`), a row about to be overwritten past what its
new request keeps is first copied to host memory (the backend's `stash_row`), and a request whose
prompt an entry there keeps more of than any free row is seated in the least recently used free
row with that entry restored: with more conversations than rows, each turn still finds its own.
The pool drops its least recently used entries past its size. Imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..generation.buckets import chunk_end
from ..generation.loop import StepBackend
from ..generation.prefix import kept_prefix

log = logging.getLogger("staticrt")


@dataclass(eq=False)  # an entry is itself (tensors have no truth value)
class Saved:
    """A row's contents in the host pool: its ids, its memory's marks, the backend's copy, and
    what all of it costs in host memory (`entry_bytes`)."""

    held: list[int]
    beyond: int
    since: int
    state: Any  # the backend's RowState
    nbytes: int


# Host bytes an entry costs beside its tensors' data, measured on torch 2.13 (CPU): a copied part
# (tensor object, storage, allocation) ~430 bytes, a held id 36 (an int and its list slot). A tiny
# model's row of 6 tokens holds 3,080 bytes of K/V in 5 parts and took 5,226 of RSS an entry.
PART_BYTES, ID_BYTES = 512, 36


def entry_bytes(state: Any, held: list[int]) -> int:
    """What a pool entry of `state` (a RowState) holding `held` costs, counted against --cache-ram."""
    return state.nbytes + PART_BYTES * len(state.parts) + ID_BYTES * len(held)


class RowMemory:
    """The ids each of `backend`'s rows holds; with `reuse` False (or a backend that writes one
    column for every row, whose waves start over), it never keeps anything. `widest`: the widest
    step that continues a kept prefix (the prefiller's widest continuing graph; None: any bucket),
    so the rest is prefilled in chunks of at most that many tokens. `pool_bytes`: the host pool's
    size (0: none; a backend without `stash_row` has none). `narrow`: the batch sizes of the
    server's narrow twins (serve/__init__.py's `narrow_backends`): a decode step whose busy rows
    lie within the first n runs n rows wide, so a request takes a row there where it can."""

    def __init__(
        self,
        backend: StepBackend,
        reuse: bool,
        widest: int | None = None,
        pool_bytes: int = 0,
        narrow: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.narrow = sorted(narrow)
        self.reuse = reuse and backend.row_positions
        self.widest = widest
        self.held: list[list[int]] = [[] for _ in range(backend.batch_size)]
        self.used = [-1] * backend.batch_size  # the order of each row's last request: ties go to the oldest
        self.beyond = [0] * backend.batch_size  # the furthest position a row may have written (rotating layers)
        self.since = [0] * backend.batch_size  # where the row's writes have run without a gap since it was seated
        self.span = max((slots for slots, _ in backend.rotating_layouts), default=0)
        self.pool_bytes = pool_bytes if self.reuse and hasattr(backend, "stash_row") else 0
        self.pool: list[Saved] = []  # the least recently used first

    def kept(self, prompt: list[int], row: int) -> int:
        """Prompt tokens a request keeps in `row`, where the rest's chunks fit after them."""
        return self._kept(prompt, self.held[row], self.beyond[row])

    def _kept(self, prompt: list[int], held: list[int], beyond: int) -> int:
        if not self.reuse:
            return 0
        limit, buckets = self.backend.max_sequence_len, self.backend.buckets
        if self.widest is not None:
            buckets = tuple(b for b in buckets if b <= self.widest)
        held = held + [-1] * (beyond - len(held))  # -1: never a token id
        kept = kept_prefix(held, prompt, self.backend.rotating_layouts)
        return kept if limit is None or kept + chunk_end(buckets, len(prompt) - kept) <= limit else 0

    def best(self, prompt: list[int], free: list[int]) -> tuple[int, int, Saved | None]:
        """The free row that keeps the most of `prompt` (of equals, one within the narrow twin the
        busy rows and this one need, then the least recently used), and how much; or, where a pool
        entry keeps more, the least recently used free row (one within that twin first), how much
        the entry keeps and the entry to restore there."""
        kept = {r: self.kept(prompt, r) for r in free}
        busy = self.backend.batch_size - len(free) + 1  # with this request
        within = next((n for n in self.narrow if n >= busy), self.backend.batch_size)
        row = max(free, key=lambda r: (kept[r], r < within, -self.used[r]))
        if self.pool:
            pooled = {id(s): self._kept(prompt, s.held, s.beyond) for s in self.pool}
            saved = max(reversed(self.pool), key=lambda s: pooled[id(s)])  # of equals, the newest
            if pooled[id(saved)] > kept[row]:
                return min(free, key=lambda r: (r >= within, self.used[r])), pooled[id(saved)], saved
        return row, kept[row], None

    def seat(self, row: int, kept: int, order: int, saved: Saved | None = None) -> int:
        """`row` takes a request that keeps `kept` of what it holds (of `saved`'s, restored first);
        what the row held past that goes to the pool first. Returns what the request keeps: `kept`,
        or 0 where the pool failed (a pool costs a prefix at worst, never a request or the rows)."""
        try:
            if self.pool_bytes:
                self._save(row, kept if saved is None else 0)
            if saved is not None:
                self.pool.remove(saved)
                self.backend.restore_row(row, saved.state)
                self.held[row], self.beyond[row], self.since[row] = list(saved.held), saved.beyond, saved.since
        except Exception as err:
            log.warning("the host pool failed (%s: %s); the request prefills its whole prompt", type(err).__name__, err)
            self.forget(row)
            kept = 0
        self._cut(row, kept)
        self.used[row] = order
        return kept

    def _save(self, row: int, kept: int) -> None:
        """Copy `row` to the pool where it holds more than the `kept` ids its next request keeps;
        drop the oldest entries past the pool's size. A row whose ids an entry already holds (and
        its marks, where layers rotate) only makes that entry the newest: a client repeating a
        greedy request added the same entry again each time."""
        held = self.held[row]
        if len(held) <= kept:
            return
        marks = (self.beyond[row], self.since[row])
        same = next((s for s in self.pool if s.held == held and (not self.span or (s.beyond, s.since) == marks)), None)
        if same is not None:
            self.pool.remove(same)
            self.pool.append(same)
            return
        state = self.backend.stash_row(row, len(held))
        cost = entry_bytes(state, held)
        if cost > self.pool_bytes:
            return
        self.pool.append(Saved(list(held), *marks, state, cost))
        while self.pooled_bytes > self.pool_bytes:
            self.pool.pop(0)

    @property
    def pooled_bytes(self) -> int:
        return sum(s.nbytes for s in self.pool)

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
