"""A contender is a backend warmed up (compiled, captured) and ready to be timed generation by
generation; staticrt's backends (and ONNX Runtime over a temporary export) are built here,
transformers' in hf.py."""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..caches import CacheSpec, resolve_max_cache_len
from ..model import Decoder
from ..runtime import BACKENDS, Generator


@dataclasses.dataclass
class Contender:
    """`run` times one generation and returns (prefill seconds, median decode seconds a step);
    `report` is what the backend tells of itself once timing is over (cache bytes, GPU time).
    `compile_s` is the warm-up's compile time where the contender measures it apart (None: it
    cannot, as transformers' `generate` compiles inside its first call)."""

    run: Callable[[], tuple[float, float]]
    tokens: list[list[int]]
    warmup_s: float
    report: Callable[[], dict[str, Any]] = dict
    compile_s: float | None = None


def staticrt_contender(
    model: Decoder,
    backend: str,
    prompts: list[list[int]],
    new_tokens: int,
    cache: str = "static",
    max_cache_len: int | None = None,
) -> Contender:
    """A staticrt backend after one warm-up generation (it compiles). The prompt fills its prefill
    bucket exactly, so prefill times carry no padding. Backend "onnx" exports the model with its
    cache to a temporary artifact first and runs it in ONNX Runtime with torch's thread count."""
    needed = len(prompts[0]) + new_tokens
    max_cache_len = resolve_max_cache_len(model.config, cache, max_cache_len, needed=needed)
    if backend == "onnx":
        gen = _onnx_generator(model, CacheSpec(cache, len(prompts), max_cache_len), len(prompts[0]))
    else:
        gen = Generator(
            model,
            cache=cache,
            max_batch_size=len(prompts),
            max_cache_len=max_cache_len,
            backend=backend,
            prefill_buckets=(len(prompts[0]),),
        )
    start = time.perf_counter()
    tokens = gen.generate(prompts, max_new_tokens=new_tokens)
    warmup_s = time.perf_counter() - start

    def run() -> tuple[float, float]:
        gen.generate(prompts, max_new_tokens=new_tokens)
        return gen.last_stats.prefill_s, statistics.median(gen.last_stats.decode_s)

    return Contender(run, tokens, warmup_s, gen.backend.report, gen.last_stats.compile_s)


def _onnx_generator(model: Decoder, spec: CacheSpec, bucket: int) -> Generator:
    from ..exporters import export_artifact

    scratch = Path(tempfile.mkdtemp(prefix="staticrt-bench-onnx-"))
    try:
        folder = export_artifact(model, spec, [bucket], scratch / "artifact", ["onnx"])
        device = next(model.parameters()).device.type
        return Generator(BACKENDS["onnx"].build(folder, "onnx", device=device, threads=torch.get_num_threads()))
    finally:  # the session holds the graph and weights in memory; the files may go
        shutil.rmtree(scratch, ignore_errors=True)
