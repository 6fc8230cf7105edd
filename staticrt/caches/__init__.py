"""KV caches and the one place that builds them from a kind name."""

from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import CacheError
from .base import KVCache
from .hybrid import HybridCache
from .offloaded import OffloadedHybridCache, OffloadedStaticCache, OffloadWarning
from .quantized import HybridInt8Cache, SlidingInt8Cache, StaticInt8Cache
from .sink import SinkCache
from .sliding import SlidingWindowCache
from .spec import CACHE_CHOICES, CACHE_KINDS, CacheSpec, resolve_kind, resolve_max_cache_len
from .static import StaticCache
from .view import LayerView, StepMetadata

CACHE_CLASSES: dict[str, type[KVCache]] = {
    "static": StaticCache,
    "sliding": SlidingWindowCache,
    "hybrid": HybridCache,
    "offloaded": OffloadedStaticCache,
    "offloaded-hybrid": OffloadedHybridCache,
    "sink": SinkCache,
    "static-int8": StaticInt8Cache,
    "sliding-int8": SlidingInt8Cache,
    "hybrid-int8": HybridInt8Cache,
}
assert tuple(CACHE_CLASSES) == CACHE_KINDS, "every cache kind spec.py names has one class"


def build_cache(
    config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> KVCache:
    """Allocate the cache `spec.kind` names ("auto": see `resolve_kind`), once, for a model of `config`."""
    kind = resolve_kind(config, spec)
    return CACHE_CLASSES[kind](config, dataclasses.replace(spec, kind=kind), dtype, device)


__all__ = [
    "CACHE_CHOICES",
    "CACHE_CLASSES",
    "CACHE_KINDS",
    "CacheError",
    "CacheSpec",
    "HybridCache",
    "KVCache",
    "LayerView",
    "OffloadWarning",
    "OffloadedHybridCache",
    "OffloadedStaticCache",
    "SinkCache",
    "SlidingWindowCache",
    "StaticCache",
    "StepMetadata",
    "build_cache",
    "resolve_kind",
    "resolve_max_cache_len",
]
