"""Attention-sink cache (StreamingLLM, Xiao et al. 2023): the first positions are kept for good,
the rest of each layer is a rotating window, and generation never runs out.

Every layer holds `max_cache_len` slots: slots 0 .. S-1 hold positions 0 .. S-1 (the sinks,
S = `SINK_TOKENS`), the other R = max_cache_len - S slots rotate over the positions after them
(slot = S + (p - S) mod R). A query at position q sees the sinks and the positions q - R < p <= q.

StreamingLLM gives RoPE the positions *within the cache*: once n > max_cache_len tokens were
seen, the cache is [sinks, the newest R positions], and each key's position is its index there.
Keys here are stored as every cache stores them, rotated at their absolute position. For a
recent key the two agree, as RoPE sees only the distance q - p, the same in both numberings.
Only a sink's distance differs: q's index in the cache is q - e (e = evicted positions, q + 1 -
max_cache_len once positive) while the sink keeps index p. So the view scores the sink slots
with the query rotated back by e (RoPE is a rotation: R(-e) R(q) = R(q - e)), and nothing on the
host re-rotates any key. Worked by hand, 6 slots, S = 2, after positions 0..8 (q = 8): held are
0, 1 and 5..8; e = 3; cache indices 0, 1 and 2..5; q's index 5; distances 5, 4 to the sinks
(8 - 3 - 0, 8 - 3 - 1) and 3, 2, 1, 0 to 5..8, as q - p.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import CacheError
from ..rope import apply_rope, inverse_frequencies, rope_tables
from . import masks
from .base import KVCache
from .ops import cache_write
from .recurrent import check_recurrent_kind
from .spec import CacheSpec
from .view import LayerView, StepMetadata

SINK_TOKENS = 4  # StreamingLLM's default: four initial tokens hold most of the attention sink


class SinkCache(KVCache):
    kind = "sink"
    sinks = SINK_TOKENS

    def __init__(
        self, config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        check_recurrent_kind(self.kind, config)  # a recurrent layer first: it, not the rotary, is what to name
        rope = config.rope
        uniform = config.ropes == (rope,) and not config.nope_layers
        if not uniform or rope.kind == "longrope" or rope.attention_factor != 1 or rope.query_scale_beta:
            raise CacheError(
                f"the sink cache rotates queries back by one rotary embedding shared by every layer; this "
                f"{config.family} model's layers take {len(config.ropes)} ({rope.kind}, some without one, "
                "or scaled by position): use cache='static', or 'sliding'/'hybrid' where it has windows"
            )
        super().__init__(config, spec, dtype, device)
        # RoPE's frequencies, to rotate a query back by the evicted positions (a constant, not state).
        self.inv_freq = inverse_frequencies(rope, config.rotary_dim).to(device)

    @classmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        return [True] * len(config.layer_types)

    def rotating_slots(self, config: ModelConfig, spec: CacheSpec) -> int:
        """Every slot of the layer, sinks included: `max_cache_len`, which must leave room to rotate."""
        if spec.window is not None:
            raise CacheError(
                f"window={spec.window} has no meaning for a sink cache, whose layers hold max_cache_len slots: "
                f"{self.sinks} sinks and the newest max_cache_len - {self.sinks} positions; drop the window"
            )
        if spec.max_cache_len <= self.sinks:
            raise CacheError(
                f"max_cache_len is {spec.max_cache_len}; a sink cache keeps {self.sinks} sink positions and "
                f"needs room after them: use max_cache_len > {self.sinks}"
            )
        return spec.max_cache_len

    def layer_layout(self, layer_idx: int) -> str:
        return "sink"

    def evicted(self, positions: torch.Tensor) -> torch.Tensor:
        """`[B, T]`: positions dropped from the window when the query at `positions [B, T]` runs,
        which is how far its index in the cache lies behind its position."""
        return (positions + 1 - self.window).clamp(min=0)

    def mask(self, attention: str, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        """`KVCache.mask`, and of the positions past the sinks only the newest R = slots - S."""
        keys = self.key_positions(rotating, positions)
        query = positions[:, :, None]
        seen = masks.visible(keys, query, self.attention_window(attention))
        return (seen & ((keys < self.sinks) | (query - keys < self.window - self.sinks)))[:, None]

    def view(self, layer_idx: int, meta: StepMetadata, layer_input: torch.Tensor) -> LayerView:
        return SinkView(self, layer_idx, meta)

    def write(
        self, layer_idx: int, buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor
    ) -> None:
        _write_with_sinks(buf, new, write_index, num_new, self.sinks)


class SinkView(LayerView):
    """A sink layer's view: scores against the sinks use the query rotated back by the evicted
    positions (the module docstring says why)."""

    fused = False  # its scores are rewritten, so they are computed apart

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = super().scores(q, k, v)  # [B, H_kv, G*T, L (+ T)]; G*T: the T queries of each group
        cache, positions = self.cache, self.meta.positions
        group = q.shape[2] // positions.shape[1]
        cos, sin = rope_tables(-cache.evicted(positions), cache.inv_freq, q.dtype)  # [B, 1, T, D]
        q_back = apply_rope(q, cos.repeat(1, 1, group, 1), sin.repeat(1, 1, group, 1))
        keys, _ = cache.layer_buffers(self.layer_idx)
        sinks, held = cache.sinks, keys.shape[2]
        parts = [q_back @ keys[:, :, :sinks].transpose(-1, -2), scores[..., sinks:held]]
        if not self.writes_first:  # the step's own keys: those at sink positions are sinks too
            is_sink = (positions < sinks)[:, None, None, :]  # [B, 1, 1, T]
            parts.append(torch.where(is_sink, q_back @ k.transpose(-1, -2), scores[..., held:]))
        return torch.cat(parts, dim=-1)


def _write_with_sinks(
    buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor, sinks: int
) -> None:
    """Write the real entries of `new [B, H, T, D]` at positions `write_index[b] + t` into the sink
    layout of `buf [B, H, L, D]`: position p < S in slot p, later ones in slot S + (p - S) mod R.
    A decode step writes its one slot; a longer step gives each slot the newest of its entries
    that lands there (older ones in the same chunk were overwritten) and keeps the rest."""
    batch, heads, seq_len, dim = new.shape
    slots, rotating = buf.shape[2], buf.shape[2] - sinks
    if seq_len == 1:
        slot = torch.where(write_index < sinks, write_index, sinks + torch.remainder(write_index - sinks, rotating))
        cache_write(buf, new, slot, circular=True)
        return
    end = (write_index + num_new)[:, None]  # [B, 1]: one past each row's last real position
    index = torch.arange(slots, device=buf.device)[None, :]  # [1, L]
    lap = torch.div(end - 1 - index, rotating, rounding_mode="floor")  # newest lap that reaches slot s
    position = torch.where(index < sinks, index, index + rotating * lap)  # [B, L]
    landed = (index < sinks) | (position >= sinks)  # a rotating slot no position of the chunk reaches: none
    fresh = landed & (position >= write_index[:, None]) & (position < end)
    source = (position - write_index[:, None]).clamp(0, seq_len - 1)
    chunk = new.gather(2, source[:, None, :, None].expand(batch, heads, slots, dim))
    buf.copy_(torch.where(fresh[:, None, :, None], chunk, buf))
