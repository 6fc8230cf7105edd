"""The terminal the CLI talks to: progress and tables on stderr, so stdout carries only results
(and the tables themselves, when asked for as CSV or Markdown to paste or parse)."""

from __future__ import annotations

import csv
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


class _Stderr:
    """rich's Console on stderr, made at its first use: importing rich is ~17 ms of the ~0.5 s
    `staticrt run ARTIFACT` takes to its first token, and that path prints through it only after."""

    made: Console | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console(), name)

    def __setattr__(self, name: str, value: Any) -> None:  # its width, say, set on rich's Console
        setattr(self.console(), name, value)

    @staticmethod
    def console() -> Console:
        if _Stderr.made is None:
            from rich.console import Console

            _Stderr.made = Console(stderr=True)
        return _Stderr.made


console = _Stderr()


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


@contextmanager
def progress(label: str) -> Iterator[Callable[[str], None]]:
    """Yields `update(stage)`. A terminal shows a spinner with the stage; a CI log or a pipe,
    where a spinner shows nothing, gets each stage as a line with the seconds since the start."""
    if console.is_terminal:
        with console.status(label) as status:
            yield status.update
        return
    start = time.perf_counter()

    def update(stage: str) -> None:
        console.print(f"[{time.perf_counter() - start:7.1f} s] {stage}", markup=False, highlight=False, soft_wrap=True)

    update(label)
    yield update


def _cell(value: Any) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None = None) -> Table:
    """Row names left and whole, numbers right; floats with two decimals and thousands separators.
    Each column is as wide as its widest cell or header, or, where that is wider than `width`,
    its widest cell or header word (headers wrap at spaces, cells never): a fixed width, which
    rich does not shrink (its own collapse folds numbers in the middle)."""
    from rich.table import Table

    cells = [[_cell(v) for v in row] for row in rows]
    widths = _column_widths(columns, cells, whole_headers=True)
    if width is not None and _table_width(widths) > width:
        widths = _column_widths(columns, cells, whole_headers=False)
    shown = Table(title=title)
    for i, col in enumerate(columns):
        shown.add_column(col, justify="left" if i == 0 else "right", overflow="fold", width=widths[i])
    for row in cells:
        shown.add_row(*row)
    return shown


def show_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table") -> None:
    """`rows` as a table on stderr that never cuts a number short: where the terminal is too
    narrow for every column whole, one block a row, a line a column. `csv` and `markdown` go to
    stdout, whole whatever the width."""
    cells = [[_cell(v) for v in row] for row in rows]
    if fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(cells)
    elif fmt == "markdown":
        print(f"**{title}**\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join(":---" if i == 0 else "---:" for i in range(len(columns))) + "|")
        for row in cells:
            print("| " + " | ".join(row) + " |")
    elif _table_width(_column_widths(columns, cells, whole_headers=False)) <= console.width:
        console.print(table(title, columns, rows, console.width))
    else:
        console.print(title, style="italic", markup=False, highlight=False, soft_wrap=True)
        label = max(len(c) for c in columns[1:])
        for row in cells:
            console.print(row[0], style="bold", markup=False, highlight=False, soft_wrap=True)
            for col, cell in zip(columns[1:], row[1:]):
                console.print(f"  {col:<{label}}  {cell}", markup=False, highlight=False, soft_wrap=True)


def _column_widths(columns: Sequence[str], cells: Sequence[Sequence[str]], whole_headers: bool) -> list[int]:
    """Each column's width: its widest cell, and its header whole or at its longest word."""
    heads = [len(col) if whole_headers else max(len(word) for word in col.split()) for col in columns]
    return [max([heads[i], *(len(row[i]) for row in cells)]) for i in range(len(columns))]


def _table_width(widths: Sequence[int]) -> int:
    """Characters a table of these column widths takes: 2 of padding and 1 of border a column,
    and the last border."""
    return sum(w + 3 for w in widths) + 1
