"""KV caches and the one place that builds them from a kind name."""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from .base import CacheError, CacheSpec, KVCache, default_max_cache_len
from .hybrid import HybridCache
from .offloaded import OffloadedHybridCache, OffloadedStaticCache, OffloadWarning
from .sliding import SlidingWindowCache
from .static import StaticCache

CACHE_KINDS = {
    "static": StaticCache,
    "sliding": SlidingWindowCache,
    "hybrid": HybridCache,
    "offloaded": OffloadedStaticCache,
    "offloaded-hybrid": OffloadedHybridCache,
}
CACHE_CHOICES = (*CACHE_KINDS, "auto")


def resolve_kind(config: ModelConfig, spec: CacheSpec) -> str:
    """The kind "auto" stands for: what the checkpoint's config implies at this length. Sliding
    layers rotate only when the model's window is shorter than `max_cache_len` (otherwise a
    static buffer already covers it); an explicit `window` is always honoured (and checked)."""
    if spec.kind != "auto":
        return spec.kind
    kinds = set(config.layer_types)
    too_long = spec.window is None and config.sliding_window and config.sliding_window > spec.max_cache_len
    if "sliding_attention" not in kinds or too_long:
        return "static"
    return "sliding" if kinds == {"sliding_attention"} else "hybrid"


def build_cache(
    config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> KVCache:
    """Allocate the cache `spec.kind` names ("auto": see `resolve_kind`), once, for a model of `config`."""
    if spec.kind not in CACHE_CHOICES:
        raise CacheError(f"cache kind {spec.kind!r} is unknown; choose one of {', '.join(CACHE_CHOICES)}")
    kind = resolve_kind(config, spec)
    return CACHE_KINDS[kind](config, dataclasses.replace(spec, kind=kind), dtype, device)


__all__ = [
    "CACHE_CHOICES", "CACHE_KINDS", "CacheError", "CacheSpec", "HybridCache", "KVCache", "OffloadWarning",
    "OffloadedHybridCache", "OffloadedStaticCache", "SlidingWindowCache", "StaticCache", "build_cache",
    "default_max_cache_len", "resolve_kind",
]
