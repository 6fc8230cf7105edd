"""When speculative decoding pays, judged from the steps' measured times (speculative.py: a
generation's Speculator; serve/planning.py: a server's rows). Imports no torch."""

from __future__ import annotations

import collections
import statistics


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
