"""The step an ONNX graph holds, in onnxruntime-genai's names: the decoder over a cache whose layers
are the graph's `past` inputs and `present` outputs, indexed by attention-mask column
(onnx_export.py's docstring gives the convention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..caches import KVCache, LayerView, StepMetadata, masks
from ..caches.conv_state import ConvView
from ..caches.ops import tensor_scatter
from ..caches.recurrent import StateView
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

    def allocate_layer(self, layer_idx: int) -> None:
        """No buffers: each layer's parts arrive as `past_key_values.{i}.{part}` (`layer_parts`)."""

    def bind(self, past: list[torch.Tensor], inputs: StepInputs) -> None:
        """Take this step's inputs: `past` as layer 0's parts (key, value[, key_scale, value_scale];
        a recurrent layer's conv[, ssm]), then layer 1's, ...; K and V `[B, H_kv, N_i, D]`."""
        counts = [len(self.layer_parts(i)) for i in range(len(self.rotating))]
        assert len(past) == sum(counts), f"{len(past)} past tensors for {sum(counts)} parts of {len(counts)} layers"
        ends = [sum(counts[: i + 1]) for i in range(len(counts))]
        self.past = [tuple(past[end - n : end]) for n, end in zip(counts, ends, strict=True)]
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

    def view(self, layer_idx: int, meta: StepMetadata, layer_input: torch.Tensor) -> LayerView | ConvView:
        if layer_idx in self.recurrent:
            view = GraphConvView if self.recurrent[layer_idx] == "conv" else GraphStateView
            return view(self, layer_idx, meta)
        return super().view(layer_idx, meta, layer_input)

    def write_state(self, layer_idx: int, buf: torch.Tensor, state: torch.Tensor) -> None:
        """A Mamba2 layer's `present.{i}.ssm`: the state after the step, beside its conv inputs."""
        self.present[layer_idx] = (self.present[layer_idx][0], state.to(buf.dtype))

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


class GraphConvView(ConvView):
    """A conv layer in the graph (caches/conv_state.py): its buffer of inputs by position is an
    input (`past`) and an output (`present`), and the step's tokens arrive by mask column.

    Rows are left-padded, so a row's new tokens are the step's last columns, at consecutive
    positions up to its last column's (every row's last column is real). Counting back from it,
    column c stands for position last - (S - 1 - c): a hole stands for a position before the row's
    first new token, whose input the buffer holds (zero below 0). Worked, S = 4, K = 3, a row whose
    2 new tokens sit at positions 7 and 8: the columns stand for 5 6 7 8, the window is 3..8, of
    which 3 4 5 6 come from the buffer and 7 8 from the step, and the write puts 5 6 (as read) 7 8
    back at their slots."""

    cache: GraphCache

    def inputs_with_history(self, inputs: torch.Tensor, kernel: int) -> torch.Tensor:
        cache, step = self.cache, self.cache.inputs
        buf = cache.past[self.layer_idx][0]  # [B, 1, N, C]
        batch, seq_len, _ = inputs.shape
        slots = buf.shape[2]
        width = device_size(inputs, 1) + kernel - 1  # K - 1 + S, counted on the device
        positions = step.position_ids[:, -1:] - width + 1 + torch.arange(seq_len + kernel - 1, device=buf.device)
        rows = torch.arange(batch, device=buf.device)[:, None]
        held = buf[rows, 0, torch.remainder(positions, slots)]  # [B, K - 1 + S, C]
        held = torch.where((positions >= 0)[..., None], held, torch.zeros((), dtype=buf.dtype, device=buf.device))
        columns = step.write_index[:, None] + torch.arange(seq_len, device=buf.device)  # [B, S]
        real = step.attention_mask.gather(1, columns) > 0  # [B, S]
        new = torch.where(real[..., None], inputs, held[:, kernel - 1 :])  # [B, S, C]
        window = torch.cat([held[:, : kernel - 1], new], dim=1)  # [B, K - 1 + S, C]
        # the newest min(S, N) columns, from the slot of the first kept one; after the reads of `past`
        dropped = torch.sym_max(seq_len - slots, 0)
        first = positions[:, kernel - 1] + (device_size(inputs, 1) - slots).clamp(min=0)  # [B]
        present = tensor_scatter(buf, new[:, dropped:].unsqueeze(1), torch.remainder(first, slots), True, window)
        cache.present[self.layer_idx] = (present, *cache.past[self.layer_idx][1:])  # a Mamba2 layer's state: later
        return window


class GraphStateView(GraphConvView, StateView):
    """A Mamba2 layer in the graph: its convolution's inputs as a conv layer's (`GraphConvView`), its
    state `past_key_values.{i}.ssm [B, H, D, N]` in and `present.{i}.ssm` out. The holes of a
    left-padded row are no tokens: they get dt 0, so the state passes them unchanged, and one graph
    serves every S, one position included, through the scan over S as one chunk (mamba2.py says why)."""

    def real_tokens(self) -> torch.Tensor:
        step = self.cache.inputs
        columns = step.write_index[:, None] + torch.arange(self.meta.seq_len, device=step.attention_mask.device)
        return step.attention_mask.gather(1, columns) > 0  # [B, S]

    def one_position(self) -> bool:
        return False

    def in_one_chunk(self) -> int | None:
        return self.cache.spec.max_cache_len  # no step writes more positions than a row holds


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
