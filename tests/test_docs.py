"""The reference pages are generated from the code (staticrt/cli/reference.py): CI fails when a
flag, a help text, a signature or a docstring changed and the pages were not regenerated."""

from __future__ import annotations

import shutil

from staticrt.cli import reference


def test_the_reference_pages_are_what_the_code_gives_now():
    assert reference.stale_pages() == {}, "regenerate them: python -m staticrt.cli.reference"
    assert reference.main(["--check"]) == 0


def test_a_renamed_flag_or_a_changed_docstring_makes_its_page_stale(tmp_path, monkeypatch, capsys):
    shutil.copytree(reference.FOLDER, tmp_path, dirs_exist_ok=True)
    cli = (tmp_path / "cli.md").read_text()
    assert "--max-new-tokens" in cli and "## staticrt serve" in cli
    (tmp_path / "cli.md").write_text(cli.replace("--max-new-tokens", "--max-tokens"))
    assert list(reference.stale_pages(tmp_path)) == ["cli.md"]
    python = (tmp_path / "python.md").read_text()
    assert "### `Generator.generate(self, prompts: Sequence[Sequence[int]]" in python
    (tmp_path / "python.md").write_text(python.replace("A model bound to a cache", "A model"))
    assert list(reference.stale_pages(tmp_path)) == ["cli.md", "python.md"]
    monkeypatch.setattr(reference, "FOLDER", tmp_path)
    assert reference.main(["--check"]) == 1
    assert capsys.readouterr().err == ("stale: cli.md, python.md; regenerate with python -m staticrt.cli.reference\n")
    assert reference.main([]) == 0 and reference.stale_pages(tmp_path) == {}


def test_the_readme_has_a_row_for_every_family_the_decoder_runs():
    """A family added to the family table without its README row (what it adds, what is tested) fails here."""
    from pathlib import Path

    from staticrt.config import FAMILIES
    from staticrt.loading.families import WRAPPERS

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = [line.split("|")[1] for line in readme.splitlines() if line.startswith("| `")]
    named = {name.strip(" `") for row in rows for name in row.split(",")}
    assert named == set(FAMILIES) | set(WRAPPERS)
