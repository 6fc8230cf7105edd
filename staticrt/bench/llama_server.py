"""llama.cpp's own `llama-server` as bench-serve's llama.cpp contender (issue 67): the server its
users deploy (a slot a row, continuous batching, each slot's prompt kept for the next request),
not llama-cpp-python's Python server, which answers one request at a time.

It is built once from the llama.cpp sources vendored in the llama-cpp-python sdist of the version
the `llamacpp` extra installed (`pip download --no-binary`), with CMake and `-DGGML_NATIVE=ON`,
into the user cache: `llama.cpp/<version>-<cpu>/` holds `llama-server` and `llama-bench` (and
`build.json`, which makes it an entry `staticrt cache` lists and frees). The folder is written
atomically, so a build cut short leaves nothing; a native build is kept per CPU's flags.
Imports no torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..artifacts.user_cache import cache_root
from ..artifacts.write import write_folder
from ..errors import BenchError, GenerationError
from .server_process import measure_server

BINARIES = ("llama-server", "llama-bench")
# A release build for this CPU (GGML_NATIVE), static, the server and its tools alone; nothing fetched
# from the network (no prebuilt web UI, no HTTPS client)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
)  # fmt: skip


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise BenchError(
            "the llama.cpp contender is built from llama-cpp-python's sources: pip install 'staticrt[llamacpp]'"
        ) from None


def _cpu_key() -> str:
    """A short digest of the CPU's model and flags: a -march=native build runs on such a CPU only."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else os.uname().machine
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def llama_server(on_stage: Callable[[str], None] = lambda _: None) -> Path:
    """The `llama-server` binary for this machine, built first where the cache has none."""
    version = llama_cpp_version()
    folder = cache_root() / "llama.cpp" / f"{version}-{_cpu_key()}"
    if not (folder / "build.json").is_file():
        on_stage(f"building llama.cpp {version}'s llama-server into {folder} (once; minutes on 2 cores)")
        write_folder(folder, lambda out: _build(version, out, on_stage), BenchError)
    return folder / "llama-server"


def _build(version: str, out: Path, on_stage: Callable[[str], None]) -> None:
    """Fetch the sdist, configure and build the two binaries, copy them into `out`."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="staticrt-llama-cpp-") as scratch:
        work = Path(scratch)
        on_stage(f"fetching llama-cpp-python {version}'s sources (pip download --no-binary)")
        _run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
              "--no-deps", "-d", str(work)], "pip download")  # fmt: skip
        [sdist] = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name]
            archive.extractall(work, members=members, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        on_stage("configuring llama.cpp (CMake, GGML_NATIVE)")
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], "cmake configure")
        on_stage(f"compiling {' and '.join(BINARIES)} (minutes)")
        jobs = str(os.cpu_count() or 1)
        _run(["cmake", "--build", str(build), "--config", "Release", "-j", jobs, "--target", *BINARIES], "cmake build")
        for name in BINARIES:
            shutil.copy2(build / "bin" / name, out / name)
    record = {"llama_cpp_python": version, "cpu": _cpu_key(), "build_s": round(time.monotonic() - started, 1)}
    (out / "build.json").write_text(json.dumps(record, indent=1))


def _run(command: list[str], what: str) -> None:
    """`command`, or a BenchError with the end of what it printed."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise BenchError(f"building llama-server: {what} failed (exit {done.returncode}):\n{tail}")


def llama_server_result(request: Any, load: Any, on_stage: Callable[[str], None]) -> dict[str, Any]:
    """bench-serve's `load` (a workload's requests, or the chat workload's conversations) on
    llama-server over `request.model` (a GGUF file), with as many slots as staticrt has rows; an
    `error` entry where it cannot be built or run."""
    try:
        binary = llama_server(on_stage)
        command = llama_server_command(
            binary, request.model, request.max_batch_size, request.max_cache_len, request.threads
        )
        on_stage(f"llama-server ({request.max_batch_size} slots)")
        return measure_server(command, "bench", request, load, "/health")
    except (BenchError, GenerationError) as err:
        return {"error": str(err)}


def llama_server_command(binary: Path, gguf: str, rows: int, context: int, threads: int | None) -> list[str]:
    """llama-server on `gguf` as its users run it for `rows` clients: a slot a row (`-np`), each of
    `context` tokens, continuous batching, each slot's prompt kept for the next request; named
    "bench" as staticrt's server is. bench-serve adds `--port`."""
    command = [str(binary), "--model", gguf, "--alias", "bench", "--host", "127.0.0.1"]
    command += ["--ctx-size", str(rows * context), "--parallel", str(rows), "--cont-batching", "--cache-prompt"]
    return command + (["--threads", str(threads), "--threads-batch", str(threads)] if threads else [])
