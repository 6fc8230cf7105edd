"""A rotary embedding's parameters (`RopeConfig`), torch-free: config.py's `ModelConfig` holds them
and the deploy path reads configs without torch; rope.py computes the tables from them."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, as_int, check_positive

ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters after normalising the old (`rope_scaling`) and new
    (`rope_parameters`) spellings of transformers' config.json; each kind's numbers as
    transformers' modeling_rope_utils reads them, resolved once (`attention_factor` included)."""

    theta: float = 10000.0
    kind: str = "default"  # ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the frequencies between these rotation counts are blended
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope: divisors of each frequency, for steps within original_max_position_embeddings and past it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn, longrope)
    # Ministral 3: queries scaled by 1 + beta * log(1 + floor(position / original_max_position_embeddings))
    query_scale_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(
                f"rope type {self.kind!r} is not supported; staticrt implements {', '.join(ROPE_KINDS)} "
                "(running it as another would give wrong tokens)"
            )
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            check_positive(self, f"rope {name}", name)
        as_int(self.original_max_position_embeddings, "rope original_max_position_embeddings", 1, ConfigError)
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"rope high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor}): llama3 scaling blends between them; restore config.json"
            )
        if self.kind == "longrope" and not (self.short_factor and self.long_factor):
            raise ConfigError("rope type longrope needs short_factor and long_factor lists; restore config.json")
