"""A patch of how a library builds (inductor's C++ builds, onnxscript's rewrites), installed while anyone needs it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("staticrt")


class SharedPatch:
    """`install()` patches the library and returns what undoes it; `active()` holds it installed
    while anyone is inside. Re-entrant and shared between threads: what it patches changes how
    the library builds, never what it builds, so a graph built beside it by another thread loses
    nothing. On another version, where `install` finds no such names, the library builds as it
    does (`fallback` says so in the debug log)."""

    def __init__(self, install: Callable[[], Callable[[], None]], fallback: str) -> None:
        self._install, self._fallback = install, fallback
        self._lock = threading.Lock()
        self._users = 0
        self._undo: Callable[[], None] | None = None

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                try:
                    self._undo = self._install()
                except (ImportError, AttributeError) as err:
                    log.debug("%s (%s)", self._fallback, err)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._undo is not None:
                    self._undo()
                    self._undo = None
