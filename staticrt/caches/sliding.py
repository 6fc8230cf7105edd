"""SlidingWindow cache: every layer a rotating buffer of `window` slots (slot = position mod
window), for models whose every layer attends through a sliding window (Mistral v0.1 style).
Generation never runs out of room; memory stays at `window` positions a layer."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import CacheError
from .base import KVCache
from .spec import sliding_layers


class SlidingWindowCache(KVCache):
    kind = "sliding"

    @classmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        window_layers = set(sliding_layers(config, cls.kind))
        full = [i for i in range(len(config.layer_types)) if i not in window_layers]
        if full:
            raise CacheError(
                f"cache 'sliding' keeps only the last {config.sliding_window} positions, but layers {full} "
                f"of this {config.family} model attend to every position; use cache='hybrid' (or 'auto')"
            )
        return [True] * len(config.layer_types)
