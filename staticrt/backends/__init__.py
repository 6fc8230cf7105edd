"""Backends by name. Each is imported only when asked for, so a deploy path that needs no
torch never imports it."""

from __future__ import annotations

import importlib
from typing import Any

from ..artifact import ARTIFACT_BACKENDS
from ..generate import GenerationError, StepBackend

BACKENDS = {
    "eager": ("staticrt.backends.eager", "EagerBackend"),
    "compiled": ("staticrt.backends.compiled", "CompiledBackend"),
    "cudagraph": ("staticrt.backends.cudagraph", "CudaGraphBackend"),
    "reduce-overhead": ("staticrt.backends.cudagraph", "ReduceOverheadBackend"),
}
CUDA_ONLY = ("cudagraph", "reduce-overhead")  # on a CPU these run the compiled path


def create_backend(name: str, model: Any, **options: Any) -> StepBackend:
    if name in ARTIFACT_BACKENDS:  # they run exported artifacts: artifact.load_artifact
        raise GenerationError(
            f"backend {name!r} runs an exported artifact, not a model: export one (`staticrt export`, "
            f"format {name}) and load it with staticrt.load_artifact(path, backend={name!r}) or "
            f"`staticrt run ARTIFACT --backend {name}`"
        )
    try:
        module, cls = BACKENDS[name]
    except KeyError:
        raise GenerationError(f"backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)(model, **options)
