"""A contender is a backend warmed up (compiled, captured) and ready to be timed generation by
generation; staticrt's backends (and its artifact runners over a temporary export) are built here,
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

from ..artifacts.manifest import FORMATS
from ..caches import CacheSpec, resolve_max_cache_len
from ..generation.generator import BACKENDS, Generator
from ..models.decoder import Decoder
from ..models.quant_spec import QuantSpec, parse_quantize
from .probes import graph_weight_bytes


@dataclasses.dataclass
class Contender:
    """`run` times one generation and returns (prefill seconds, median decode seconds a step);
    `report` is what the backend tells of itself once timing is over (cache bytes, GPU time).
    `compile_s` is the warm-up's compile time where the contender measures it apart (None: it
    cannot, as transformers' `generate` compiles inside its first call). `weight_bytes` is what a
    step reads of the weights where the contender's own form of them is not the torch model's (an
    ONNX graph's initializers)."""

    run: Callable[[], tuple[float, float]]
    tokens: list[list[int]]
    warmup_s: float
    report: Callable[[], dict[str, Any]] = dict
    compile_s: float | None = None
    weight_bytes: int | None = None


def staticrt_contender(
    model: Decoder,
    backend: str,
    prompts: list[list[int]],
    new_tokens: int,
    cache: str = "static",
    max_cache_len: int | None = None,
    quantize: str = "none",
) -> Contender:
    """A staticrt backend after one warm-up generation (it compiles). The prompt fills its prefill
    bucket exactly, so prefill times carry no padding. Backend "onnx" exports the (float) model
    with its cache, and `quantize`'s weights, to a temporary artifact first and runs it in ONNX
    Runtime with torch's thread count; "aoti" and "pt2" export `model` as it was loaded, as the
    other torch backends take it."""
    needed = len(prompts[0]) + new_tokens
    max_cache_len = resolve_max_cache_len(model.config, cache, max_cache_len, needed=needed)
    weight_bytes = None
    if backend in FORMATS:
        spec = CacheSpec(cache, len(prompts), max_cache_len)
        gen, weight_bytes = exported_generator(model, spec, len(prompts[0]), backend, parse_quantize(quantize))
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

    return Contender(run, tokens, warmup_s, gen.backend.report, gen.last_stats.compile_s, weight_bytes)


def exported_generator(
    model: Decoder, spec: CacheSpec, bucket: int, fmt: str, quantize: QuantSpec | None
) -> tuple[Generator, int | None]:
    """An artifact runner over a temporary export of format `fmt`, and the bytes of weights an
    ONNX graph reads a step (None for the torch formats: the model's own)."""
    from ..exporters import export_artifact

    scratch = Path(tempfile.mkdtemp(prefix=f"staticrt-bench-{fmt}-"))
    try:
        onnx = fmt == "onnx"  # the graph quantizes the float weights itself; the torch formats take them as loaded
        weights = quantize if onnx else None
        folder = export_artifact(model, spec, [bucket], scratch / "artifact", [fmt], quantize=weights)
        if not onnx:
            return Generator(BACKENDS[fmt].build(folder, fmt)), None
        device = next(model.parameters()).device.type
        backend = BACKENDS["onnx"].build(folder, "onnx", device=device, threads=torch.get_num_threads())
        return Generator(backend), graph_weight_bytes(folder / backend.manifest["onnx"]["graph"], spec.max_batch_size)
    finally:  # the runners hold the programs, graph and weights in memory (or mapped); the files may go
        shutil.rmtree(scratch, ignore_errors=True)
