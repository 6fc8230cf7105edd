"""Where staticrt keeps what it builds for later processes, and what `staticrt cache` lists and frees.

The cache is `$STATICRT_CACHE`, else `$XDG_CACHE_HOME/staticrt`, else `~/.cache/staticrt`. Each
kind of entry has its own folder: `gguf/` (checkpoints converted from a .gguf file,
loading/gguf_folders.py), `graphs/` (compiled step graphs, backends/graph_store.py), `onnx/`
(artifacts' ONNX graphs with their weights packed for this CPU, backends/onnx_packed.py) and
`llama.cpp/` (bench-serve's contender, bench/llama_server.py). Every entry is a folder written
atomically (write.py), so one that exists is whole; an entry is known by the file staticrt wrote
into it (`MARKERS`), and nothing else under the cache is ever removed.
Imports no torch.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .write import remove_stale

# The file that makes a folder of each kind an entry staticrt wrote.
MARKERS = {"gguf": "config.json", "graphs": "entry.json", "onnx": "entry.json", "llama.cpp": "build.json"}


def cache_root() -> Path:
    """Where staticrt keeps what it builds for later processes."""
    if os.environ.get("STATICRT_CACHE"):
        return Path(os.environ["STATICRT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "staticrt"


def storing() -> bool:
    """Whether compiled graphs and ONNX Runtime's packed graphs are kept for later processes:
    `STATICRT_COMPILE_CACHE=off` (or 0, no, false) makes each process build its own and store nothing."""
    return os.environ.get("STATICRT_COMPILE_CACHE", "on").lower() not in ("0", "off", "no", "false")


@dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch: the marker's access time, else its modification time


def entries(kind: str | None = None) -> list[Entry]:
    """The entries of `kind` (every kind when None), most recently used first."""
    found = []
    for name in [kind] if kind else MARKERS:
        folder = cache_root() / name
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            marker = path / MARKERS[name]
            if path.name.startswith(".") or path.is_symlink() or not marker.is_file():
                continue
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            found.append(Entry(name, path, size, max(marker.stat().st_atime, marker.stat().st_mtime)))
    return sorted(found, key=lambda e: -e.last_used)


def clear(kind: str | None = None, older_than_days: float | None = None) -> list[Entry]:
    """Remove the entries of `kind` (every kind when None), or only those unused for
    `older_than_days`, and what killed writers left beside them; return the removed entries.
    A process that has an entry loaded keeps running: its files are mapped, and unlinking a
    mapped file frees its blocks only when the process lets go."""
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400
    removed = []
    for entry in entries(kind):
        if cutoff is not None and entry.last_used > cutoff:
            continue
        remove_stale(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry)
    return removed
