"""The shape of the house (shared/DESIGN.md), read off the source: no import cycles inside staticrt,
the torch-free deploy path free of torch, small modules and functions, and a tree ruff finds clean."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "staticrt"
# The rooms (shared/DESIGN.md's layout), top floor first. A room imports only rooms on the floors below
# its own, never one beside or above it; "" is the ground floor, the few modules at the package root.
FLOORS = (
    ("cli",),
    ("bench",),
    ("serve", "loading", "exporters", "backends"),
    ("generation", "models"),
    ("artifacts", "caches", "cpp_builds", "text"),
    ("",),
)
GROUND_FLOOR = (
    "staticrt",
    "staticrt.config",
    "staticrt.dtypes",
    "staticrt.errors",
    "staticrt.host",
    "staticrt.recurrent_config",
    "staticrt.rope",
    "staticrt.rope_config",
)
# Never import torch, directly or through what they import: an ONNX artifact deploys without it.
TORCH_FREE = (
    "staticrt.errors",
    "staticrt.artifacts.manifest",
    "staticrt.artifacts.write",
    "staticrt.text.tokenizer",
    "staticrt.text.chat_template",
    "staticrt.text.generation_config",
    "staticrt.generation.loop",
    "staticrt.generation.host_sampling",
    "staticrt.generation.generator",
    "staticrt.backends.onnx",
    "staticrt.cli.main",
    "staticrt.cli.args",
    "staticrt.cli.serve_args",
)
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """Every module `name` imports, at any depth of its code (a function's lazy import included):
    staticrt modules by full name, others by their top-level package."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from . import x` may name a submodule
            found |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES} or {target}
    return {m if m.startswith("staticrt") else m.split(".")[0] for m in found}


def staticrt_imports(name: str) -> set[str]:
    """The staticrt modules `name` imports, with the packages whose `__init__` each import runs."""
    direct = {m for m in imports(name) if m in MODULES}
    parents = {".".join(m.split(".")[:i]) for m in direct for i in range(2, len(m.split(".")))}
    return (direct | {p for p in parents if p in MODULES}) - {name}


def test_no_module_inside_staticrt_imports_one_that_imports_it_back():
    graph = {name: {m for m in imports(name) if m in MODULES and m != name} for name in MODULES}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(" -> ".join(path + [nxt]))
            elif nxt not in path and len(path) < 12:
                visit(nxt, path + [nxt])

    for start in graph:
        visit(start, [start])
    assert cycles == []


def room(module: str) -> str:
    """`staticrt.caches.base` -> "caches"; a module at the package root -> "" (the ground floor)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else ""


def test_every_module_is_in_a_room_and_the_ground_floor_stays_small():
    rooms = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert rooms == {name for floor in FLOORS for name in floor} - {""}
    assert tuple(sorted(name for name in MODULES if room(name) == "")) == GROUND_FLOOR


def test_rooms_import_only_rooms_on_floors_below_their_own():
    floor_of = {name: level for level, floor in enumerate(FLOORS) for name in floor}
    upward = sorted(
        f"{name} -> {target}"
        for name in MODULES
        for target in staticrt_imports(name)
        if room(target) != room(name) and floor_of[room(target)] <= floor_of[room(name)]
    )
    assert upward == []


@pytest.mark.parametrize("name", TORCH_FREE)
def test_the_deploy_path_imports_no_torch(name):
    seen, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += staticrt_imports(module)
    reach_torch = sorted(m for m in seen if "torch" in imports(m))
    assert reach_torch == [], f"{name} reaches torch through {reach_torch}"


def test_modules_and_functions_stay_small():
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "build_parser":
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert too_long == []


def test_no_comprehension_assigns_with_a_walrus():
    """Users run staticrt on the torch their machine has, and the CUDA images of 2026 ship torch 2.11,
    whose dynamo cannot trace a comprehension holding `:=` ("Read uninitialized cell"): a config
    property written that way failed every compiled CUDA test on an H200 (2026-11-27), where
    torch 2.13 on the CPU traced it. Which code a step traces is not fixed, so no comprehension has one."""
    comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    found = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, comprehensions) and any(isinstance(n, ast.NamedExpr) for n in ast.walk(node))
    ]
    assert found == []


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_tree_is_clean_under_ruff(command):  # ruff is in the test extra, with its settings in pyproject.toml
    root = PACKAGE.parent
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "staticrt", "tests"], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
