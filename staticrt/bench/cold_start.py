"""Cold start: seconds from launching a fresh Python process to its first generated token, with an
artifact's programs against the compiled backend on the same model (which compiles)."""

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
from ..generation.generator import Generator, load_artifact
from ..loading.checkpoint import load_model


def first_token_main(argv: Sequence[str] | None = None) -> None:
    """Child process of `cold_start`: build the generator named on the command line, generate
    one token a row, print the wall-clock time (time.time()) at which the first one arrived."""
    mode, source = (argv or sys.argv[1:])[:2]
    stamp: list[float] = []
    if mode == "compiled":
        spec = json.loads(source)
        model = load_model(spec["model"], dtype=spec["dtype"])
        gen = Generator(
            model,
            cache=spec["cache"],
            max_batch_size=spec["batch_size"],
            max_cache_len=spec["max_cache_len"],
            window=spec["window"],
            backend="compiled",
            prefill_buckets=spec["prefill_buckets"],
        )
    else:
        gen = load_artifact(source, backend=mode)
    gen.generate([[1, 2, 3]], max_new_tokens=1, stream=lambda row, token: stamp or stamp.append(time.time()))
    print(json.dumps({"first_token_at": stamp[0]}))


def cold_start(
    artifact: Path, formats: Sequence[str] = ("aoti",), on_stage: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Seconds from launching a fresh Python process to its first generated token: with the
    artifact's programs, and with the compiled backend on the same model and cache spec.

    Each process gets its own copy of an inductor cache folder that holds only the machine's
    CPU-ISA probe (which inductor, and AOTInductor's loader, compile test programs for once per
    machine, reported as `isa_probe_s`), so the compiled backend reuses no compiled
    graph and the artifact no loader state: program-cold, machine-warm.
    """
    manifest = read_manifest(artifact)
    recipe = manifest.get("recipe")
    if recipe is None:
        raise BenchError(f"{artifact} records no recipe (model source); export it with `staticrt export`")
    spec = {
        k: recipe[k] for k in ("model", "dtype", "cache", "batch_size", "max_cache_len", "window", "prefill_buckets")
    }
    runs = {fmt: [fmt, str(artifact)] for fmt in formats} | {"compiled": ["compiled", json.dumps(spec)]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        probed = Path(root) / "probed"

        def child(code: str, args: Sequence[str], cache: Path) -> subprocess.CompletedProcess:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
            done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise BenchError(f"cold start child {' '.join(args) or code} failed:\n{done.stderr[-2000:]}")
            return done

        on_stage("probing the CPU ISA once for every process (inductor caches it per machine)")
        start = time.time()
        child("from torch._inductor.cpu_vec_isa import pick_vec_isa; pick_vec_isa()", [], probed)
        results["isa_probe_s"] = time.time() - start
        for label, args in runs.items():
            on_stage(f"cold start: {label} in a fresh process")
            cache = Path(shutil.copytree(probed, Path(root) / label))
            start = time.time()
            done = child("from staticrt.bench.cold_start import first_token_main; first_token_main()", args, cache)
            results[f"{label}_s"] = json.loads(done.stdout.strip().splitlines()[-1])["first_token_at"] - start
    for fmt in formats:
        results[f"compiled_over_{fmt}"] = results["compiled_s"] / results[f"{fmt}_s"]
    return {"artifact": str(artifact), "cache": manifest["cache"]["kind"], "model": recipe["model"], **results}
