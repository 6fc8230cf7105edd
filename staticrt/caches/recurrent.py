"""The layers whose cache is a state rather than K/V: LFM2's conv layers (conv_state.py) and
Mamba2 layers (models/mamba2.py), which keep their convolution's inputs the same way plus a
recurrent state `ssm_{layer}` `[B, H, D, N]`, written in place at a fixed address.

A recurrent state is the state after every position the row has fed, and cannot go back: a row
continues exactly only from where it stopped (prefix.py's layout (0, 0)): a conversation's next
turn, never a shorter shared prefix, which is prefilled again, nor a verify step's rejected
drafts (speculation is refused for these models). Two rules keep it exact without the host's help:
a step at position 0 starts from zeros (a row that starts over needs no reset), and a row whose
`num_new` is 0 (a server's row sitting out a step) keeps its state bit for bit, since the scan
gives its padding a zero time step (dt 0: the state decays by exp(0) = 1 and takes in 0).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import ModelConfig
from .conv_state import ConvCache, ConvView, conv_parts
from .view import StepMetadata

Parts = list[tuple[str, tuple[int, ...], torch.dtype]]


def mamba_conv_width(config: ModelConfig) -> int:
    """The channels a Mamba2 layer's convolution runs over: x (H * D), then B and C (G * N each)."""
    c = config
    return c.mamba_heads * c.mamba_head_dim + 2 * c.mamba_groups * c.mamba_state


def recurrent_parts(kind: str, batch: int, slots: int, config: ModelConfig, dtype: torch.dtype) -> Parts:
    """A recurrent layer's parts (name, shape, dtype): a conv layer's `conv [B, 1, S, C]`; a
    Mamba2 layer's `conv [B, 1, S, conv width]` and `ssm [B, H, D, N]`."""
    if kind == "conv":
        return conv_parts(batch, slots, config.hidden_size, dtype)
    c = config
    state = (batch, c.mamba_heads, c.mamba_head_dim, c.mamba_state)
    return [*conv_parts(batch, slots, mamba_conv_width(c), dtype), ("ssm", state, dtype)]


class StateCache(ConvCache, Protocol):
    def write_state(self, layer_idx: int, buf: torch.Tensor, state: torch.Tensor) -> None: ...


class MambaView(ConvView):
    """One Mamba2 layer's cache in one step: its convolution's history (`ConvView`) and its state."""

    def real_tokens(self) -> torch.Tensor:
        """`[B, T]` bool: the step's real tokens (each row's first num_new; the rest is padding)."""
        meta = self.meta
        return torch.arange(meta.seq_len, device=meta.num_new.device)[None, :] < meta.num_new[:, None]

    def one_position(self) -> bool:
        """Whether the step runs the one-position recurrence (decode) rather than the chunked scan."""
        return self.meta.seq_len == 1

    def in_one_chunk(self) -> bool:
        """Whether the chunked scan takes the step's T positions as one chunk (models/mamba2.py)."""
        return False

    def state(self) -> torch.Tensor:
        """The state each row continues from, `[B, H, D, N]`: zeros for a row at position 0."""
        meta, buf = self.meta, self.cache.step_buffers(self.layer_idx)[1]
        if meta.fresh:
            return torch.zeros_like(buf)
        return torch.where((meta.write_index == 0)[:, None, None, None], torch.zeros((), dtype=buf.dtype), buf)

    def keep_state(self, state: torch.Tensor) -> None:
        """Keep the state after the step's last real token `[B, H, D, N]`, in place."""
        self.cache.write_state(self.layer_idx, self.cache.step_buffers(self.layer_idx)[1], state)


def recurrent_view(kind: str, cache: StateCache, layer_idx: int, meta: StepMetadata) -> ConvView:
    return ConvView(cache, layer_idx, meta) if kind == "conv" else MambaView(cache, layer_idx, meta)
