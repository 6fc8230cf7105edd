"""The terminal the CLI talks to: progress and tables on stderr, so stdout carries only results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """Row names left and whole, numbers right; floats with two decimals and thousands separators."""
    shown = Table(title=title)
    for col in columns:
        first = col == columns[0]  # row names stay whole; numeric headers may wrap
        shown.add_column(col, justify="left" if first else "right", no_wrap=first)
    for row in rows:
        shown.add_row(*(f"{v:,.2f}" if isinstance(v, float) else str(v) for v in row))
    return shown
