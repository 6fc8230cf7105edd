"""A Python-wrapper graph's C++ kernels built as a few libraries, not one library a kernel.

Inductor builds each kernel of a CPU graph whose wrapper is Python (a layers-once prefill graph,
graph_policy.py) as its own library: one g++ a kernel, each reading the 140 MB precompiled
header and instantiating ATen's vector templates again (~0.6-1 s a kernel on 2 cores; a
tiny model's prefill graph has 14 kernels, a real model's as many, since its layers share one
region). Here the kernels a generated module defines (`AsyncCompile.cpp_pybinding`, each call
answered with a future) are compiled together when the module waits for them
(`AsyncCompile.wait`): as many libraries as inductor has compile threads, so that a machine with
many cores still builds them side by side. 14 kernels in one g++: 3.4 s against 19 s one by one
(2-core AMD EPYC, docs/measurements.md).

Each kernel stays as inductor wrote it, in a namespace of its own (its entry `kernel` loses
`extern "C"`, so the entries do not collide), with inductor's own Python binding renamed
`kernel_{i}`; one `PyInit_kernel` gathers the bindings. Torch does not promise these names:
where a kernel does not have the expected shape, or the library fails to build, that module's
kernels are built as inductor builds them (same kernels, slower to compile).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .shared_patch import SharedPatch

log = logging.getLogger("staticrt")

_ENTRY = re.compile(r'extern "C"(\s+[^(]*\bkernel\()')
_HOISTED = ("#include", "#define PY_SSIZE_T_CLEAN")


def _library_source(kernels: list[tuple[list[str], str]], numbers: range) -> str | None:
    """One translation unit for kernels `numbers` of `kernels` ((argtypes, source) each), or None
    where a kernel's entry is not the one `extern "C" ... kernel(` inductor writes."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

    hoisted: dict[str, None] = {}
    parts, gathers = [], []
    for i in numbers:
        argtypes, source = kernels[i]
        if len(_ENTRY.findall(source)) != 1:
            return None
        parseargs = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes))
        binding = Bindings.suffix_template.format(
            arg_len=len(argtypes),
            call_entry_func=Bindings.call_entry_function.format(parseargs),
            entry_func=f"kernel_{i}",
            extra_parse_arg=Bindings.extra_parse_arg.format(array_len=-1),
        )
        body = []
        for line in (_ENTRY.sub(r"\1", source) + binding).splitlines():
            if line.strip().startswith(_HOISTED):
                hoisted[line.strip()] = None  # before any namespace, once: as in a one-kernel library
            else:
                body.append(line)
        parts.append(f"namespace staticrt_kernel_{i} {{\n" + "\n".join(body) + "\n}")
        gathers.append(
            f"    part = staticrt_kernel_{i}::PyInit_kernel_{i}();\n"
            f'    if (part == NULL || PyModule_AddObject(module, "kernel_{i}", part) < 0) {{\n'
            "        Py_XDECREF(part); Py_DECREF(module); return NULL;\n    }"
        )
    gather = (
        "PyMODINIT_FUNC PyInit_kernel(void) {\n"
        '    static struct PyModuleDef library = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, NULL};\n'
        "    PyObject* module = PyModule_Create(&library);\n"
        "    if (module == NULL) return NULL;\n"
        "    PyObject* part;\n" + "\n".join(gathers) + "\n    return module;\n}\n"
    )
    return "\n".join([*hoisted, *parts, gather])


class _Module:
    """The kernels one generated module defines, built into libraries at its first `result()`."""

    def __init__(self, original: Callable[[list[str], str], Any]) -> None:
        self.original = original  # inductor's own cpp_pybinding, bound to the module's AsyncCompile
        self.kernels: list[tuple[list[str], str]] = []
        self.functions: list[Callable[..., Any]] | None = None

    def function(self, i: int) -> Callable[..., Any]:
        if self.functions is None:
            try:
                self.functions = self._build()
            except Exception as err:  # noqa: BLE001 - only compile time is at stake: build as inductor does
                log.debug("kernels built one library each (%s: %s)", type(err).__name__, err)
            if self.functions is None:
                self.functions = [_resolved(self.original(*kernel)) for kernel in self.kernels]
        return self.functions[i]

    def _build(self) -> list[Callable[..., Any]] | None:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache as Bindings

        count = len(self.kernels)
        libraries = max(1, min(get_compile_threads(), count))
        groups = [range(g * count // libraries, (g + 1) * count // libraries) for g in range(libraries)]
        sources = [_library_source(self.kernels, numbers) for numbers in groups]
        if any(source is None for source in sources):
            return None
        # Side by side in inductor's pool; with one compile thread (a 1-CPU machine, or
        # TORCHINDUCTOR_COMPILE_THREADS=1) each when loaded, as inductor does: there `submit` runs
        # the build at once, inside the file lock load_async holds, which the build takes again.
        submit = AsyncCompile.submit if libraries > 1 else None
        loads = [Bindings.load_async(source, "cpu", submit_fn=submit) for source in sources]
        functions = []
        for numbers, load in zip(groups, loads, strict=True):
            library = load()
            functions += [getattr(getattr(library, f"kernel_{i}"), f"kernel_{i}") for i in numbers]
        return functions


def _resolved(kernel: Any) -> Callable[..., Any]:
    """What inductor's cpp_pybinding gave, a function or a future of one, as the function."""
    from torch._inductor.codecache import CodeCacheFuture

    return kernel.result() if isinstance(kernel, CodeCacheFuture) else kernel


def _future_class() -> type:
    from torch._inductor.codecache import CodeCacheFuture

    class Kernel(CodeCacheFuture):
        """Kernel `i` of a module's libraries; inductor's `wait` resolves it as its own futures."""

        def __init__(self, module: _Module, i: int) -> None:
            self.module, self.i = module, i

        def result(self, timeout: float | None = None) -> Callable[..., Any]:
            return self.module.function(self.i)

    return Kernel


def _install() -> Callable[[], None]:
    from torch._inductor.async_compile import AsyncCompile

    Kernel = _future_class()
    cpp_pybinding, wait = AsyncCompile.cpp_pybinding, AsyncCompile.wait

    def batched_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
        module = self.__dict__.get("_staticrt_kernels")
        if module is None:
            module = self.__dict__["_staticrt_kernels"] = _Module(cpp_pybinding.__get__(self))
        module.kernels.append((list(argtypes), source_code))
        return Kernel(module, len(module.kernels) - 1)

    def resolving_wait(self: Any, scope: dict[str, Any]) -> None:
        # inductor resolves futures only with compile threads; these are resolved in every case
        for name, value in list(scope.items()):
            if isinstance(value, Kernel):
                scope[name] = value.result()
        wait(self, scope)

    def undo() -> None:
        AsyncCompile.cpp_pybinding, AsyncCompile.wait = cpp_pybinding, wait

    AsyncCompile.cpp_pybinding, AsyncCompile.wait = batched_pybinding, resolving_wait
    return undo


_PATCH = SharedPatch(_install, "kernels built one library each")


def few_kernel_libraries() -> AbstractContextManager[None]:
    """Graphs compiled inside build their Python-wrapper kernels as a few libraries: any graph
    it touches compiles to the same kernels, only in fewer libraries (SharedPatch)."""
    return _PATCH.active()
