"""Rotary position embeddings as transformers computes them: the default, linear, llama3, yarn and
longrope kinds, a partial rotary (the leading `rotary_dim` dims of each head), and Ministral 3's
position-dependent query scale.

The inverse frequencies are computed once, at build time (`inverse_frequencies`); a step computes
each distinct embedding's tables once for every layer that takes it (`rope_step`). LongRoPE has two
sets of frequencies and transformers picks one per forward pass: the long set once the sequence
runs past `original_max_position_embeddings` (`max(position_ids) + 1 > original`), else the short.
A fixed-shape step picks per row, from the row's last real position in the step, so a row's
tokens never depend on the other rows; for one sequence that is transformers' choice whenever its
prompt is prefilled in one step (a prompt longer than the widest prefill bucket that crosses the
boundary prefills its first chunks with the short set, where transformers' one pass takes the long).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .rope_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int, long: bool = False) -> torch.Tensor:
    """`[rotary_dim // 2]` float32 inverse frequencies, scaled once at build time so the per-step
    graph only multiplies positions by a buffer. `long`: LongRoPE's set for long sequences."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, inv_freq)
    if rope.kind == "yarn":
        return _yarn(rope, inv_freq, rotary_dim)
    if rope.kind == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta**exponents)
    return inv_freq


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the pretraining length are
    interpolated (divided by `factor`), those turning more than `beta_fast` times kept, a linear
    ramp between."""

    def correction(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 where the frequency is kept as it is
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


class RopeStep(NamedTuple):
    """One rotary embedding's tables for a step, shared by the layers that take it."""

    cos: torch.Tensor  # [B, 1, T, R], R the rotary width
    sin: torch.Tensor  # [B, 1, T, R]
    query_scale: torch.Tensor | None  # [B, 1, T, 1] (Ministral 3), else None


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[B, 1, T, R]` for `positions [B, T]` and `inv_freq [R/2]` (or one a row,
    `[B, 1, R/2]`); computed in float32 like transformers, scaled by `attention_factor`, then cast."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rope_step(
    rope: RopeConfig,
    positions: torch.Tensor,  # [B, T]
    last: torch.Tensor | None,  # [B], each row's last real position in the step (LongRoPE's choice)
    inv_freq: torch.Tensor,  # [R/2]
    long_inv_freq: torch.Tensor | None,  # [R/2], LongRoPE's long set
    dtype: torch.dtype,
) -> RopeStep:
    """The step's tables for `rope` (the module docstring says how LongRoPE picks its set)."""
    if long_inv_freq is not None:
        is_long = (last >= rope.original_max_position_embeddings)[:, None, None]  # [B, 1, 1]
        inv_freq = torch.where(is_long, long_inv_freq, inv_freq)  # [B, 1, R/2]
    cos, sin = rope_tables(positions, inv_freq, dtype, rope.attention_factor)
    scale = None
    if rope.query_scale_beta is not None:  # transformers' get_llama_4_attn_scale
        periods = torch.floor(positions / rope.original_max_position_embeddings)
        scale = (1 + rope.query_scale_beta * torch.log(1 + periods))[:, None, :, None].to(dtype)
    return RopeStep(cos, sin, scale)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, D]` rotated by the half-split convention of transformers' `rotate_half`; with
    tables narrower than D (a partial rotary), the leading dims rotate and the rest pass."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
