"""Cold start: seconds from launching a fresh Python process to its first generated token, and
that process's peak RSS, for every way staticrt runs a model (eager, compiled, each program of an
artifact) beside transformers and llama.cpp on the same model, each started twice: cold (empty
compile caches) and warm (the caches its cold start left), one after another in one run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..artifacts.manifest import read_manifest
from ..errors import BenchError
from ..generation.generator import ARTIFACT_BACKENDS
from ..loading.checkpoint import load_model
from .gguf_write import write_gguf
from .machine import machine
from .plan import GGUF_TYPES, gguf_label

# The child runs first_token.py by its path, so that it imports no more than its program needs.
CHILD = f"import runpy; runpy.run_path({str(Path(__file__).with_name('first_token.py'))!r}, run_name='__main__')"
PHASES = ("cold", "warm")


def _transformers_folder(model: str, dtype: str, root: Path) -> str:
    """The checkpoint folder transformers starts from: the recipe's own, or for a preset the
    same weights written with `save_pretrained`."""
    if (Path(model) / "config.json").is_file():
        return model
    from .hf import hf_model_like

    folder = root / "transformers-model"
    hf_model_like(load_model(model, dtype=dtype)).save_pretrained(folder)
    return str(folder)


def _programs(artifact: Path, manifest: dict[str, Any], gguf: Sequence[str], root: Path) -> dict[str, list[str]]:
    """Label -> the child's MODE and SOURCE arguments."""
    recipe = manifest["recipe"]
    spec = {k: recipe[k] for k in ("model", "dtype", "cache", "batch_size", "max_cache_len", "window")}
    spec["prefill_buckets"] = recipe["prefill_buckets"]
    programs = {backend: [backend, json.dumps(spec)] for backend in ("eager", "compiled")}
    programs |= {fmt: [fmt, str(artifact)] for fmt in ARTIFACT_BACKENDS if fmt in manifest["formats"]}
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass  # reported as not run by the caller
    else:
        programs["transformers"] = ["transformers", _transformers_folder(spec["model"], spec["dtype"], root)]
    for source in gguf:
        path = source
        if source in GGUF_TYPES:  # the model written as this GGUF type
            path = str(
                write_gguf(load_model(spec["model"], dtype=spec["dtype"]), root / f"model.{source}.gguf", source)
            )
        programs[gguf_label(source)] = ["llamacpp", path]
    return programs


def _first_token(folder: Path, args: Sequence[str], threads: int | None) -> dict[str, Any]:
    """One fresh child process on the caches in `folder`: seconds from its launch to its first
    token and to its last, its peak RSS and the tokens."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "STATICRT_CACHE": str(folder / "staticrt"),
    }
    env |= {"OMP_NUM_THREADS": str(threads)} if threads else {}
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args, str(threads or 0)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise BenchError(f"cold start of {folder.name} ({' '.join(args)}) failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    times = {"s": out["first_token_at"] - start, "all_tokens_s": out["exit_at"] - start}
    return times | {"peak_rss_mb": out["peak_rss_mb"], "tokens": out["tokens"]}


def cold_start(
    artifact: Path,
    gguf: Sequence[str] = (),
    threads: int | None = None,
    on_stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every program's first token (of first_token.NEW_TOKENS) from a fresh process, cold then
    warm, with its peak RSS (the process's own: compiler subprocesses are not counted).

    Each program gets its own inductor cache folder, a copy of one that holds only the machine's
    CPU-ISA probe (inductor and AOTInductor's loader compile test programs for it once a machine,
    reported as `isa_probe_s`), and its own empty `STATICRT_CACHE`: a cold start reuses no
    compiled graph, a warm one everything its cold start stored. `gguf`: files or GGUF types
    (Q8_0, Q4_0, Q4_1: the artifact's model written so) that llama.cpp starts from.
    """
    manifest = read_manifest(artifact)
    if manifest.get("recipe") is None:
        raise BenchError(f"{artifact} records no recipe (model source); export it with `staticrt export`")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="staticrt-cold-") as folder:
        root = Path(folder)
        programs = _programs(artifact, manifest, gguf, root)

        on_stage("probing the CPU ISA once for every process (inductor caches it per machine)")
        start = time.time()
        subprocess.run(
            [sys.executable, "-c", "from torch._inductor.cpu_vec_isa import pick_vec_isa; pick_vec_isa()"],
            check=True,
            env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "probed")},
        )
        isa_probe_s = time.time() - start
        for i, (label, args) in enumerate(programs.items(), 1):
            shutil.copytree(root / "probed", root / label / "inductor")
            for phase in PHASES:
                on_stage(f"{label} ({i} of {len(programs)}), {phase}: a fresh process to its first token")
                results[label] = results.get(label, {}) | {phase: _first_token(root / label, args, threads)}
    floats = {
        tuple(r[phase]["tokens"])
        for label, r in results.items()
        if programs[label][0] != "llamacpp"
        for phase in PHASES
    }
    return {
        "artifact": str(artifact),
        "model": manifest["recipe"]["model"],
        "cache": manifest["cache"]["kind"],
        "threads": threads,
        "machine": machine() | ({"torch_threads": threads} if threads else {}),  # the children's threads
        "isa_probe_s": isa_probe_s,
        "programs": results,
        "not_run": {} if "transformers" in results else {"transformers": "pip install 'staticrt[hf]'"},
        # every float program's greedy tokens (llama.cpp's weights are its own quantization)
        "tokens_agree": len(floats) == 1,
    }
