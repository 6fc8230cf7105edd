"""The reference pages, generated from the code so that they cannot drift from it:
docs/reference/cli.md from the argparse parser (each command's `--help`, word for word) and
docs/reference/python.md from the public API's signatures and docstrings.

`python -m staticrt.cli.reference` writes both; `--check` writes nothing and exits 1 naming the
pages that differ from what the code gives (tests/test_docs.py runs it, so CI fails on a stale page).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .. import _EXPORTS
from ..artifacts.write import write_text_atomically
from .main import build_parser

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "reference"
WIDTH = 100  # help text wraps at this many columns, whatever the terminal that regenerates it


@contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help to $COLUMNS (shutil.get_terminal_size): fixed while the pages render."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width + 2)  # argparse keeps two columns back
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def cli_page() -> str:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    lines = [
        "# Command-line reference",
        "",
        "Generated from the parser by `python -m staticrt.cli.reference`; `staticrt COMMAND --help` prints the same.",
        "",
    ]
    with _columns(WIDTH):
        for name, command in [("staticrt", parser), *((f"staticrt {n}", p) for n, p in commands.items())]:
            lines += [f"## {name}", "", "```", command.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


class _Written:
    """An annotation as its source spells it: they are strings there (`from __future__ import
    annotations`), which inspect would print quoted."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Callable) -> str:
    def written(annotation: object) -> object:
        return _Written(annotation) if isinstance(annotation, str) else annotation

    signature = inspect.signature(obj)
    parameters = [p.replace(annotation=written(p.annotation)) for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=written(signature.return_annotation)))


def _entry(name: str, obj: object) -> list[str]:
    if isinstance(obj, dict):  # PRESETS
        return [f"## `staticrt.{name}`", "", ", ".join(f"`{k}`" for k in obj), ""]
    error = inspect.isclass(obj) and issubclass(obj, BaseException)  # raised, not called: its bases say more
    heading = f"## `staticrt.{name}`" if error else f"## `staticrt.{name}{_signature(obj)}`"
    if error:
        heading += f" ({', '.join(base.__name__ for base in obj.__bases__)})"
    lines = [heading, "", inspect.getdoc(obj) or "", ""]
    if inspect.isclass(obj) and not error:
        for method_name, method in vars(obj).items():
            if method_name.startswith("_") or not inspect.isfunction(method) or not method.__doc__:
                continue
            lines += [f"### `{name}.{method_name}{_signature(method)}`", "", inspect.getdoc(method), ""]
    return lines


def python_page() -> str:
    import staticrt

    lines = [
        "# Python reference",
        "",
        "Generated from the code by `python -m staticrt.cli.reference`: the names `import staticrt` offers, their",
        "signatures and docstrings. The guide's [Python page](../guide/python.md) shows them at work.",
        "",
    ]
    for name in _EXPORTS:
        lines += _entry(name, getattr(staticrt, name))
    return "\n".join(lines)


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


PAGES: dict[str, Callable[[], str]] = {"cli.md": cli_page, "python.md": python_page}


def stale_pages(folder: Path | None = None) -> dict[str, str]:
    """The pages under `folder` (default docs/reference) whose text differs from what the code gives
    now, or that are missing: name -> the text the code gives."""
    folder = folder or FOLDER
    pages = {name: page() for name, page in PAGES.items()}
    return {name: text for name, text in pages.items() if _read(folder / name) != text}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m staticrt.cli.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        if stale:
            print(f"stale: {', '.join(stale)}; regenerate with python -m staticrt.cli.reference", file=sys.stderr)
        return 1 if stale else 0
    for name, text in stale.items():
        write_text_atomically(FOLDER / name, text)
        print(f"wrote {FOLDER / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
