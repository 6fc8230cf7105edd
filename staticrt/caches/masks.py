"""Which position each cache slot holds, and which of them a query may see: pure arithmetic on
position tensors, computed inside the graph so no Python int specialises it.

A layer's buffer is linear (slot j holds position j) or rotating (`slots` slots, slot = position
mod slots). Worked by hand for a rotating buffer of 4 slots after positions 0..5 were written
(`filled_to` = 6): the newest position is 5, in slot 1; slots 0..1 hold this lap (4, 5), slots
2..3 the lap before (2, 3): `held_positions` = [4, 5, 2, 3]. After only positions 0..1
(`filled_to` = 2): [0, 1, -2, -1], negative where a slot was never written.
"""

from __future__ import annotations

import torch


def held_positions(filled_to: torch.Tensor, slots: int, rotating: bool, sinks: int = 0) -> torch.Tensor:
    """`[B, slots]` int64: the position each slot holds once positions `0 .. filled_to[b] - 1`
    have been written (`filled_to [B]`), negative where the slot is still empty. With `sinks` (an
    attention-sink layout, sink.py), slots `0 .. sinks - 1` hold those positions for good and the
    other slots rotate over the positions after them."""
    if sinks:
        kept = held_positions(filled_to, sinks, False)
        rest = held_positions(filled_to - sinks, slots - sinks, True)
        return torch.cat([kept, torch.where(rest >= 0, rest + sinks, -1)], dim=-1)
    index = torch.arange(slots, device=filled_to.device)[None, :]
    if not rotating:
        return torch.where(index < filled_to[:, None], index, -1)
    newest = filled_to[:, None] - 1  # [B, 1]
    # The newest position p <= newest with p = slot (mod slots): slots up to the newest one's hold
    # this lap, the rest the lap before. One remainder a row, not one a slot: inductor recomputes
    # the mask inside every layer's softmax, and a remainder per slot there is costly at large windows.
    lap_start = newest - torch.remainder(newest, slots)  # [B, 1] position held by slot 0
    return lap_start + index - slots * (index > newest - lap_start)


def key_positions(
    positions: torch.Tensor, slots: int, rotating: bool, writes_first: bool, sinks: int = 0
) -> torch.Tensor:
    """`[B, T, slots]`, or `[B, T, slots + T]` for a step that reads before it writes (the buffer
    as it was, then the step's own T entries): the position of every key a query at
    `positions [B, T]` is scored against (negative for an empty slot)."""
    seq_len = positions.shape[1]
    # [B] positions held when attending (positions run consecutively: the last + 1 is the first + T)
    filled_to = positions[:, -1] + 1 if writes_first else positions[:, 0]
    held = held_positions(filled_to, slots, rotating, sinks)[:, None, :].expand(-1, seq_len, -1)  # [B, T, slots]
    if writes_first:
        return held
    return torch.cat([held, positions[:, None, :].expand(-1, seq_len, -1)], dim=-1)


def visible(keys: torch.Tensor, query: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool, `keys`' shape: a key at position `keys [B, T, K]` is seen by the query at `query
    [B, T, 1]` when it exists, is not later, and (with a `window`) is less than `window` back.
    Right padding sits after every real token, so causality alone hides it."""
    seen = (keys >= 0) & (keys <= query)
    if window is not None:
        seen = seen & (query - keys < window)
    return seen
