"""Static cache: every layer linear, slot j holds position j, up to `max_cache_len`."""

from __future__ import annotations

from ..config import ModelConfig
from .base import KVCache


class StaticCache(KVCache):
    kind = "static"

    @classmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        return [False] * len(config.layer_types)
