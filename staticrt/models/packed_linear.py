"""Linear weights packed once for oneDNN's CPU GEMM, one copy that every stored CPU graph reads.

Inductor's freezing packs a decode graph's weights too, but each frozen graph then holds its own
packed copy, and an AOTInductor library holding them is mapped from its file and copied into the
runner's memory at load: SmolLM2's 666 MB of packed weights counted twice at a warm start, beside
the 517 MB of float weights prefill reads (2.23 GB peak against the eager backend's 0.99 GB). A
packed twin of the model instead holds each packed matrix as a parameter: a graph traced over it
calls oneDNN's linear on that parameter, AOTInductor stores the graph without weights, and every
loaded graph is handed the twin's tensors (graph_store.py), so all graphs share them. A process
whose model is its own (the CLI's, `load_model(packed=True)`) packs the model itself (`pack` in
place): the float matrices are let go and the weights are held once.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..host import return_freed_memory
from . import packed_gemv
from .decoder import Decoder
from .moe import Experts
from .packed_experts import packed_experts
from .packed_gemv import packed_bytes

# oneDNN lays a weight out for the rows it expects; every count from 2 up gives one layout, which
# multiplies one row as fast as the 1-row layout does (60 matrices of 1536x576, 2 threads, AMD
# EPYC: 1 row 4.9 against 5.5 ms; 8 rows 5.6 against 8.8 ms), so decode, verify and prefill
# graphs can all read the same copy.
PACKED_ROWS = 2

# Decode step, B=1 / B=8, ms, MKL -> frozen oneDNN (docs/measurements.md): hidden 64: 0.11 -> 0.33 /
# 0.21 -> 0.32; 128: 0.40 -> 0.52 / 2.0 -> 1.5; 256: 1.9 -> 1.2 / 3.8 -> 1.9; 512 (bench-llama):
# 10.5 -> 9.4 / 23-30 -> 10.1; 576 (SmolLM2): 36 -> 32 / 85 -> 36.
PACK_MIN_HIDDEN = 256


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN's linear on packed `dtype` weights (bfloat16 only
    where oneDNN computes it, as inductor's own packing asks)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(model: Decoder) -> bool:
    """Whether the CPU graphs of `model` read its weights packed: a float model of hidden size
    `PACK_MIN_HIDDEN` and up on a CPU whose oneDNN computes its dtype (below it oneDNN's ~20 µs a
    call costs more than packing saves)."""
    weight = model.embed_tokens.weight
    return (
        weight.device.type == "cpu"
        and model.quantization is None
        and model.config.hidden_size >= PACK_MIN_HIDDEN
        and packing_available(weight.dtype)
    )


def address(tensor: torch.Tensor) -> int:
    """Where a tensor's data lives, packed (an opaque mkldnn tensor has no storage) or not."""
    return torch.ops.mkldnn.data_ptr(tensor) if tensor.is_mkldnn else tensor.data_ptr()


def weight_stamps(model: nn.Module) -> list[tuple[int, int]]:
    """Where each weight lives and its in-place write count: what a graph built over them (a
    frozen one, a packed twin, a stored graph's key) is valid for."""
    return [(address(p), p._version) for p in model.parameters()]


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of `weight` [out, in]: an opaque mkldnn tensor of the same logical shape."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


class PackedLinear(nn.Module):
    """A linear layer over oneDNN's packed copy of a weight (`weight` is an opaque mkldnn tensor of
    the logical shape [out, in]); a fused projection's `parts` split its output as FusedLinear's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: dict[str, int] | None) -> None:
        super().__init__()
        packed = packed_copy(weight)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = bias
        self.parts = parts
        self.out_features = weight.shape[0]
        # The same memory as the kernel of packed_gemv.py reads it ([B, Kp, NB]), for steps of up to
        # GEMV_ROWS rows; a parameter, so a stored graph is handed it as it is handed `weight`.
        blocks = packed_gemv.blocked(packed, *weight.shape)
        self.blocks = None if blocks is None else nn.Parameter(blocks, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        rows = x.numel() // x.shape[-1]  # static in a traced graph: the step's width
        if self.blocks is not None and rows <= packed_gemv.GEMV_ROWS:
            y = torch.ops.staticrt.f32_packed_linear(x.reshape(rows, x.shape[-1]), self.blocks)  # [M, B * NB]
            y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")  # [..., in] -> [..., out]
        return y if self.parts is None else y.split(list(self.parts.values()), dim=-1)


def _packed(module: nn.Module, twin: bool) -> nn.Module:
    """`module` with each linear layer below it packed (and each mixture of experts' stacks): a
    twin sharing every other tensor with it (`twin`), or the module itself, each float matrix let
    go as its packed copy takes its place."""
    target = copy.copy(module) if twin else module  # a copy: a new __dict__ over the same tensors
    target._modules = dict(module._modules)
    for name, child in module._modules.items():
        if isinstance(child, nn.Linear):
            target._modules[name] = PackedLinear(child.weight, child.bias, getattr(child, "parts", None))
        elif isinstance(child, Experts):  # its stacks read in place by a decode step (packed_experts.py)
            target._modules[name] = packed_experts(child, twin)
        elif child is not None:
            target._modules[name] = _packed(child, twin)
    return target


def pack(model: Decoder, twin: bool) -> Decoder:
    """`model` as the CPU graphs over packed weights see it: its linear layers (and a tied head, as
    a layer of its own) read packed copies; the embedding table, norms and rotary frequencies stay
    as they are. `twin`: a new module tree (the model keeps its float weights, for other uses); else
    the model itself, packed in place (only what owns the model: it then runs on the CPU in float,
    and neither exports, quantizes nor saves), where a tied model's lookup reads its rows out of
    the head's packed copy (`PackedLookup`), the only copy of the table held (SmolLM2's `run`
    decodes at 17.0-17.7 against 19.6-20.3 ms/token with the head reading a column-major table,
    docs/measurements.md).
    Where oneDNN's layout is not the one `PackedLookup` reads, the one table stays for both,
    column-major as the head's product reads it. A float model only."""
    assert model.quantization is None, "a quantized model's linear layers are its kernels' own"
    if model.packed:
        return model
    if not twin:
        return_freed_memory()  # what loading let go: the packed copies are not stacked on top of it
    packed = _packed(model, twin)
    if model.lm_head is None:  # tied
        table = model.embed_tokens.weight
        head = PackedLinear(table, None, None)
        lookup = None if twin else PackedLookup.of(head.weight, table)
        if twin or lookup is not None:
            packed.lm_head = head
        if lookup is not None:
            packed.embed_tokens = lookup
        elif not twin:  # one table for both, held once
            table.data = table.data.t().contiguous().t()
        del table, head
    packed.packed = True
    if not twin:
        return_freed_memory()  # the float matrices
    return packed


class PackedLookup(nn.Module):
    """The embedding lookup of a tied model packed in place, reading the rows of the table out of
    the head's packed copy. oneDNN lays out a [V, C] weight in blocks of rows; on AVX-512, of 64
    rows, each block [C', 64] (C' = C rounded up to 16), so row v, column c lies at
    (v // 64) * C' * 64 + c * 64 + v % 64: with V = 49152, C = 576 (SmolLM2), row 130's column 2
    is at 2 * 36864 + 128 + 2 = 73858. Each offset is a row's part plus a column's part, which
    `of` finds by packing a probe and checks against the whole table."""

    def __init__(self, packed: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> None:
        super().__init__()
        # The head's packed weight, held so that what `flat` aliases stays alive; not registered twice.
        object.__setattr__(self, "weight", packed)
        # A parameter, not a buffer: AOTInductor copies each buffer a graph reads when it compiles
        # it (a buffer may be written), 113 MB more for SmolLM2 for each graph compiled.
        flat = torch.frombuffer(packed_bytes(packed), dtype=packed.dtype)  # [blocks * C' * rows a block]
        self.flat = nn.Parameter(flat, requires_grad=False)
        self.register_buffer("rows", rows, persistent=False)  # [V] int64
        self.register_buffer("columns", columns, persistent=False)  # [C] int64

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.flat[self.rows[ids].unsqueeze(-1) + self.columns]  # [N] -> [N, C]

    @classmethod
    def of(cls, packed: torch.Tensor, table: torch.Tensor) -> PackedLookup | None:
        """The lookup of `table` [V, C] out of `packed`, its packed copy; None where the layout is
        not a row's offset plus a column's, blocks of rows repeating (then the table is kept)."""
        vocab, width = table.shape
        probe = min(vocab, 512)  # rows: several blocks (the layout is the same for a few rows as for all)
        rows, columns = (_positions(probe, width, along, table.dtype) for along in (0, 1))
        columns -= columns[0].clone()  # row 0's offset is in `rows`
        step = int(rows[1] - rows[0]) if probe > 1 else 1
        inside = torch.arange(probe) * step + rows[0]
        block = next((n for n in range(1, probe) if rows[n] != inside[n]), probe)  # rows a block
        if block < probe:  # offsets repeat block by block: extend to the whole vocabulary
            span = rows[block] - rows[0]
            every = torch.arange(vocab)
            rows = rows[0] + (every // block) * span + (every % block) * step
        elif probe < vocab:
            return None
        lookup = cls(packed, rows, columns)
        if min(rows.min(), columns.min()) < 0 or rows.max() + columns.max() >= lookup.flat.numel():
            return None  # a position the probe did not find, or past the packed copy
        for start in range(0, vocab, 512):  # every row as the table holds it (~5 MB at a time), or the table is kept
            ids = torch.arange(start, min(start + 512, vocab))
            if not torch.equal(lookup(ids), table[ids]):
                return None
        return lookup


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # a probe's codes, as each dtype's bits


def _positions(rows: int, columns: int, along: int, dtype: torch.dtype) -> torch.Tensor:
    """Where a packed [rows, columns] weight of `dtype` puts the elements of its first column
    (`along` 0) or its first row (1): a probe numbering them 1, 2, ... (as bit patterns of the
    dtype's width: exact where a bfloat16 value is not), every other element 0, packed."""
    codes = torch.zeros(rows, columns, dtype=_BITS[dtype])
    count = codes.shape[along]
    codes.select(1 - along, 0).copy_(torch.arange(1, count + 1))
    probe = packed_copy(codes.view(dtype))  # the layout alone: no kernel view to find
    flat = torch.frombuffer(packed_bytes(probe), dtype=codes.dtype)
    found = flat.nonzero().flatten()
    where = torch.full((count,), -1, dtype=torch.int64)
    where[flat[found].long() - 1] = found
    return where
