"""KV caches and the one place that builds them from a kind name."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .base import CacheError, CacheSpec, KVCache, default_max_cache_len
from .static import StaticCache

CACHE_KINDS = {"static": StaticCache}


def build_cache(
    config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> KVCache:
    """Allocate the cache `spec.kind` names, once, for a model of `config`."""
    try:
        cls = CACHE_KINDS[spec.kind]
    except KeyError:
        raise CacheError(
            f"cache kind {spec.kind!r} is unknown; choose one of {', '.join(CACHE_KINDS)}"
        ) from None
    return cls(config, spec, dtype, device)


__all__ = ["CACHE_KINDS", "CacheError", "CacheSpec", "KVCache", "StaticCache", "build_cache", "default_max_cache_len"]
