"""An artifact's ONNX graph as ONNX Runtime runs it on this CPU, kept across processes: the
optimized graph with its weights already prepacked, in the user's cache (artifacts/user_cache.py),
`onnx/<key>/`.

ONNX Runtime optimizes the graph and prepacks every MatMulNBits' weights into its kernels' layout
each time a session is made: on the heap, from the artifact's bytes. Asked once to save the
optimized graph with the prepacked weights in its external data file
(`session.save_external_prepacked_constant_initializers`), it maps them from that file in later
sessions instead, each blob at a page-aligned offset (onnx_aligned.py: ONNX Runtime's own layout
crashes MLAS). SmolLM2's int4 artifact (2026-11-30, 2-core AMD EPYC with AVX-512, 2 threads,
docs/measurements.md): session 0.22-0.25 s → 0.15-0.19 s, peak RSS at its end 221 → 139 MiB (the
packed pages are the file's, read as the steps touch them and shared by every process mapping them),
the same tokens. The copy holds the original weights beside the packed ones: about twice the
graph's bytes on disk.

The key hashes the graph's and its data's sha256 (the manifest's, checked at load), the installed
onnxruntime and the CPU's flags: the packed layout is the kernels' choice on this CPU. An entry
is written atomically (artifacts/write.py) by a first session, made from the artifact and let go:
the process then loads the copy as later ones do, so a decode runs at the same speed from the first
process on (the first time, ONNX Runtime's saving session, the re-layout and one more session take
about 1 s for SmolLM2's int4 artifact: its `serve` answers /health 1.8 s after its start then, 0.8 s
later on). An entry that does not match, or that ONNX Runtime cannot load, is written again with a
warning. A cache that cannot be written leaves the session as ONNX Runtime makes it from the
artifact. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..artifacts.user_cache import cache_root, storing
from ..artifacts.write import write_folder
from ..errors import StaticrtError
from ..host import cpuinfo
from .onnx_aligned import ALIGNMENT, align_external_data

log = logging.getLogger("staticrt")

GRAPH, DATA, ENTRY = "model.onnx", "model.onnx.data", "entry.json"


def _fields(graph: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the packed copy of the artifact graph `graph` depends on; `aligned`, the page its blobs
    start on, keeps a copy laid out as ONNX Runtime wrote it (which crashes MLAS) from being loaded."""
    import onnxruntime as ort

    folder = graph.parent.name
    digests = {name: manifest["files"].get(f"{folder}/{name}") for name in (graph.name, f"{graph.name}.data")}
    cpu = hashlib.sha256(f"{platform.machine()} {' '.join(sorted(cpuinfo()[1]))}".encode()).hexdigest()[:16]
    return {"graph": digests, "onnxruntime": ort.__version__, "cpu": cpu, "aligned": ALIGNMENT}


def packed_session(
    graph: Path,
    manifest: dict[str, Any],
    make: Callable[[str, Any], Any],
    options: Callable[[], Any],
    verified: Callable[[], Any] = lambda: None,
) -> Any:
    """A CPU session over the packed copy of `graph`, written first if there is none.

    `make(path, options)` makes the session (the caller's providers and error handling);
    `options()` gives fresh SessionOptions; `verified()` returns once the artifact's files have
    passed their hashes (or raises): a copy is written only from files that did.
    """
    if not storing():  # STATICRT_COMPILE_CACHE=off: packed on the heap, as ONNX Runtime does alone
        return make(str(graph), options())
    fields = _fields(graph, manifest)
    text = json.dumps(fields, sort_keys=True)
    folder = cache_root() / "onnx" / hashlib.sha256(text.encode()).hexdigest()[:24]
    if (folder / ENTRY).is_file():
        try:
            _check(folder, fields)
            return make(str(folder / GRAPH), options())
        except (OSError, ValueError, StaticrtError) as err:
            log.warning("the packed ONNX graph in %s is unusable (%s); writing it again", folder, err)
    made: list[Any] = []
    refused: list[BaseException] = []

    def build(work: Path) -> None:
        asked = options()
        asked.optimized_model_filepath = str(work / GRAPH)
        asked.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA)
        asked.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        asked.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        try:
            verified()
            made.append(make(str(graph), asked))
        except BaseException as err:
            refused.append(err)
            raise
        if (work / DATA).is_file():  # ONNX Runtime writes its blobs off the boundaries MLAS reads them on
            align_external_data(work / GRAPH, work / DATA)
        sizes = {name: (work / name).stat().st_size for name in (GRAPH, DATA) if (work / name).is_file()}
        entry = {"fields": fields, "source": str(graph.parent.parent), "bytes": sizes, "written": time.time()}
        (work / ENTRY).write_text(json.dumps(entry))

    try:
        write_folder(folder, build)
    except (OSError, StaticrtError) as err:
        if refused:  # a file that failed its hash, or the graph itself: the caller's error, as without the cache
            raise
        log.warning("cannot keep a packed copy of %s in %s (%s)", graph, folder, err)
        return made[0] if made else make(str(graph), options())
    made.clear()  # its weights were packed on the heap: the copy's are mapped, as in every later process
    return make(str(folder / GRAPH), options())


def _check(folder: Path, fields: dict[str, Any]) -> None:
    """The entry records these fields and its files have the sizes it recorded: a torn or altered
    file named before ONNX Runtime reads it (its own bounds checks find the rest)."""
    recorded = json.loads((folder / ENTRY).read_text())
    if not isinstance(recorded, dict) or recorded.get("fields") != json.loads(json.dumps(fields)):
        raise ValueError("its entry.json records other fields than this graph's")
    sizes = recorded.get("bytes")
    if not isinstance(sizes, dict) or GRAPH not in sizes:
        raise ValueError("its entry.json records no file sizes")
    for name, size in sizes.items():
        if (folder / name).stat().st_size != size:
            raise ValueError(f"{name} is not the size entry.json records")
