"""The checks of a config's recurrent layers (LFM2's convolutions, Mamba2, gated DeltaNet; Falcon-H1's
Mamba2 beside attention), run by `ModelConfig` before any weight is read. Torch-free, as config.py:
the deploy path reads configs."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, as_int

# A Mamba2 layer's output: RMSNorm of y * silu(z) (Mamba2, Granite), RMSNorm of y then times silu(z),
# or y * silu(z) without a norm (Falcon-H1's mamba_rms_norm false)
MAMBA_NORMS = ("gated", "gate_after", "none")
RECURRENT_KINDS = ("conv", "mamba", "deltanet")  # the layers whose cache is a state, not K/V (caches/recurrent.py)


def check_recurrent_layers(c: Any) -> None:
    """Each recurrent layer kind's fields of `c` (a ModelConfig being built: config.py imports this
    module, never the reverse) in their ranges; raises ConfigError naming the field."""
    recurrent = sorted(set(c.layer_types) & set(RECURRENT_KINDS))
    if recurrent and not (isinstance(c.conv_kernel, int) and c.conv_kernel >= 1):
        raise ConfigError(
            f"layer_types has {recurrent[0]} layers but conv_kernel is {c.conv_kernel!r}; restore config.json"
        )
    if "mamba" in c.layer_types:
        for name in ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups", "mamba_chunk"):
            as_int(getattr(c, name), name, 1, ConfigError)
        if c.mamba_heads % c.mamba_groups:
            raise ConfigError(
                f"mamba_n_groups ({c.mamba_groups}) must divide mamba_n_heads ({c.mamba_heads}); restore config.json"
            )
    if "deltanet" in c.layer_types:
        for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim"):
            as_int(getattr(c, name), name, 1, ConfigError)
        if c.linear_value_heads % c.linear_key_heads:
            raise ConfigError(
                f"linear_num_key_heads ({c.linear_key_heads}) must divide linear_num_value_heads "
                f"({c.linear_value_heads}); restore config.json"
            )
    if c.mamba_norm not in MAMBA_NORMS:
        raise ConfigError(f"mamba_norm {c.mamba_norm!r} is not one of {list(MAMBA_NORMS)}")
    if c.ssm_multipliers and len(c.ssm_multipliers) != 5:
        raise ConfigError(f"ssm_multipliers holds {len(c.ssm_multipliers)} values (z, x, B, C, dt: 5)")
