"""What every KV cache shares: fixed per-layer buffers, in-place writes, lengths in tensors.

Caches know nothing of backends. A cache is an `nn.Module` whose K/V tensors are registered
buffers allocated once and tagged with `mark_static_address`, so compiled graphs and CUDA graphs
keep their addresses; nothing here ever reassigns them.

Each layer's buffer is laid out one of two ways, and the cache kinds differ only in which layers
get which (static.py, sliding.py, hybrid.py):

- linear: `max_cache_len` slots, slot j holds position j (TensorScatter mode `linear`);
- rotating: `window` slots, slot = position mod window (TensorScatter mode `circular`), as in
  mistral-inference's RotatingBufferCache. Nothing rolls or shifts; a decode step writes one slot.

Where it is exact, a step writes its new entries first and then attends to the buffer alone
(the old order for every linear layer, and for a rotating layer's decode step: the one slot it
overwrites held the position a window back, which the query no longer sees). A rotating layer in
a multi-token step instead attends to the buffer as it was before the step plus the step's own
K/V, and writes afterwards: a query early in a 40-token chunk still needs positions that the
chunk's later tokens overwrite, and reads them before they go. That keeps a window-sized buffer
exact for prefill chunks of any length, with no chunking of prompts and no buffer larger than the
window (the two parts' scores are joined, never the K/V). Read-then-write is not the order for
everything because a compiled graph that reads a buffer and then mutates it keeps the old contents
alive: inductor copies the whole buffer every step (bench-llama, 4128 slots, 2 CPU threads:
decode went from 12.9 to 23 ms/token). In a prefill that copy is noise; in decode it is not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..generate import check_positions
from ..ops import cache_write


class CacheError(ValueError):
    """A cache request that cannot be met, naming the input, the limit and the way out."""


def default_max_cache_len(config: ModelConfig, kind: str = "static") -> int:
    """The cache length used when none is asked for: the model's context, capped so a default
    Static cache (which attends over every slot) stays small, and never below the sliding window
    for caches with rotating layers (so they hold the whole window)."""
    length = min(config.max_position_embeddings, 1024)
    if kind != "static" and config.sliding_window:
        length = max(length, config.sliding_window)
    return length


@dataclass(frozen=True)
class CacheSpec:
    """The shape of a cache a Generator asks for; `kind` is one of `CACHE_KINDS` or "auto".

    `window` is the number of slots of rotating layers; None takes the model's `sliding_window`.
    """

    kind: str
    max_batch_size: int
    max_cache_len: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise CacheError(f"max_batch_size is {self.max_batch_size}; it must be at least 1")
        if self.max_cache_len < 1:
            raise CacheError(f"max_cache_len is {self.max_cache_len}; it must be at least 1")
        if self.window is not None and self.window < 1:
            raise CacheError(f"window is {self.window}; a sliding cache needs at least 1 slot a layer")


def sliding_layers(config: ModelConfig, kind: str) -> list[int]:
    """The layers that attend through a sliding window; a cache `kind` that rotates some layers
    is refused for a model with none."""
    layers = [i for i, layer in enumerate(config.layer_types) if layer == "sliding_attention"]
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


class KVCache(nn.Module, ABC):
    """Per-layer K/V buffers `[B, H_kv, L_layer, D]` plus per-row lengths `[B]`.

    Subclasses only choose which layers rotate (`rotating_layers`); masks and writes follow.
    """

    kind = "base"

    def __init__(
        self, config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        rotating = self.rotating_layers(config)
        if spec.window is not None and not any(rotating):
            raise CacheError(
                f"window={spec.window} has no effect on a {self.kind} cache, whose layers all hold "
                "max_cache_len positions; drop the window or use cache='sliding' or 'hybrid'"
            )
        self.config = config
        self.spec = spec
        self.rotating = tuple(rotating)
        self.window = cache_window(config, spec) if any(rotating) else None
        self.layer_lengths = tuple(self.window if r else spec.max_cache_len for r in self.rotating)
        self.device = torch.device(device)
        self.dtype = dtype
        for i, length in enumerate(self.layer_lengths):
            self.allocate_layer(i, self.layer_shape(length))
        self.register_static("seq_lens", torch.zeros(spec.max_batch_size, dtype=torch.int64, device=device))

    def layer_shape(self, length: int) -> tuple[int, int, int, int]:
        """`[B, H_kv, length, D]`: the shape of one layer's K (and V) buffer."""
        return (self.spec.max_batch_size, self.config.num_kv_heads, length, self.config.head_dim)

    def register_static(self, name: str, tensor: torch.Tensor) -> None:
        """Register a buffer that lives as long as the cache at one address."""
        self.register_buffer(name, tensor)
        torch._dynamo.mark_static_address(tensor)

    def allocate_layer(self, layer_idx: int, shape: tuple[int, ...]) -> None:
        """Allocate layer `layer_idx`'s K/V on the cache's device (offloaded.py puts some on the host)."""
        for name in (f"key_{layer_idx}", f"value_{layer_idx}"):
            self.register_static(name, torch.zeros(shape, dtype=self.dtype, device=self.device))

    @classmethod
    @abstractmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        """Per layer: a rotating buffer of `window` slots (True) or a linear one (False); raises
        CacheError when this kind does not fit the model."""

    @property
    def max_sequence_len(self) -> int | None:
        """Positions a row can reach: None when every layer rotates (generation never runs out)."""
        return None if all(self.rotating) else self.spec.max_cache_len

    def layer_kind(self, layer_idx: int) -> str:
        return "sliding" if self.rotating[layer_idx] else "static"

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V buffers `[B, H_kv, L, D]` a layer writes and attends to, on the cache's device."""
        return getattr(self, f"key_{layer_idx}"), getattr(self, f"value_{layer_idx}")

    def storage_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer `layer_idx`'s K/V is kept between steps: its device buffers here, host
        storage in an offloaded layer."""
        return self.layer_buffers(layer_idx)

    def load_layer(self, layer_idx: int, layer_input: torch.Tensor) -> None:
        """Called as layer `layer_idx` starts attending, once its input `[B, T, C]` exists:
        nothing to do when every layer's K/V is resident on the device (offloaded.py waits here
        for the layer's copy from the host)."""

    def check_step(self, write_index: Sequence[int], steps: int) -> None:
        """Refuse, on the host and before anything runs, a step of `steps` tokens per row at
        `write_index` that would write past a linear layer (a compiled graph cannot raise on data)."""
        check_positions(write_index, steps, self.max_sequence_len, self.kind, CacheError)

    def begin_step(self, write_index: torch.Tensor, num_new: torch.Tensor) -> None:
        """Record each row's length after this step (`write_index + num_new`, both `[B]`)."""
        self.seq_lens.copy_(write_index + num_new)

    def mask_key(self, layer_idx: int) -> tuple[str, bool]:
        """Layers with the same key share one mask: (attention kind, rotating buffer)."""
        return self.config.layer_types[layer_idx], self.rotating[layer_idx]

    def writes_first(self, layer_idx: int, steps: int) -> bool:
        """Whether a step of `steps` tokens writes layer `layer_idx` before attending to it (see
        the module docstring); the order is fixed when the step is traced."""
        return self.layout_writes_first(self.rotating[layer_idx], steps)

    def layout_writes_first(self, rotating: bool, steps: int) -> bool:
        """`writes_first` for a layer of this layout: always for a linear one, in decode for a rotating one."""
        return not rotating or steps == 1

    def attention_masks(self, positions: torch.Tensor) -> dict[tuple[str, bool], torch.Tensor]:
        """Bool per mask key: which slots, and for read-first layers which of the step's T new
        entries, a query at `positions [B, T]` may see: `[B, 1, T, L]` for a layer written
        first, `[B, 1, T, L + T]` (the buffer as it was, then the new entries) otherwise.

        Computed in the graph from positions, so no Python int specialises it: empty slots,
        later positions (right padding sits after every real token) and positions beyond the
        sliding window are hidden.
        """
        keys = {self.mask_key(i) for i in range(len(self.rotating))}
        return {key: self._mask(*key, positions) for key in keys}

    def _mask(self, attention: str, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        keys = self.key_positions(rotating, positions)
        query = positions[:, :, None]  # [B, T, 1]
        visible = (keys >= 0) & (keys <= query)
        if attention == "sliding_attention":
            visible = visible & (query - keys < self.config.sliding_window)
        return visible[:, None]

    def key_positions(self, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        """`[B, T, L]` or `[B, T, L + T]`: the position of every key a layer of this layout
        attends to in a step at `positions [B, T]` (negative for an empty slot)."""
        steps = positions.shape[1]
        write_first = self.layout_writes_first(rotating, steps)
        filled_to = positions[:, 0] + (steps if write_first else 0)  # [B] positions held when attending
        held = self.held_positions(rotating, filled_to)[:, None, :].expand(-1, steps, -1)  # [B, T, L]
        if write_first:
            return held
        return torch.cat([held, positions[:, None, :].expand(-1, steps, -1)], dim=-1)

    def held_positions(self, rotating: bool, filled_to: torch.Tensor) -> torch.Tensor:
        """`[B, L]` int64: the position each slot holds once positions `0 .. filled_to[b] - 1`
        have been written, negative where the slot is still empty."""
        device = filled_to.device
        if not rotating:
            slots = torch.arange(self.spec.max_cache_len, device=device)[None, :]
            return torch.where(slots < filled_to[:, None], slots, -1)
        slots = torch.arange(self.window, device=device)[None, :]
        newest = filled_to[:, None] - 1  # [B, 1]
        # The newest position p <= newest with p = slot (mod window), below 0 when never written:
        # slots up to the newest one's hold this lap, the rest the lap before. One remainder a row,
        # not one a slot: inductor recomputes the mask inside every layer's softmax, and an int64
        # remainder per slot there cost ~1 ms a decode step at a window of 4096.
        lap_start = newest - torch.remainder(newest, self.window)  # [B, 1] position held by slot 0
        return lap_start + slots - self.window * (slots > newest - lap_start)

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> None:
        """Write `key`/`value [B, H_kv, T, D]` in place, before or after attending as
        `writes_first` says.

        `num_new [B]` counts each row's real entries; the rest is right padding. `after` is the
        attention output of a step that attends before it writes; these in-place writes follow it
        anyway (program order), a functional write (`ops.tensor_scatter`) has to be told.
        """
        for buf, new in zip(self.layer_buffers(layer_idx), (key, value)):
            if self.rotating[layer_idx]:
                self._write_rotating(buf, new, write_index, num_new)
            else:
                # Padding lands beyond the row's length, where the mask hides it until a real
                # token overwrites it; `check_step` keeps the write inside the buffer.
                cache_write(buf, new, write_index)

    @staticmethod
    def _write_rotating(buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor) -> None:
        """Write each row's last `m = min(T, window)` real entries, circularly.

        Only the newest `window` positions survive a chunk, and m distinct slots keep the scatter
        free of duplicate indices. Rows with fewer than m real entries (short prompts in a long
        bucket, decode's T = 1 aside) write their slots' old contents back, so right padding never
        overwrites positions the row still needs.
        """
        batch, heads, steps, dim = new.shape
        slots = buf.shape[2]
        if steps == 1:
            # Decode: every row's one entry is real (a step gives each row at least one token), so
            # nothing is written back, and the graph never reads the buffer it mutates (a read
            # would make inductor copy the whole buffer each step, see the module docstring).
            cache_write(buf, new, torch.remainder(write_index, slots), circular=True)
            return
        m = min(steps, slots)
        offsets = torch.arange(m, device=buf.device)
        take = num_new[:, None] - m + offsets  # [B, m] index into the chunk; < 0: keep the old entry
        start = torch.remainder(write_index + num_new - m, slots)  # [B] slot of the first written entry
        fresh = new.gather(2, take.clamp(min=0)[:, None, :, None].expand(batch, heads, m, dim))
        targets = torch.remainder(start[:, None] + offsets, slots)  # [B, m]
        rows = torch.arange(batch, device=buf.device)[:, None]
        old = buf[rows, :, targets].transpose(1, 2)  # [B, H, m, D]
        cache_write(buf, torch.where((take >= 0)[:, None, :, None], fresh, old), start, circular=True)

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens seen per row, `[B]` int64 (a tensor: the graph never specialises on it)."""
        return self.seq_lens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """Slots of layer `layer_idx`: `window` for rotating layers, else `max_cache_len`."""
        return self.layer_lengths[layer_idx]

    def state_buffers(self) -> list[torch.Tensor]:
        """Every buffer the cache holds: K/V storage (and working buffers, where there are any) and the lengths."""
        return list(self.buffers())

    def reset(self) -> None:
        """Zero the state in place; addresses stay valid for captured graphs."""
        for buf in self.state_buffers():
            buf.zero_()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Permute rows in place (beam search): row b takes the contents of row `beam_idx[b]`."""
        for buf in self.state_buffers():
            buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def device_bytes(self) -> int:
        """Bytes the cache holds on its device (K/V, working buffers, lengths)."""
        return sum(_nbytes(b) for name, b in self.named_buffers() if not name.startswith(HOST_PREFIX))

    def host_bytes(self) -> int:
        """Bytes of K/V kept in host memory (an offloaded cache's storage; 0 for the others)."""
        return sum(_nbytes(b) for name, b in self.named_buffers() if name.startswith(HOST_PREFIX))


HOST_PREFIX = "host_"  # buffers named so live in host memory, whatever the cache's device


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
