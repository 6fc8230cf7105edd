"""The terminal the CLI talks to: progress and tables on stderr, so stdout carries only results."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


class ConsoleLog(logging.Handler):
    """staticrt's log records (a compile under way, how long it took) as plain lines on stderr:
    the same line on a terminal and in a captured log."""

    def emit(self, record: logging.LogRecord) -> None:
        console.print(self.format(record), style="dim", markup=False, highlight=False, soft_wrap=True)


def show_log() -> None:
    """Route the `staticrt` logger's INFO records to the console (the CLI's progress lines)."""
    log = logging.getLogger("staticrt")
    if not any(isinstance(h, ConsoleLog) for h in log.handlers):
        log.addHandler(ConsoleLog())
    log.setLevel(logging.INFO)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """Row names left and whole, numbers right; floats with two decimals and thousands separators."""
    shown = Table(title=title)
    for col in columns:
        first = col == columns[0]  # row names stay whole; numeric headers may wrap
        shown.add_column(col, justify="left" if first else "right", no_wrap=first)
    for row in rows:
        shown.add_row(*(f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row))
    return shown
