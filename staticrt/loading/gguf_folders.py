"""A `.gguf` file wherever a checkpoint folder is taken, as llama.cpp, Ollama and vLLM users expect:
converted once (`staticrt convert`'s float32 folder) into the user's cache, and found there again.

The cache is `artifacts.user_cache.cache_root()`; each
file converts into `gguf/<stem>-<key>/`, where the key hashes the file's resolved path, size and
modification time and staticrt's version: a file replaced or edited in place converts again, and
the old folder stays until the user removes it. The folder is written atomically (a conversion
cut short leaves nothing behind), so one that exists is whole. Imports no torch until it converts.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from .. import __version__
from ..artifacts.user_cache import cache_root

log = logging.getLogger("staticrt")


def converted_folder(gguf: Path) -> Path:
    """The folder `gguf` converts into (it may not exist yet)."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}\0{__version__}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def local_checkpoint(path_or_preset: str | Path) -> str | Path:
    """`path_or_preset` itself, or for a `.gguf` file the checkpoint folder converted from it,
    converting it the first time (tens of seconds for a small model; progress in the log)."""
    path = Path(path_or_preset)
    if path.suffix != ".gguf" or not path.is_file():
        return path_or_preset
    folder = converted_folder(path)
    if folder.is_dir():
        return folder
    from .convert import convert_gguf

    log.info("converting %s once into %s (later runs reuse it)", path, folder)
    start = time.perf_counter()
    convert_gguf(path, folder, lambda stage: log.info("  %s ...", stage))
    log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    return folder
