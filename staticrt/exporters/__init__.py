"""Exporters: a model and its cache -> one artifact folder (artifacts/) holding any of the formats
"aoti" and "pt2" (torch_export.py) and "onnx" (onnx_export.py), with one manifest."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..artifacts.manifest import FORMATS
from ..artifacts.write import write_artifact
from ..caches import CACHE_CLASSES, CacheSpec, KVCache, build_cache
from ..caches.quantized import Int8KV
from ..dtypes import dtype_name
from ..errors import ArtifactError
from ..models.decoder import Decoder
from ..models.quant_spec import A8_CHOICES, A8_LAYOUT, QuantSpec, torchao_weights

EXPORTABLE_CACHES = ("static", "sliding", "hybrid", "auto")
INT8_CACHES = tuple(kind for kind, cls in CACHE_CLASSES.items() if issubclass(cls, Int8KV))
Stage = Callable[[str, float], None]  # (what finished, seconds it took)


def export_artifact(
    model: Decoder,
    spec: CacheSpec,
    buckets: Sequence[int],
    target: Path,
    formats: Sequence[str] = FORMATS,
    fields: dict[str, Any] | None = None,
    on_stage: Stage = lambda what, seconds: None,
    extra_files: Callable[[Path], None] = lambda folder: None,
    quantize: QuantSpec | None = None,
) -> Path:
    """Export `model` with a cache of `spec` to the artifact folder `target` (atomically).

    `buckets` are the prompt widths of the torch prefill programs (the ONNX graph takes any).
    `fields` are merged into the manifest (e.g. the recipe); `extra_files(folder)` may add files
    (the tokenizer) before the hashes are taken. The torch formats take `model` as loaded (with
    torchao's int8/int4 weights if it was loaded with `quantize`); `quantize` gives the ONNX graph
    ONNX Runtime's int8/int4 weights (onnx_quantize.py) of the float `model`. Every input is
    checked before anything is built.
    """
    _check_weights(model, quantize, formats)
    cache = _export_cache(model, spec, buckets, formats)
    param = next(model.parameters())
    weights = quantize or model.quantization

    def timed(what: str, run: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = run()
        on_stage(what, time.perf_counter() - start)
        return result

    def build(folder: Path) -> dict[str, Any]:
        manifest: dict[str, Any] = {}
        torch_formats = [f for f in formats if f != "onnx"]
        if torch_formats:
            from ..models.quantize import plain_tensors
            from .torch_export import StepProgram, write_torch

            step = StepProgram(plain_tensors(model) if torchao_weights(model.quantization) else model, cache).eval()
            manifest |= write_torch(folder, step, buckets, torch_formats, timed)
        if "onnx" in formats:
            from .onnx_export import write_onnx

            manifest |= write_onnx(folder, model, cache, timed, quantize)
        extra_files(folder)
        return {
            "versions": _versions(),
            "model": {"config": model.config.to_dict(), "source": getattr(model, "source", None)},
            "cache": _cache_fields(cache),
            "dtype": dtype_name(param.dtype),
            "quantize": weights and weights.name,
            **({"a8_layout": A8_LAYOUT} if weights and weights.name in A8_CHOICES else {}),
            "device": param.device.type,
            "prefill_buckets": sorted(set(buckets)),
            "formats": list(formats),
            **manifest,
            **(fields or {}),
        }

    return write_artifact(target, build)


def check_exportable(quantize: str | None, formats: Sequence[str]) -> None:
    """Refuse quantized weights in the torch formats beside the ONNX graph: the torch programs run
    the weights as loaded (torchao's or staticrt's kernels), the ONNX graph ONNX Runtime's
    quantization of the float weights (onnx_quantize.py), so they are two models and go to two
    artifacts. int8-a8 and int4-a8 call staticrt's own CPU kernels by name, which the torch
    programs can and an ONNX graph cannot."""
    if quantize in A8_CHOICES and "onnx" in formats:
        raise ArtifactError(
            f"quantize {quantize!r} runs in staticrt's own CPU kernels, which an ONNX graph cannot call; export it "
            f"to the torch formats (--format aoti,pt2), or to onnx with --quantize {quantize[:4]} (ONNX Runtime's "
            "int8/int4 weights)"
        )
    torch_formats = [f for f in formats if f != "onnx"]
    if quantize is not None and torch_formats and "onnx" in formats:
        raise ArtifactError(
            f"exporting {quantize} weights to {', '.join(torch_formats)} and onnx in one artifact is not supported: "
            "the torch programs run the weights as loaded (torchao's or staticrt's kernels) and the ONNX graph ONNX "
            "Runtime's quantization of the float weights; export them to two artifacts "
            f"(--format {','.join(torch_formats)}, then --format onnx)"
        )


def _check_weights(model: Decoder, quantize: QuantSpec | None, formats: Sequence[str]) -> None:
    """The ONNX graph quantizes the float model's weights itself; the torch formats export the model as loaded."""
    check_exportable(quantize and quantize.name, formats)
    if model.quantization is not None and model.quantization.activations:
        check_exportable(model.quantization.name, formats)
    if model.quantization is not None and "onnx" in formats:
        raise ArtifactError(
            f"the model was loaded with quantize={model.quantization.name!r}; the ONNX exporter takes the float "
            "model and quantize=, which the ONNX graph applies to its own weights"
        )
    if quantize is not None and "onnx" not in formats and model.quantization != quantize:
        raise ArtifactError(
            f"quantize={quantize.name!r} with format(s) {', '.join(formats)}: the torch formats export the model as "
            f"loaded; load it with quantize={quantize.name!r} (torchao's weights)"
        )


def _export_cache(model: Decoder, spec: CacheSpec, buckets: Sequence[int], formats: Sequence[str]) -> KVCache:
    """The cache the programs are traced with, once every input has been checked."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ArtifactError(f"format(s) {unknown or list(formats)} unknown; choose from {', '.join(FORMATS)}")
    if spec.kind not in EXPORTABLE_CACHES + INT8_CACHES:
        why = "its host transfers live outside the program"
        if spec.kind == "sink":
            why = "the exporters do not write its sink scores yet"
        raise ArtifactError(
            f"cache {spec.kind!r} cannot be exported ({why}); choose one of "
            f"{', '.join(EXPORTABLE_CACHES + INT8_CACHES)}"
        )
    if any(b > spec.max_cache_len for b in buckets):
        raise ArtifactError(f"prefill buckets {list(buckets)} must not exceed max_cache_len {spec.max_cache_len}")
    param = next(model.parameters())
    cache = build_cache(model.config, spec, param.dtype, param.device)
    if "onnx" in formats:
        from .onnx_export import check_onnx_cache
        from .onnx_genai import GENAI_SLACK

        if spec.window is None and cache.window is not None:  # unset: the window plus genai's default slack
            spec = dataclasses.replace(spec, window=cache.window + GENAI_SLACK)
            cache = build_cache(model.config, spec, param.dtype, param.device)
        check_onnx_cache(cache)
    return cache


def _cache_fields(cache: KVCache) -> dict[str, Any]:
    """The manifest's `cache`: what the loader checks requests against."""
    spec = cache.spec
    return {
        "kind": cache.kind,
        "max_batch_size": spec.max_batch_size,
        "max_cache_len": spec.max_cache_len,
        "window": cache.window,
        "max_sequence_len": cache.max_sequence_len,
        "layers": [cache.layer_layout(i) for i in range(len(cache.rotating))],
        "layer_lengths": list(cache.layer_lengths),
    }


def _versions() -> dict[str, str]:
    import onnx

    return {"staticrt": __version__, "torch": torch.__version__, "onnx": onnx.__version__}
