"""Tensor primitives shared by every cache. The cache write has the semantics of ONNX
`TensorScatter` (opset 24) so that one eager implementation maps onto one ONNX op."""

from __future__ import annotations

import torch


def cache_write(buffer: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, circular: bool = False) -> None:
    """Write `new [B, H, T, D]` into `buffer [B, H, L, D]` in place at rows' slots
    `write_index[b] .. write_index[b] + T - 1` (TensorScatter mode `linear`), or those slots
    modulo L (mode `circular`).

    In linear mode the caller guarantees `write_index[b] + T <= L`; a compiled graph cannot raise
    on data, so the bound is checked on the host before the step. In circular mode T <= L keeps
    the slots distinct.
    """
    batch, _, seq_len, _ = new.shape
    rows = torch.arange(batch, device=buffer.device)[:, None]  # [B, 1]
    slots = write_index[:, None] + torch.arange(seq_len, device=buffer.device)  # [B, T]
    if circular:
        slots = torch.remainder(slots, buffer.shape[2])
    # Advanced indices on dims 0 and 2 with a slice between put the indexed dims first: [B, T, H, D].
    buffer[rows, :, slots] = new.transpose(1, 2)


def write_rotating(buf: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor) -> None:
    """Write each row's last `m = min(T, window)` real entries of `new [B, H, T, D]`, circularly.

    Only the newest `window` positions survive a chunk, and m distinct slots keep the scatter
    free of duplicate indices. Rows with fewer than m real entries (short prompts in a long
    bucket) write their slots' old contents back, so right padding never overwrites positions
    the row still needs.
    """
    batch, heads, seq_len, dim = new.shape
    slots = buf.shape[2]
    if seq_len == 1:
        # Decode: every row's one entry is real (a step gives each row at least one token), so
        # nothing is written back, and the graph never reads the buffer it mutates (a read would
        # make inductor copy the whole buffer each step, see view.py).
        cache_write(buf, new, torch.remainder(write_index, slots), circular=True)
        return
    m = min(seq_len, slots)
    offsets = torch.arange(m, device=buf.device)
    take = num_new[:, None] - m + offsets  # [B, m] index into the chunk; < 0: keep the old entry
    start = torch.remainder(write_index + num_new - m, slots)  # [B] slot of the first written entry
    fresh = new.gather(2, take.clamp(min=0)[:, None, :, None].expand(batch, heads, m, dim))
    targets = torch.remainder(start[:, None] + offsets, slots)  # [B, m]
    rows = torch.arange(batch, device=buf.device)[:, None]
    old = buf[rows, :, targets].transpose(1, 2)  # [B, H, m, D]
    cache_write(buf, torch.where((take >= 0)[:, None, :, None], fresh, old), start, circular=True)


@torch.library.custom_op("staticrt::tensor_scatter", mutates_args=())
def tensor_scatter(
    past: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor, circular: bool, after: torch.Tensor | None
) -> torch.Tensor:
    """`cache_write` as a function, `present = TensorScatter(past, update, write_indices)`, for
    programs whose cache is an input and an output (the ONNX graphs) rather than a buffer.

    `after` (or None) is a tensor the write must follow: a runner that binds past and present to
    one buffer (ONNX Runtime's IOBinding, onnxruntime-genai's shared buffer) overwrites `past` as
    the write runs, so a step that still reads `past` elsewhere (a rotating layer attending before
    it writes) passes the result of that read here and the translation makes the write wait for it.
    """
    present = past.clone()
    cache_write(present, update, write_indices, circular)
    return present


@tensor_scatter.register_fake
def _tensor_scatter_fake(past, update, write_indices, circular, after):  # noqa: ANN001, ANN202
    return torch.empty_like(past)


def onnx_translations() -> dict:
    """`torch.onnx.export`'s `custom_translation_table` for staticrt's ops: `tensor_scatter` is
    the standard `TensorScatter` (opset 24) on the sequence axis. Imports onnxscript, so only
    exporters call it."""
    import onnx
    from onnxscript import values

    op = values.Opset("", 24)

    def tensor_scatter_onnx(past, update, write_indices, circular: bool, after=None):  # noqa: ANN001, ANN202
        if after is not None:
            # x < x is false for every x (NaN included) but depends on x, and no optimiser folds
            # it: a zero the write has to wait for.
            first = op.Slice(
                op.Reshape(after, op.Constant(value_ints=[-1])),
                op.Constant(value_ints=[0]),
                op.Constant(value_ints=[1]),
            )
            write_indices = op.Add(write_indices, op.Cast(op.Less(first, first), to=onnx.TensorProto.INT64))
        return op.TensorScatter(past, update, write_indices, mode="circular" if circular else "linear", axis=2)

    return {torch.ops.staticrt.tensor_scatter.default: tensor_scatter_onnx}
