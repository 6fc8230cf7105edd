"""staticrt: LLM decoding as a fixed-shape, static-graph program.

The public names are resolved lazily so that `import staticrt` costs nothing and pulls in torch
only when a torch-side name is used.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Ask torch's CPU allocator for transparent huge pages on allocations of 2 MB and up. On 4 KB pages
# a decode step's weight stream runs into the TLB: bench-qwen3-moe, bench-qwen3 and bench-lfm2
# decode 1.2-1.3x faster with it at the same peak RSS (docs/measurements.md). c10 reads the
# variable at its first allocation, so this works when staticrt is imported before any tensor
# exists (every staticrt command); set THP_MEM_ALLOC_ENABLE=0 to keep 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "staticrt.loading.checkpoint",
    "load_config": "staticrt.loading.checkpoint",
    "ModelConfig": "staticrt.config",
    "PRESETS": "staticrt.models.presets",
    "Generator": "staticrt.generation.generator",
    "load_artifact": "staticrt.generation.generator",
    "SamplingParams": "staticrt.generation.params",
    "TokenLogprob": "staticrt.generation.logprobs",
    "Speculation": "staticrt.generation.speculative",
    "Grammar": "staticrt.generation.grammar",
    "json_schema_grammar": "staticrt.generation.grammar",
    "text_grammar": "staticrt.generation.grammar",
    "CacheSpec": "staticrt.caches",
    "StaticCache": "staticrt.caches",
    "SlidingWindowCache": "staticrt.caches",
    "HybridCache": "staticrt.caches",
    "OffloadedStaticCache": "staticrt.caches",
    "OffloadedHybridCache": "staticrt.caches",
    "OffloadWarning": "staticrt.caches",
    "build_cache": "staticrt.caches",
    "StaticrtError": "staticrt.errors",
    "GenerationError": "staticrt.errors",
    "CacheError": "staticrt.errors",
    "ConfigError": "staticrt.errors",
    "CheckpointError": "staticrt.errors",
    "ArtifactError": "staticrt.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'staticrt' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
