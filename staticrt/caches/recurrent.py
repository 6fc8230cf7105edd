"""The layers whose cache is a state rather than K/V: LFM2's conv layers (conv_state.py), and
Mamba2 (models/mamba2.py) and gated DeltaNet layers (models/gated_deltanet.py), which keep their
convolution's inputs the same way plus a recurrent state, written in place at a fixed address:
Mamba2's `ssm_{layer}` `[B, H, D, N]`, DeltaNet's `state_{layer}` `[B, Hv, Dk, Dv]`.

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

from ..config import RECURRENT_KINDS, ModelConfig
from ..errors import CacheError
from .conv_state import ConvCache, ConvView, conv_parts
from .view import StepMetadata

Parts = list[tuple[str, tuple[int, ...], torch.dtype]]
STATE_PARTS = ("conv", "ssm", "state")  # the parts `recurrent_parts` names: no dim of theirs counts positions
# The cache kinds that hold recurrent layers: those whose every layer lives on the device in float
# (the offloaded, sink and int8 caches store attention's K/V their own way).
STATE_KINDS = ("static", "sliding", "hybrid")


def check_recurrent_kind(kind: str, config: ModelConfig) -> None:
    """Refuse, before any buffer exists, a cache kind that cannot hold the model's conv, Mamba2 or DeltaNet layers."""
    layers = sorted(set(config.layer_types) & set(RECURRENT_KINDS))
    if layers and kind not in STATE_KINDS:
        fits = [k for k in STATE_KINDS if k == "static" or "sliding_attention" in config.layer_types]
        raise CacheError(
            f"cache {kind!r} cannot hold this {config.family} model's {layers[0]} layers (their state is kept in "
            f"float on the device); use cache={' or '.join(map(repr, fits))}"
        )


def mamba_conv_width(config: ModelConfig) -> int:
    """The channels a Mamba2 layer's convolution runs over: x (H * D), then B and C (G * N each)."""
    c = config
    return c.mamba_heads * c.mamba_head_dim + 2 * c.mamba_groups * c.mamba_state


def deltanet_conv_width(config: ModelConfig) -> int:
    """The channels a gated DeltaNet layer's convolution runs over: q and k (Hk * Dk each), then v (Hv * Dv)."""
    c = config
    return 2 * c.linear_key_heads * c.linear_key_dim + c.linear_value_heads * c.linear_value_dim


def recurrent_parts(kind: str, batch: int, slots: int, config: ModelConfig, dtype: torch.dtype) -> Parts:
    """A recurrent layer's parts (name, shape, dtype): a conv layer's `conv [B, 1, S, C]`; a
    Mamba2 layer's `conv [B, 1, S, conv width]` and `ssm [B, H, D, N]`; a gated DeltaNet layer's
    `conv [B, 1, S, conv width]` and `state [B, Hv, Dk, Dv]`."""
    c = config
    if kind == "conv":
        return conv_parts(batch, slots, c.hidden_size, dtype)
    if kind == "mamba":
        state = (batch, c.mamba_heads, c.mamba_head_dim, c.mamba_state)
        return [*conv_parts(batch, slots, mamba_conv_width(c), dtype), ("ssm", state, dtype)]
    state = (batch, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim)
    return [*conv_parts(batch, slots, deltanet_conv_width(c), dtype), ("state", state, dtype)]


class StateCache(ConvCache, Protocol):
    def write_state(self, layer_idx: int, buf: torch.Tensor, state: torch.Tensor) -> None: ...


class StateView(ConvView):
    """One Mamba2 or DeltaNet layer's cache in one step: its convolution's history (`ConvView`) and its state."""

    def real_tokens(self) -> torch.Tensor:
        """`[B, T]` bool: the step's real tokens (each row's first num_new; the rest is padding)."""
        meta = self.meta
        return torch.arange(meta.seq_len, device=meta.num_new.device)[None, :] < meta.num_new[:, None]

    def one_position(self) -> bool:
        """Whether the step runs the one-position recurrence (decode) rather than the chunked scan."""
        return self.meta.seq_len == 1

    def in_one_chunk(self) -> int | None:
        """None: the chunked scan chunks as transformers does; else it takes the step's T positions
        (at most this many) as one chunk (models/mamba2.py, gated_deltanet.py: the ONNX graph's)."""
        return None

    def state(self) -> torch.Tensor:
        """The state each row continues from (`[B, H, D, N]`; DeltaNet's `[B, Hv, Dk, Dv]`): zeros for
        a row at position 0."""
        meta, buf = self.meta, self.cache.step_buffers(self.layer_idx)[1]
        if meta.fresh:
            return torch.zeros_like(buf)
        return torch.where(
            (meta.write_index == 0)[:, None, None, None], torch.zeros((), dtype=buf.dtype, device=buf.device), buf
        )

    def keep_state(self, state: torch.Tensor) -> None:
        """Keep the state after the step's last real token, in place."""
        self.cache.write_state(self.layer_idx, self.cache.step_buffers(self.layer_idx)[1], state)


def recurrent_view(kind: str, cache: StateCache, layer_idx: int, meta: StepMetadata) -> ConvView:
    return ConvView(cache, layer_idx, meta) if kind == "conv" else StateView(cache, layer_idx, meta)
