"""The step an ONNX graph holds, in onnxruntime-genai's names: the decoder over a cache whose layers
are the graph's `past` inputs and `present` outputs, indexed by attention-mask column
(onnx_export.py's docstring gives the convention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..caches import KVCache, StepMetadata, masks
from ..caches.ops import tensor_scatter
from ..models.decoder import Decoder


@dataclass
class StepInputs:
    attention_mask: torch.Tensor  # [B, T] int64, 1 where a column holds a real token
    position_ids: torch.Tensor  # [B, S] int64, each new token's position (a hole's means nothing)
    write_index: torch.Tensor  # [B] int64, the column of each row's first new entry (T - S)


class GraphCache(KVCache):
    """A cache whose layers are a graph's inputs (`past`) and outputs (`present`), indexed by mask
    column. It is mixed in before a cache class (`graph_cache`), which decides as it always does
    which layers rotate and how many slots each holds; only the K/V buffers are left out."""

    past: list[tuple[torch.Tensor, ...]]  # per layer, this step's inputs of its parts (`bind`)
    present: dict[int, tuple[torch.Tensor, ...]]  # layer -> its written parts, the step's outputs
    inputs: StepInputs

    def allocate_layer(self, layer_idx: int, shape: tuple[int, ...]) -> None:
        """No buffers: each layer's parts arrive as `past_key_values.{i}.{part}` (`part_layout`)."""

    def bind(self, past: list[torch.Tensor], inputs: StepInputs) -> None:
        """Take this step's inputs: `past` as layer 0's parts (key, value[, key_scale, value_scale]),
        then layer 1's, ...; K and V `[B, H_kv, N_i, D]`."""
        n, layers = len(self.parts), len(self.rotating)
        assert len(past) == n * layers, f"{len(past)} past tensors for {layers} layers of {n} parts"
        self.past = [tuple(past[n * i : n * (i + 1)]) for i in range(layers)]
        self.present = {}
        self.inputs = inputs

    def presents(self) -> list[torch.Tensor]:
        return [t for i in range(len(self.rotating)) for t in self.present[i]]

    def begin_step(
        self, write_index: torch.Tensor, num_new: torch.Tensor, seq_len: int, fresh: bool = False
    ) -> StepMetadata:
        """Lengths live in the attention mask here, and positions are the graph's `position_ids`
        (a padded row's slots and positions differ)."""
        return self.metadata(write_index, num_new, self.inputs.position_ids)

    def writes_first(self, rotating: bool, seq_len: int) -> bool:
        """Rotating layers always attend first: one graph serves every S, decode included."""
        return not rotating

    def step_buffers(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        return self.present.get(layer_idx, self.past[layer_idx])

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(self.step_buffers(layer_idx))

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        write_index: torch.Tensor,
        num_new: torch.Tensor,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """present = TensorScatter(past, new, T - S) for each part; a rotating layer keeps the newest
        min(S, window)."""
        rotating = self.rotating[layer_idx]
        if rotating:
            # entries older than the window, gone anyway: to slice by, and as a device count
            dropped = torch.sym_max(key.shape[2] - self.window, 0)
            write_index = write_index + (device_size(key, 2) - self.window).clamp(min=0)
            key, value = key[:, :, dropped:], value[:, :, dropped:]
        self.present[layer_idx] = tuple(
            tensor_scatter(buf, new, write_index, rotating, after)
            for buf, new in zip(self.past[layer_idx], self.encode(key, value), strict=True)
        )
        return self.layer_buffers(layer_idx)

    def mask(self, attention: str, rotating: bool, positions: torch.Tensor) -> torch.Tensor:
        """`[B, 1, S, L(+S)]`: the columns a layer holds (`masks.key_positions` of the step's
        columns), visible where the mask marks them real and their token position is causal (and
        inside the window) for the query's position. A query always sees its own column, so a
        hole (whose position means nothing) still has one key and softmax stays finite."""
        mask = self.inputs.attention_mask  # [B, T]
        seq_len = positions.shape[1]
        columns = self.inputs.write_index[:, None] + torch.arange(seq_len, device=mask.device)  # [B, S]
        key_columns = self.key_positions(rotating, columns)  # [B, S, K]
        index = key_columns.clamp(min=0).minimum(device_size(mask, 1) - 1).flatten(1)  # [B, S*K], inside [0, T)
        real = (key_columns >= 0) & (mask.gather(1, index).view_as(key_columns) > 0)
        key_pos = (torch.cumsum(mask, dim=1) - 1).gather(1, index).view_as(key_columns)
        window = self.attention_window(attention)
        seen = masks.visible(torch.where(real, key_pos, -1), positions[:, :, None], window)
        return (seen | (key_columns == columns[:, :, None]))[:, None]


def marked_columns(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B]`: columns up to and including each row's last marked one, i.e. T for a mask that ends
    with this step, as genai's growing mask does. A runner that keeps the mask at a fixed width
    (genai's CUDA-graph mode; staticrt's runner, so decode has one shape) leaves zeros after it."""
    columns = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask * columns).amax(dim=1)


def device_size(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor.shape[dim]` as a 0-d int64 tensor counted on `tensor`'s device, for arithmetic with
    device values. ONNX Runtime computes a value taken from a shape on the CPU and copies it to
    the GPU where a device input reads it, and its CUDA graph cannot hold such a copy
    (tests/onnx_host_values.py finds them). Slicing and ranges take shapes as they are."""
    return tensor.new_ones(tensor.shape[dim], dtype=torch.int64).sum()  # ONNX: ReduceSum(ConstantOfShape)


def graph_cache(layout: KVCache) -> GraphCache:
    """A `GraphCache` laid out like the built cache `layout` (same kind, spec, dtype and device)."""
    cls = type(f"Graph{type(layout).__name__}", (GraphCache, type(layout)), {})
    return cls(layout.config, layout.spec, layout.dtype, layout.device)


class OnnxStep(nn.Module):
    """The graph's forward, in genai's names: one step of S tokens a row at columns T - S .. T - 1."""

    def __init__(self, model: Decoder, layout: KVCache) -> None:
        super().__init__()
        self.model = model
        self.cache = graph_cache(layout)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        logits_index: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """`logits_index [L]`: the step's columns to return `indexed_logits [B, L, V]` at, counted
        from its first (negative: from its end); the graph's default is [-1], the last, which is all
        a prefill or decode step needs; a verify step asks for every column. `logits [B, 1, V]` is
        the last of them, a fixed 1 wide: onnxruntime-genai reads a graph whose logits are so as one
        that returns the last column alone, as this one does."""
        # input_ids, position_ids [B, S]; attention_mask [B, T]
        write_index = marked_columns(attention_mask) - device_size(input_ids, 1)  # [B]
        self.cache.bind(list(past), StepInputs(attention_mask, position_ids, write_index))
        # [B, L, V]; the column pick is ONNX's Gather, which counts a negative index from the end
        indexed = self.model(input_ids, write_index, self.cache, last_only=False, columns=logits_index)
        return (indexed.select(1, -1).unsqueeze(1), indexed, *self.cache.presents())
