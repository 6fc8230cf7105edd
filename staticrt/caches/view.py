"""What one layer sees of the cache in one step: mistral-inference's CacheView, in fixed shapes.

A step's metadata (positions, write indices, one mask per kind of layer) is computed once, by
`KVCache.begin_step`, and every layer gets a `LayerView` of it. The view decides the order of
reading and writing, so attention reads the same for every cache: whether the layer's K/V
arrived from host memory (offloaded), or is a graph's input (ONNX), is the cache's business.

Where it is exact, a step writes its new entries first and then attends to the buffer alone
(every linear layer; a rotating layer's decode step, whose one overwritten slot held the position
a window back). A rotating layer in a multi-token step instead attends to the buffer as it was
plus the step's own K/V, and writes afterwards: a query early in a long chunk still needs
positions that the chunk's later tokens overwrite. A multi-token step joins the K/V and runs one
fused SDPA (`attend`; a first prefill in causal blocks), whose scores never materialise; a
one-token step, Gemma2's softcapped layers and the sink cache join the two parts' scores
(`scores`, `weigh`). Either way the step's own K/V enter as the cache stores them (`round_trip`:
an int8 cache reads the same either way). Write-first stays the rule elsewhere because a compiled
graph that reads a buffer and then mutates it keeps the old contents alive, and inductor copies
the whole buffer every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class StepMetadata:
    """Computed once per step, shared by every layer (mistral-inference's CacheInputMetadata)."""

    write_index: torch.Tensor  # [B] int64: tokens each row already holds in the cache
    num_new: torch.Tensor  # [B] int64: real tokens each row adds this step (the rest is right padding)
    positions: torch.Tensor  # [B, T] int64: each token's position, for RoPE and masks
    masks: dict[tuple[str, bool], torch.Tensor]  # KVCache.mask_key(layer) -> bool [B, 1, T, L (+ T)]
    # Every row starts at position 0 (a first prefill; known on the host, so each graph is one or
    # the other): the step's own entries are all a query can see, and `attend` reads nothing else.
    fresh: bool = False

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def seq_len(self) -> int:
        """T, the tokens a row holds in this step (1 in decode, a bucket in prefill)."""
        return self.positions.shape[1]


class ViewedCache(Protocol):
    """What a view reads of its cache (base.py's KVCache)."""

    rotating: tuple[bool, ...]

    def mask_key(self, layer_idx: int) -> tuple[str, bool]: ...

    def attention_window(self, attention: str) -> int | None: ...

    def writes_first(self, rotating: bool, seq_len: int) -> bool: ...

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def round_trip(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerView:
    """One layer's cache in one step: its mask, and scores and outputs over its keys and values,
    written first or after as the module docstring says."""

    def __init__(self, cache: ViewedCache, layer_idx: int, meta: StepMetadata) -> None:
        self.cache, self.layer_idx, self.meta = cache, layer_idx, meta
        self.mask = meta.masks[cache.mask_key(layer_idx)]  # [B, 1, T, L] or [B, 1, T, L + T]
        self.writes_first = cache.writes_first(cache.rotating[layer_idx], meta.seq_len)

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`q [B, H_kv, G*T, D]` against the layer's keys `[B, H_kv, L, D]` -> `[B, H_kv, G*T, L]`,
        joined by the scores against the step's own keys `k [B, H_kv, T, D]` where it reads first."""
        meta = self.meta
        if self.writes_first:
            keys, _ = self.cache.update(k, v, self.layer_idx, meta.write_index, meta.num_new)
        else:
            keys, _ = self.cache.layer_buffers(self.layer_idx)
        scores = q @ keys.transpose(-1, -2)
        if not self.writes_first:
            own, _ = self.cache.round_trip(k, v)
            scores = torch.cat([scores, q @ own.transpose(-1, -2)], dim=-1)  # [B, H_kv, G*T, L + T]
        return scores

    fused = True  # `attend` may serve multi-token steps (a view that rewrites scores says False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """`softmax(q K^T * scale + mask) V` in one fused kernel (SDPA, grouped-query), for
        multi-token steps: `scores` then `weigh` would materialise `[B, H_kv, G*T, L (+ T)]` scores
        several times, which dominates a long prefill. `q [B, H, T, D]`, `k`/`v [B, H_kv, T, D]` ->
        `[B, H, T, D]`; written first or after as `scores` and `weigh` are."""
        meta = self.meta
        writes_after = meta.fresh or not self.writes_first
        if meta.fresh:  # the buffer holds nothing this step may see: attend over the step's own K/V
            keys, values = self.cache.round_trip(k, v)
            first = 0 if self.writes_first else self.mask.shape[-1] - meta.seq_len  # their mask columns
            mask = self.mask[..., first : first + meta.seq_len]  # [B, 1, T, T]; slot t holds position t
            window = self.cache.attention_window(self.cache.mask_key(self.layer_idx)[0])
            out = attend_causal_blocks(q, keys, values, mask, scale, window)
        else:
            if writes_after:
                held_k, held_v = self.cache.layer_buffers(self.layer_idx)
                own_k, own_v = self.cache.round_trip(k, v)
                keys, values = torch.cat([held_k, own_k], dim=2), torch.cat([held_v, own_v], dim=2)  # [B, H_kv, L+T, D]
            else:
                keys, values = self.cache.update(k, v, self.layer_idx, meta.write_index, meta.num_new)
            gqa = q.shape[1] != keys.shape[1]  # torch.onnx refuses enable_gqa where the head counts are equal
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        if writes_after:
            self.cache.update(k, v, self.layer_idx, meta.write_index, meta.num_new, after=out)
        return out

    def weigh(self, probs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`probs [B, H_kv, G*T, L (+ T)]` over the layer's values (and the step's own `v`) ->
        `[B, H_kv, G*T, D]`; a step that read first writes its `k`, `v` here, after the read."""
        _, values = self.cache.layer_buffers(self.layer_idx)
        held = values.shape[2]
        out = probs[..., :held] @ values
        if not self.writes_first:
            _, own = self.cache.round_trip(k, v)
            out = out + probs[..., held:] @ own
            self.cache.update(k, v, self.layer_idx, self.meta.write_index, self.meta.num_new, after=out)
        return out


FRESH_BLOCK = 512  # queries a fused attention call of a fresh prefill takes at a time


def attend_causal_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """SDPA of a prefill from position 0 (`q [B, H, T, D]`, `k`/`v [B, H_kv, T, D]`, `mask [B, 1, T, T]`,
    slot t holding position t in every row) in blocks of FRESH_BLOCK queries, each against only the
    keys it may see: up to its last query (causal) and from `window` before its first. With a mask,
    the fused kernel computes every score, the masked half too; the blocks skip what the mask would
    hide (a 4,160-token prefill of bench-llama spent 61% of its time in attention). Exact: a query's
    visible keys all lie in its block's range, so its softmax is over the same scores."""
    seq_len = q.shape[2]
    blocks = []
    for start in range(0, seq_len, FRESH_BLOCK):
        end = min(start + FRESH_BLOCK, seq_len)
        low = 0 if window is None else max(0, start - window + 1)
        blocks.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, low:end],
                v[:, :, low:end],
                attn_mask=mask[:, :, start:end, low:end],
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        )
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)  # [B, H, T, D]
