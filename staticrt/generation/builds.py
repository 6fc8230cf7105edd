"""Graph builds counted across one start-up: a server compiles up to a few dozen graphs one after
another, minutes on a CPU, and a line per graph with no count and no end in sight reads as a hang.
Inside `counting(total)` each build is announced as "3 of 16", with the time the rest should
take once one has been timed; a lone generation's `prepare` counts its own few. Imports no torch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_current = threading.local()


class Builds:
    """How many graphs one start-up builds, how many are done, and the seconds they took."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.spent = total, 0, 0.0

    @property
    def number(self) -> str:
        """The next build's place: "3 of 16"."""
        return f"{min(self.done + 1, self.total)} of {self.total}"

    @property
    def left(self) -> str:
        """ "; about 1 min 20 s left" once a build has been timed, else ""."""
        return f"; about {_duration(self.spent / self.done * (self.total - self.done))} left" if self.done else ""

    def finished(self, seconds: float) -> None:
        self.done += 1
        self.spent += seconds


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def current(own: int) -> Builds:
    """The start-up's count, or a count of `own` builds where no start-up counts (a lone generation)."""
    return getattr(_current, "builds", None) or Builds(own)


@contextmanager
def counting(total: int) -> Iterator[Builds]:
    """Number the builds announced in this thread inside the block 1..`total`."""
    _current.builds = Builds(total)
    try:
        yield _current.builds
    finally:
        _current.builds = None
