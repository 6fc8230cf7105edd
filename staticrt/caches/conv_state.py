"""A short convolution's state (LFM2's conv layers, models/short_conv.py), kept as a rotating
layer's K is: one buffer `conv_{layer}` `[B, 1, S, C]` of the layer's last inputs, slot = position
mod S, written in place at a fixed address by the same write as a sliding layer's (ops.py).

Why positions and not just "the last K - 1 inputs": a row may continue from an earlier position
than the one it reached (a server's next turn that shares all but the last tokens, a speculative
step whose drafts were rejected), and a state that holds only the newest inputs cannot go back. S
slots keep the inputs of S positions, so a step at position P reads P - K + 1 .. P - 1 exactly as
long as nothing written since (positions P .. H, H the furthest the row wrote) landed on them:
H - P <= S - K, prefix.py's rule for a rotating layer of S slots and window K. Worked, K = 3,
S = 4, H = 5: slots 0..3 hold positions 4, 5, 2, 3. From P = 4 the step reads 2 and 3: exact;
from P = 3 it needs 1 (slot 1, which holds 5): not, and prefix.py makes that row prefill again.

Positions below 0 read as zeros, as transformers' convolution pads a sequence's start, so a row
that starts over needs no reset: a prefill at position 0 never reads the slots.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .view import StepMetadata

# Slots a conv layer keeps: K - 1 are read, the rest let a row continue from up to S - K positions
# back (a 64-wide buffer: 61 drafts or a turn's last tokens, for 64 x C floats a row and layer).
CONV_SLOTS = 64


def conv_slots(kernel: int) -> int:
    return max(CONV_SLOTS, kernel)


def conv_parts(batch: int, slots: int, width: int, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    """A convolution's inputs, `conv [B, 1, S, C]`: a rotating layer of one head `width` channels wide."""
    return [("conv", (batch, 1, slots, width), dtype)]


class ConvCache(Protocol):
    def step_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]: ...

    def write(
        self, layer_idx: int, buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor
    ) -> None: ...


class ConvView:
    """One conv layer's cache in one step: the step's inputs with the K - 1 before them."""

    def __init__(self, cache: ConvCache, layer_idx: int, meta: StepMetadata) -> None:
        self.cache, self.layer_idx, self.meta = cache, layer_idx, meta

    def inputs_with_history(self, inputs: torch.Tensor, kernel: int) -> torch.Tensor:
        """`inputs [B, T, C]` (right-padded past each row's `num_new`) -> `[B, K - 1 + T, C]`: each
        row's inputs at positions write_index - K + 1 .. write_index - 1, then the step's. Writes
        the step's real inputs: first in decode (slot P mod S never holds P - K + 1 .. P - 1), after
        reading in a longer step, whose later inputs may land on slots it reads (base.py's rule)."""
        meta, buf = self.meta, self.cache.step_buffers(self.layer_idx)[0]  # buf [B, 1, S, C]
        batch, seq_len, width = inputs.shape
        new = inputs.unsqueeze(1)  # [B, 1, T, C]
        if meta.fresh:  # every row starts at 0: nothing before it but zeros
            history = inputs.new_zeros(batch, kernel - 1, width)
        elif seq_len == 1:
            self.cache.write(self.layer_idx, buf, new, meta.write_index, meta.num_new)
            return self._read(buf, kernel, 1)  # positions P - K + 1 .. P, the step's own last
        else:
            history = self._read(buf, kernel, 0)
        self.cache.write(self.layer_idx, buf, new, meta.write_index, meta.num_new)
        return torch.cat([history, inputs], dim=1)

    def _read(self, buf: torch.Tensor, kernel: int, upto: int) -> torch.Tensor:
        """Each row's inputs at positions write_index - K + 1 .. write_index - 1 + upto (`upto` 1:
        the step's own, written first) -> `[B, K - 1 + upto, C]`, zeros below position 0."""
        offsets = torch.arange(1 - kernel, upto, device=buf.device)  # K = 3, upto 0: [-2, -1]
        positions = self.meta.write_index[:, None] + offsets  # [B, K - 1 + upto]
        rows = torch.arange(buf.shape[0], device=buf.device)[:, None]
        held = buf[rows, 0, torch.remainder(positions, buf.shape[2])]  # [B, K - 1 + upto, C]
        return torch.where((positions >= 0)[..., None], held, torch.zeros((), dtype=buf.dtype, device=buf.device))
