"""Tables never cut a number short, CSV and Markdown are whole, progress shows without a terminal."""

from __future__ import annotations

import csv
import io

from staticrt.cli.console import console, progress, show_table

COLUMNS = ["backend", "prompt", "prefill ms", "ms/token", "tok/s"]
ROWS = [["compiled", 32, 1234567.891, 9.5, "-"], ["hf", 32, 2.0, 12.25, 81.63]]


def test_a_wide_terminal_gets_a_table_with_every_number_whole(monkeypatch, capsys):
    monkeypatch.setattr(console, "width", 120)
    show_table("bench", COLUMNS, ROWS)
    err = capsys.readouterr().err
    assert "1,234,567.89" in err and "81.63" in err and "…" not in err
    assert "┃ backend" in err


def test_a_narrow_terminal_gets_one_block_a_row_instead_of_cut_numbers(monkeypatch, capsys):
    monkeypatch.setattr(console, "width", 30)
    show_table("bench", COLUMNS, ROWS)
    assert capsys.readouterr().err.splitlines() == [
        "bench",
        "compiled",
        "  prompt      32",
        "  prefill ms  1,234,567.89",
        "  ms/token    9.50",
        "  tok/s       -",
        "hf",
        "  prompt      32",
        "  prefill ms  2.00",
        "  ms/token    12.25",
        "  tok/s       81.63",
    ]


def test_csv_and_markdown_go_to_stdout_whole(capsys):
    show_table("bench", COLUMNS, ROWS, "csv")
    out = capsys.readouterr().out
    assert list(csv.reader(io.StringIO(out))) == [
        COLUMNS,
        ["compiled", "32", "1,234,567.89", "9.50", "-"],
        ["hf", "32", "2.00", "12.25", "81.63"],
    ]
    show_table("bench", COLUMNS, ROWS, "markdown")
    assert capsys.readouterr().out.splitlines() == [
        "**bench**",
        "",
        "| backend | prompt | prefill ms | ms/token | tok/s |",
        "|:---|---:|---:|---:|---:|",
        "| compiled | 32 | 1,234,567.89 | 9.50 | - |",
        "| hf | 32 | 2.00 | 12.25 | 81.63 |",
    ]


def test_progress_without_a_terminal_prints_each_stage_as_a_line(capsys):
    with progress("benchmarking") as update:
        update("eager: warm-up")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["benchmarking", "eager: warm-up"]
    assert all(line.startswith("[") and line.split("]")[0].endswith(" s") for line in lines)


def test_a_table_that_just_fits_keeps_every_number_whole(monkeypatch, capsys):
    """Rich's own collapse folded '3,921.84' over two lines when the table was a few columns too wide."""
    monkeypatch.setattr(console, "width", 80)
    columns = ["contender", "done", "tokens", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    rows = [["staticrt", "192/192", 10851, 3921.84, 110.47, 221.71, 0.49, 12.40]]
    rows.append(["one_at_a_time", "192/192"] + ["-"] * 6)
    show_table("serve", columns, rows)
    err = capsys.readouterr().err
    assert all(cell in err for cell in ("one_at_a_time", "3,921.84", "110.47", "221.71", "12.40"))
    assert max(len(line) for line in err.splitlines()) <= 80
