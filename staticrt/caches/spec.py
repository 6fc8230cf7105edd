"""What a cache is asked to be, before any buffer exists: kinds, lengths, windows and their defaults.

Every default a cache takes is decided here, once: `resolve_kind` for "auto", `resolve_max_cache_len`
for a length nobody gave, `cache_window` for the slots of a rotating layer. Nothing here allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import CacheError, as_int

# Cache kinds a user names; "auto" stands for what the config implies (`resolve_kind`).
CACHE_KINDS = (
    "static",
    "sliding",
    "hybrid",
    "offloaded",
    "offloaded-hybrid",
    "sink",
    "static-int8",
    "sliding-int8",
    "hybrid-int8",
)
CACHE_CHOICES = (*CACHE_KINDS, "auto")
ROTATING_KINDS = (
    "sliding",
    "hybrid",
    "offloaded-hybrid",
    "sliding-int8",
    "hybrid-int8",
)  # kinds that give some layers a rotating buffer
DEFAULT_MAX_CACHE_LEN = 1024  # a default Static cache attends over every slot: keep it small


@dataclass(frozen=True)
class CacheSpec:
    """The shape of a cache a Generator asks for; `kind` is one of `CACHE_CHOICES`.

    `window` is the number of slots of rotating layers; None takes the model's `sliding_window`.
    """

    kind: str
    max_batch_size: int
    max_cache_len: int
    window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise CacheError(f"cache is {self.kind!r}; name a kind ({', '.join(CACHE_CHOICES)}) or pass a built cache")
        for name in ("max_batch_size", "max_cache_len", "window"):
            value = getattr(self, name)
            if value is not None or name != "window":  # plain ints from here on; bools and floats refused
                object.__setattr__(self, name, as_int(value, name, error=CacheError))
        if self.max_batch_size < 1:
            raise CacheError(f"max_batch_size is {self.max_batch_size}; it must be at least 1")
        if self.max_cache_len < 1:
            raise CacheError(f"max_cache_len is {self.max_cache_len}; it must be at least 1")
        if self.window is not None and self.window < 1:
            raise CacheError(f"window is {self.window}; a sliding cache needs at least 1 slot a layer")


def resolve_max_cache_len(
    config: ModelConfig,
    kind: str,
    requested: int | None = None,
    needed: int | None = None,
    window: int | None = None,
) -> int:
    """The cache length: `requested` when given; else `needed` (prompt + new tokens, when the
    request is known, as `run` and `bench` know it) or the model's context capped at
    `DEFAULT_MAX_CACHE_LEN`. A kind with rotating layers (and "auto" sized for the whole context,
    so that it can choose one) is never shorter than its window, so the window fits."""
    if requested is not None:
        return requested
    length = needed if needed is not None else min(config.max_position_embeddings, DEFAULT_MAX_CACHE_LEN)
    rotates = kind in ROTATING_KINDS or (kind == "auto" and needed is None)
    if rotates and config.sliding_window:
        length = max(length, window or config.sliding_window)
    return length


def resolve_kind(config: ModelConfig, spec: CacheSpec) -> str:
    """The kind "auto" stands for: what the checkpoint's config implies at this length. Sliding
    layers rotate only when the model's window is shorter than `max_cache_len` (otherwise a
    static buffer already covers it); an explicit `window` is always honoured (and checked)."""
    if spec.kind not in CACHE_CHOICES:
        raise CacheError(f"cache kind {spec.kind!r} is unknown; choose one of {', '.join(CACHE_CHOICES)}")
    if spec.kind != "auto":
        return spec.kind
    attention = set(config.layer_types)
    too_long = spec.window is None and config.sliding_window and config.sliding_window > spec.max_cache_len
    if "sliding_attention" not in attention or too_long:
        return "static"
    return "sliding" if attention == {"sliding_attention"} else "hybrid"


def sliding_layers(config: ModelConfig, kind: str) -> list[int]:
    """The layers that attend through a sliding window; a cache `kind` that rotates some layers
    is refused for a model with none."""
    layers = [i for i, attention in enumerate(config.layer_types) if attention == "sliding_attention"]
    if not layers:
        raise CacheError(
            f"cache {kind!r} gives sliding-window layers a rotating buffer, but no layer of this "
            f"{config.family} model attends through a sliding window; use cache='static'"
        )
    return layers


def cache_window(config: ModelConfig, spec: CacheSpec) -> int:
    """The slots of a rotating layer, checked against the model and `max_cache_len`."""
    window = spec.window if spec.window is not None else config.sliding_window
    if window < config.sliding_window:
        raise CacheError(
            f"window is {window}, smaller than the model's sliding_window {config.sliding_window}; the "
            f"cache would drop positions the model attends to; use window >= {config.sliding_window} "
            "or leave it unset"
        )
    if window > spec.max_cache_len:
        raise CacheError(
            f"window is {window}, larger than max_cache_len {spec.max_cache_len}; a rotating buffer would "
            "hold more than the whole sequence; use cache='static' (it covers the window) or raise "
            f"max_cache_len to at least {window}"
        )
    return window
