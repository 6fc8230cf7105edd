"""`staticrt demo`: every backend on a built-in tiny model, exported and run, checked token for token."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

from .console import console, progress, show_table

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 8], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from ..caches import CacheSpec
    from ..exporters import export_artifact
    from ..generation.generator import BACKENDS, MODEL_BACKENDS, Generator, load_artifact
    from ..loading.checkpoint import load_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_model(args.model)
    console.print(f"[bold]staticrt demo[/] on {args.model}: {len(PROMPTS)} prompts, {args.new_tokens} new tokens each")
    scratch = tempfile.TemporaryDirectory()
    artifact = Path(scratch.name) / "demo"
    with progress(
        "exporting torch.export programs and an ONNX graph (AOTInductor packages take a minute "
        "more to build: `staticrt export` makes them)"
    ):
        start = time.perf_counter()
        export_artifact(model, CacheSpec("static", len(PROMPTS), 64), [16], artifact, ["pt2", "onnx"])
    console.print(f"exported pt2 programs and an onnx graph in {time.perf_counter() - start:.1f} s")
    # The CUDA-graph backends replay on a GPU copy of the model; without a GPU they would run the
    # compiled path, which the demo runs already.
    cuda_only = [name for name in MODEL_BACKENDS if BACKENDS[name].cuda_only]
    gpu_model = load_model(args.model, device="cuda") if torch.cuda.is_available() else None
    backends = [name for name in MODEL_BACKENDS if gpu_model is not None or name not in cuda_only]
    if gpu_model is None:
        console.print(f"{', '.join(cuda_only)}: no CUDA device here, where they run the compiled path; skipped")
    makers = {
        name: partial(
            Generator,
            gpu_model if name in cuda_only else model,
            max_batch_size=len(PROMPTS),
            max_cache_len=64,
            backend=name,
        )
        for name in backends
    }
    makers |= {
        "exported-pt2": partial(load_artifact, artifact, "pt2"),
        "onnx": partial(load_artifact, artifact, "onnx"),
    }
    results, rows = {}, []
    for name, make in makers.items():
        with progress(f"{name}: first run (compiles or exports where the backend does)"):
            start = time.perf_counter()
            gen = make()
            gen.generate(PROMPTS, max_new_tokens=args.new_tokens)
            first = time.perf_counter() - start
        results[name] = gen.generate(PROMPTS, max_new_tokens=args.new_tokens)
        stats = gen.last_stats
        decode = stats.decode_ms_per_token  # None with one new token: nothing was decoded
        per_second = len(PROMPTS) * 1000 / decode if decode else "n/a"
        rows.append([name, first, 1000 * stats.prefill_s, decode or "n/a", per_second])
    show_table(
        "tokens/s (decode, batch of 3)", ["backend", "first run s", "prefill ms", "decode ms/step", "tokens/s"], rows
    )
    return _agree(results)


def _agree(results: dict[str, list[list[int]]]) -> int:
    """Print the tokens; exit status 1 when any backend disagrees with the first."""
    reference = next(iter(results.values()))
    for r, tokens in enumerate(reference):
        console.print(f"row {r}: {PROMPTS[r]} -> {tokens}", markup=False, soft_wrap=True)
    if not all(tokens == reference for tokens in results.values()):
        console.print("backends disagree: " + json.dumps(results), style="red", markup=False, soft_wrap=True)
        return 1
    console.print(f"[green]all {len(results)} backends agree token for token[/]")
    return 0
