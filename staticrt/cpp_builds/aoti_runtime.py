"""AOTInductor's runtime compiled once, not again in every program's wrapper.

Every AOTInductor program's wrapper (`*.wrapper.cpp`) opens with the runtime's interface:
inductor's aoti_runtime/interface.cpp, the same ~660 lines in every program (the C entry points,
the model container with its deque and threads, a std::regex that parses the device). g++
instantiates all of it, and the model base class the program's model derives from, for each
program: a tiny model's wrapper took 4.7 s of g++, of which its own code (the model's
constructor and `run_impl`, the kernel calls) needs 2.0 s (2-core AMD EPYC, docs/measurements.md).

So the wrapper's compile is split in two, the code unchanged:
- the interface, with `AOTInductorModelBase<AOTInductorModel>` instantiated explicitly, is
  compiled once a text and set of flags into inductor's cache folder (`staticrt_aoti_runtime/`,
  written atomically) and linked into each program's library;
- the program's own part is compiled from a file of its own beside inductor's (inductor's file,
  named by its content, is never changed), the base class declared `extern template`.

Torch does not promise this layout: a wrapper of another shape, or a split build that fails, is
compiled and linked as inductor wrote it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from .shared_patch import SharedPatch

log = logging.getLogger("staticrt")

_INTERFACE_END = '\n} // extern "C"\n'
_BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"
_originals: dict[str, Any] = {}  # inductor's run_compile_cmd, while installed
# a program's wrapper object -> (the runtime object its link adds, the wrapper's whole compile)
_runtime_of: dict[str, tuple[str, str]] = {}


def _runtime_object(runtime: str, argv: list[str], source: str, output: str, cwd: str) -> str:
    """The object of `runtime` (the interface's text) built with the wrapper's flags, compiled
    the first time these flags and text are met."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    flags = [arg for arg in argv if arg not in (source, output)]
    digest = hashlib.sha256("\0".join([runtime, *flags]).encode()).hexdigest()[:32]
    obj = Path(cache_dir()) / "staticrt_aoti_runtime" / f"{digest}.o"
    if not obj.is_file():
        obj.parent.mkdir(parents=True, exist_ok=True)
        own = f"{digest}.{os.getpid()}.{threading.get_ident()}"
        text, built = obj.with_name(f"{own}.cpp"), obj.with_name(f"{own}.o")
        text.write_text(runtime)
        try:
            renamed = {source: str(text), output: str(built)}
            _originals["run"](shlex.join([renamed.get(arg, arg) for arg in argv]), cwd)
            os.replace(built, obj)  # whole or absent: another process may be building the same one
        finally:
            text.unlink(missing_ok=True)
            built.unlink(missing_ok=True)
    return str(obj)


def _compile_split(cmd_line: str, argv: list[str], source: str, cwd: str) -> bool:
    """Compile the wrapper `source` as the runtime object and its program's part; False where
    the wrapper is not interface-then-program as expected (nothing built then)."""
    output = argv[argv.index("-o") + 1]
    text = Path(source).read_text()
    interface, end, program = text.partition(_INTERFACE_END)
    if (
        not end
        or "AOTInductorModelContainerCreateWithDevice(" not in interface
        or "AOTInductorModel::" in interface
        or "AOTInductorModel::AOTInductorModel(" not in program
    ):
        return False
    runtime = _runtime_object(f"{interface}{end}template class {_BASE};\n", argv, source, output, cwd)
    includes = "".join(line + "\n" for line in interface.splitlines() if line.startswith("#include"))
    own = Path(source).with_name(Path(source).name.replace(".wrapper.cpp", ".program.cpp"))
    own.write_text(f"{includes}extern template class {_BASE};\n{program}")
    try:
        _originals["run"](shlex.join([str(own) if a == source else a for a in argv]), cwd)
    finally:
        own.unlink(missing_ok=True)
    _runtime_of[output] = (runtime, cmd_line)
    return True


def _run_compile_cmd(cmd_line: str, cwd: str) -> None:
    """inductor's `run_compile_cmd`, with a wrapper's compile split and its link given the runtime."""
    argv = shlex.split(cmd_line)
    wrappers = [arg for arg in argv if arg.endswith(".wrapper.cpp")]
    if "-c" in argv and "-o" in argv and len(wrappers) == 1:
        try:
            if _compile_split(cmd_line, argv, wrappers[0], cwd):
                return
        except Exception as err:  # noqa: BLE001 - only compile time is at stake: build as inductor does
            log.debug("the AOTInductor wrapper compiled whole (%s: %s)", type(err).__name__, err)
        _runtime_of.pop(argv[argv.index("-o") + 1], None)
    elif "-c" not in argv and (split := {arg: _runtime_of.pop(arg) for arg in argv if arg in _runtime_of}):
        last = max(argv.index(arg) for arg in split)
        runtimes = sorted({runtime for runtime, _ in split.values()})
        try:
            _originals["run"](shlex.join([*argv[: last + 1], *runtimes, *argv[last + 1 :]]), cwd)
            return
        except Exception as err:  # noqa: BLE001 - a runtime object that does not link: build whole
            log.debug("the AOTInductor wrapper compiled whole (%s: %s)", type(err).__name__, err)
            for _, whole in split.values():
                _originals["run"](whole, cwd)
    _originals["run"](cmd_line, cwd)


def _install() -> Callable[[], None]:
    import torch._inductor.cpp_builder as builder

    run = _originals["run"] = builder.run_compile_cmd

    def undo() -> None:
        builder.run_compile_cmd = run

    builder.run_compile_cmd = _run_compile_cmd
    return undo


_PATCH = SharedPatch(_install, "the AOTInductor wrapper compiled whole")


def runtime_compiled_once() -> AbstractContextManager[None]:
    """AOTInductor programs compiled inside link one runtime object rather than compiling the
    runtime into each wrapper (SharedPatch)."""
    return _PATCH.active()
