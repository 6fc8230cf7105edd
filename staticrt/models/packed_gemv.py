"""A float32 decode step's products on a matrix-vector kernel of staticrt's own that reads oneDNN's
packed copy of each weight in place (`f32_packed_linear`, packed_gemv_source.py).

A decode step multiplies one row (or a few) by every matrix, reading each weight once: it runs at
the rate the cores stream memory, and oneDNN's linear streams below it. oneDNN packs an [N, K]
weight in blocks of NB channels (NB = 64 with AVX-512), each block [Kp, NB] contiguous (Kp: K
rounded up), so channel n's weight k lies at (n // NB) * Kp * NB + k * NB + n % NB: with
N = 4096, K = 1024, channel 130's weight 2 is at 2 * 65536 + 2 * 64 + 2 = 131202. A block is a
matrix-vector product's ideal order: each k loads NB consecutive weights and multiplies them by
x[k] into NB accumulators. On bench-qwen3's 113 matrices (2,380 MB, 2 threads, AMD EPYC with
AVX-512): 1 row 79-80 ms against oneDNN's 99-103, 2 rows 80-83 against 110-112, 4 rows 72-74
against 86-91 (docs/measurements.md). Wider steps (prefill, a batch past 4 rows) stay on oneDNN's
GEMM over the same tensor: one copy of the weights serves both.

The layout is oneDNN's to choose, so it is not assumed: `blocked` tries the block widths the
packed tensor's size allows and keeps the one whose product is oneDNN's on a random row; a
layout that matches none (or a CPU that cannot build the kernels) keeps oneDNN's linear.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from ..errors import ConfigError
from . import a8_kernels

log = logging.getLogger("staticrt")
GEMV_ROWS = 4  # rows of x a step may have to run on the kernel; more go to oneDNN's GEMM


def packed_bytes(tensor: torch.Tensor) -> memoryview:
    """A packed tensor's bytes as they lie in memory (no copy): to hash, and to view as `blocked` does."""
    size = torch.ops.mkldnn._nbytes(tensor)
    return memoryview((ctypes.c_char * size).from_address(torch.ops.mkldnn.data_ptr(tensor))).cast("B")


@functools.cache
def usable() -> bool:
    """Whether the kernel runs here: the a8 kernels' library (AVX2 with FMA and F16C, or AVX-512)
    builds and loads. Says once why not where it cannot."""
    if a8_kernels.unavailable() is not None:
        return False
    try:
        a8_kernels.build()
    except ConfigError as err:  # the float model runs as before, a little slower at one row a step
        log.warning("float32 decode keeps oneDNN's linear for every step: it needs %s", err)
        return False
    return True


def blocked(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor | None:
    """`packed` (oneDNN's opaque copy of a float32 [N, K] weight) as a dense [B, Kp, NB] view of
    its memory, the layout `f32_packed_linear` reads; None where no block width gives oneDNN's
    product or the kernel cannot run here."""
    if packed.dtype != torch.float32 or not usable():
        return None
    flat = torch.frombuffer(packed_bytes(packed), dtype=torch.float32)  # aliases the packed copy
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(0))
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    for width in (64, 32, 16, 8):
        blocks = -(-out_features // width)
        if flat.numel() % (blocks * width) or flat.numel() // (blocks * width) < in_features:
            continue
        view = flat.view(blocks, -1, width)
        try:
            got = torch.ops.staticrt.f32_packed_linear(x, view)[:, :out_features]
        except RuntimeError:  # a width the kernel's vectors do not divide
            continue
        if (got - want).abs().max() <= 1e-3 * want.abs().max():  # another order of sums; a wrong layout is O(1) off
            return view
    return None
