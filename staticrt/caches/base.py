"""What every KV cache shares: fixed per-layer buffers, in-place writes, lengths in tensors.

Caches know nothing of backends. A cache is an `nn.Module` whose K/V tensors are registered
buffers allocated once and tagged with `mark_static_address`, so compiled graphs and CUDA graphs
keep their addresses; nothing here ever reassigns them.

Each layer's buffer is laid out one of two ways, and the cache kinds differ only in which layers
get which (static.py, sliding.py, hybrid.py):

- linear: `max_cache_len` slots, slot j holds position j (TensorScatter mode `linear`);
- rotating: `window` slots, slot = position mod window (TensorScatter mode `circular`), as in
  mistral-inference's RotatingBufferCache. Nothing rolls or shifts; a decode step writes one slot.
  A conv layer (LFM2) keeps its last inputs in one rotating buffer (conv_state.py), a Mamba2
  layer those and its recurrent state (recurrent.py).

A step starts with `begin_step` (lengths, masks: `StepMetadata`) and each layer then works through
its `view` (view.py), which also says why a step writes before or after it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from ..config import RECURRENT_KINDS, ModelConfig
from ..errors import CacheError, check_positions
from . import masks
from .conv_state import ConvView, conv_slots
from .ops import cache_write, write_rotating
from .recurrent import check_recurrent_kind, recurrent_parts, recurrent_view
from .row_state import CacheRows
from .spec import CacheSpec, cache_window
from .view import LayerView, StepMetadata


class KVCache(CacheRows, nn.Module, ABC):
    """Per-layer K/V buffers `[B, H_kv, L_layer, D]` plus per-row lengths `seq_lens [B]`.

    Subclasses only choose which layers rotate (`rotating_layers`); masks and writes follow.
    """

    kind = "base"
    sinks = 0  # slots that keep the first positions for good (the sink cache's; sink.py)
    parts = ("key", "value")  # what a layer stores, each a buffer `{part}_{layer}` (`part_layout`)

    def __init__(
        self, config: ModelConfig, spec: CacheSpec, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        rotating = self.rotating_layers(config)
        check_recurrent_kind(self.kind, config)
        if spec.window is not None and not any(rotating):
            raise CacheError(
                f"window={spec.window} has no effect on a {self.kind} cache, whose layers all hold "
                "max_cache_len positions; drop the window or use cache='sliding' or 'hybrid'"
            )
        self.config = config
        self.spec = spec
        self.recurrent = {i: kind for i, kind in enumerate(config.layer_types) if kind in RECURRENT_KINDS}
        conv = [i in self.recurrent for i in range(len(config.layer_types))]  # their inputs rotate (conv_state.py)
        self.rotating = tuple(r or c for r, c in zip(rotating, conv, strict=True))
        self.window = self.rotating_slots(config, spec) if any(rotating) else None
        slots = conv_slots(config.conv_kernel)
        self.layer_lengths = tuple(
            slots if c else self.window if r else spec.max_cache_len for r, c in zip(rotating, conv, strict=True)
        )
        self.device = torch.device(device)
        self.dtype = dtype
        self.host_names: set[str] = set()  # buffers kept in host memory, whatever the cache's device
        for i in range(len(config.layer_types)):
            self.allocate_layer(i)
        self.register_static("seq_lens", torch.zeros(spec.max_batch_size, dtype=torch.int64, device=device))

    @classmethod
    @abstractmethod
    def rotating_layers(cls, config: ModelConfig) -> list[bool]:
        """Per layer: a rotating buffer of `window` slots (True) or a linear one (False); raises
        CacheError when this kind does not fit the model."""

    def rotating_slots(self, config: ModelConfig, spec: CacheSpec) -> int:
        """The slots of a rotating layer: the spec's window, else the model's (`cache_window`)."""
        return cache_window(config, spec)

    def layer_shape(self, length: int) -> tuple[int, int, int, int]:
        """`[B, H_kv, length, D]`: the shape of one layer's K (and V) buffer."""
        return (self.spec.max_batch_size, self.config.num_kv_heads, length, self.config.head_dim)

    def register_static(self, name: str, tensor: torch.Tensor, host: bool = False) -> None:
        """Register a buffer that lives as long as the cache at one address (`host`: in host memory)."""
        self.register_buffer(name, tensor)
        torch._dynamo.mark_static_address(tensor)
        if host:
            self.host_names.add(name)

    def part_layout(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """What a layer whose K (and V) is `shape` stores, part by part: (name, shape, dtype), in
        the order `encode` returns them. A float cache stores K and V as they are (quantized.py
        adds scales); each part is a buffer `{name}_{layer}`, and an input of the ONNX graph."""
        return [(part, shape, self.dtype) for part in self.parts]

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A step's `key`/`value [B, H_kv, T, D]` as stored, one tensor a part of `part_layout`."""
        return key, value

    def decode(self, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's stored parts -> the K/V `[B, H_kv, L, D]` attention reads."""
        key, value = parts
        return key, value

    def round_trip(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's own K/V as a later step reads them back: a step that attends before it writes
        (view.py) sees its own entries as one that writes first does, whatever the cache stores."""
        return self.decode(self.encode(key, value))

    def layer_parts(self, layer_idx: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Layer `layer_idx`'s parts as `part_layout` says, or a recurrent layer's (recurrent.py):
        each a buffer `{name}_{layer}` and an ONNX graph's input."""
        if layer_idx in self.recurrent:
            batch, slots = self.spec.max_batch_size, self.layer_lengths[layer_idx]
            return recurrent_parts(self.recurrent[layer_idx], batch, slots, self.config, self.dtype)
        return self.part_layout(self.layer_shape(self.layer_lengths[layer_idx]))

    def allocate_layer(self, layer_idx: int) -> None:
        """Allocate layer `layer_idx`'s parts on the cache's device (offloaded.py puts some on the host)."""
        for part, shape, dtype in self.layer_parts(layer_idx):
            self.register_static(f"{part}_{layer_idx}", torch.zeros(shape, dtype=dtype, device=self.device))

    @property
    def max_sequence_len(self) -> int | None:
        """Positions a row can reach: None when every layer rotates (generation never runs out)."""
        return None if all(self.rotating) else self.spec.max_cache_len

    def layer_layout(self, layer_idx: int) -> str:
        """How layer `layer_idx` keeps its K/V: "static" (linear), "sliding" (rotating), "offloaded";
        a recurrent layer its state: "conv", "mamba" or "deltanet" (recurrent.py)."""
        if layer_idx in self.recurrent:
            return self.recurrent[layer_idx]
        return "sliding" if self.rotating[layer_idx] else "static"

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V buffers `[B, H_kv, L, D]` a layer writes and attends to, on the cache's device."""
        return getattr(self, f"key_{layer_idx}"), getattr(self, f"value_{layer_idx}")

    def step_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """The buffers a step writes layer `layer_idx`'s `encode`d parts into, on the cache's device
        (a recurrent layer's inputs, then its state)."""
        if layer_idx in self.recurrent:
            return tuple(getattr(self, f"{part}_{layer_idx}") for part, _, _ in self.layer_parts(layer_idx))
        return self.layer_buffers(layer_idx)

    def storage_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Where layer `layer_idx`'s parts are kept between steps, K first: its device buffers
        here, host storage in an offloaded layer."""
        return self.step_buffers(layer_idx)

    def layer_bytes(self, layer_idx: int) -> int:
        """Bytes layer `layer_idx` keeps its parts in (K, V, and scales where there are any)."""
        return sum(_nbytes(t) for t in self.storage_buffers(layer_idx))

    def check_step(self, write_index: Sequence[int], seq_len: int) -> None:
        """Refuse, on the host and before anything runs, a step of `seq_len` tokens a row at
        `write_index` that would write past a linear layer (a compiled graph cannot raise on data)."""
        check_positions(write_index, seq_len, self.max_sequence_len, self.kind, CacheError)

    def begin_step(
        self, write_index: torch.Tensor, num_new: torch.Tensor, seq_len: int, fresh: bool = False
    ) -> StepMetadata:
        """Start a step of `seq_len` tokens a row at `write_index [B]`, `num_new [B]` of them real
        (`fresh`: every write_index is 0, `StepMetadata.fresh`): record each row's length after
        it, and compute what every layer's view shares."""
        self.seq_lens.copy_(write_index + num_new)
        positions = write_index[:, None] + torch.arange(seq_len, device=write_index.device)  # [B, T]
        return self.metadata(write_index, num_new, positions, fresh)

    def metadata(
        self, write_index: torch.Tensor, num_new: torch.Tensor, positions: torch.Tensor, fresh: bool = False
    ) -> StepMetadata:
        """The step's `StepMetadata`: one mask for each kind of layer, at `positions [B, T]`."""
        mask_keys = {self.mask_key(i) for i in range(len(self.rotating)) if i not in self.recurrent}
        masks = {key: self.mask(*key, positions) for key in mask_keys}
        return StepMetadata(write_index, num_new, positions, masks, fresh)

    def view(self, layer_idx: int, meta: StepMetadata, layer_input: torch.Tensor) -> LayerView | ConvView:
        """Layer `layer_idx`'s view of this step, once its input `[B*T, C]` exists (an offloaded
        layer's K/V is awaited here, after the previous layer's compute)."""
        if layer_idx in self.recurrent:
            return recurrent_view(self.recurrent[layer_idx], self, layer_idx, meta)
        return LayerView(self, layer_idx, meta)

    def mask_key(self, layer_idx: int) -> tuple[str, bool]:
        """Layers with the same key share one mask: (attention kind, rotating buffer)."""
        return self.config.layer_types[layer_idx], self.rotating[layer_idx]

    def writes_first(self, rotating: bool, seq_len: int) -> bool:
        """Whether a step of `seq_len` tokens writes a layer of this layout before attending to
        it (view.py says why): always for a linear one, in decode for a rotating one."""
        return not rotating or seq_len == 1

    def mask(self, attention: str, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        """Bool `[B, 1, T, L]`, or `[B, 1, T, L + T]` for a step that reads first: which slots
        (then which of the step's own entries) a query at `positions [B, T]` may see."""
        keys = self.key_positions(rotating, positions)
        return masks.visible(keys, positions[:, :, None], self.attention_window(attention))[:, None]

    def key_positions(self, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        """`masks.key_positions` for a layer of this layout in a step at `positions [B, T]`."""
        slots = self.window if rotating else self.spec.max_cache_len
        writes_first = self.writes_first(rotating, positions.shape[1])
        return masks.key_positions(positions, slots, rotating, writes_first, self.sinks)

    def attention_window(self, attention: str) -> int | None:
        """How far back a layer of this attention kind sees: the model's window, or everything."""
        return self.config.sliding_window if attention == "sliding_attention" else None

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key`/`value [B, H_kv, T, D]` of a step at `write_index [B]` (`num_new [B]` real
        entries a row, the rest right padding) in place; return the layer's K/V buffers.

        `after` is the attention output a read-first write must follow; in-place writes follow it
        anyway (program order), a functional write (the ONNX graph's) has to be told.
        """
        for buf, new in zip(self.step_buffers(layer_idx), self.encode(key, value), strict=True):
            self.write(layer_idx, buf, new, write_index, num_new)
        return self.layer_buffers(layer_idx)

    def write(
        self, layer_idx: int, buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor
    ) -> None:
        """Write a step's entries `new [B, H, T, *]` into `buf [B, H, L, *]` as layer `layer_idx`'s
        layout says: linear at `write_index`, or rotating (`ops.write_rotating`)."""
        if self.rotating[layer_idx]:
            write_rotating(buf, new, write_index, num_new)
        else:
            # Padding lands beyond the row's length, where the mask hides it until a real
            # token overwrites it; `check_step` keeps the write inside the buffer.
            cache_write(buf, new, write_index)

    def write_state(self, layer_idx: int, buf: torch.Tensor, state: torch.Tensor) -> None:
        """Keep a Mamba2 or DeltaNet layer's state after a step in its buffer, in place."""
        buf.copy_(state.to(buf.dtype))

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens seen per row, `[B]` int64 (a tensor: the graph never specialises on it)."""
        return self.seq_lens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """Slots of layer `layer_idx`: `window` for rotating layers, else `max_cache_len`."""
        return self.layer_lengths[layer_idx]

    def device_bytes(self) -> int:
        """Bytes the cache holds on its device (K/V, working buffers, lengths)."""
        return sum(_nbytes(b) for name, b in self.named_buffers() if name not in self.host_names)

    def host_bytes(self) -> int:
        """Bytes of K/V kept in host memory (an offloaded cache's storage; 0 for the others)."""
        return sum(_nbytes(b) for name, b in self.named_buffers() if name in self.host_names)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
