"""int4 projections in blocks with a float minimum each, llama.cpp's Q4_1 grid: w = d·q + m, q in 0..15.

ONNX Runtime's MatMulNBits takes an integer zero point a block, w = d·(q - z), and its quantizer
(RTN) rounds the block's minimum to a whole step: every weight of the block moves by the same up
to half a step, an error that adds up over the block's inputs instead of averaging out. SmolLM2,
converted from its Q4_1 GGUF (every block of its weights on such a grid), read +21.8% perplexity
over tests/data's text at int4 that way (docs/measurements.md). Float zero points exist in the op,
but its fast kernels take integer ones only (68 against 2.3-3.5 ms a token on bench-llama). So the codes
go to MatMulNBits with zero points 0, and each block's minimum to a second, small product:

    x @ W^T = MatMulNBits(x; q, d, z=0) + (x summed over each block of inputs) @ M,   M [K/b, N]

The block sums are one MatMul by a 0/1 matrix `[K, K/b]` (one a width), shared by the projections that
read the same input (q, k and v; gate and up). A Q4_1 block's smallest and largest weights are its codes 0
and 15, so `d = (max - min)/15` and `m = min` recover that grid and every weight on it exactly; a
float weight lies within half a step of its code, as in llama.cpp's own Q4_1. The price: M is one
float32 a block (1 bit a weight, where the packed zero points it replaces were 1/8), and two more
nodes a projection, ~18% of SmolLM2's ONNX decode; so the exporter takes this layout only for
weights already on such grids (`on_grids`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

BITS = 4
TOP = 2**BITS - 1  # the largest code
GRID_TOLERANCE = 1e-3  # of a step: a Q4_1 GGUF's weights, d·q + m in float32, sit ~1e-6 of a step off their codes
ON_GRIDS = 0.99  # of the blocks, for a model to count as dequantized from 4 bits


def min_blocks(model: Any, names: set[str], block: int, accuracy_level: int) -> list[str]:
    """Rewrite each `MatMul(x, W^T [K, N])` named in `names` (W^T an initializer) in `model`'s graph
    as described above, in place; returns the names of the correction MatMuls it added, which
    carry float initializers a later quantizer must leave alone."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    sums: dict[str, str] = {}  # input -> its block sums
    added: list[str] = []
    nodes = []
    for node in graph.node:
        if node.op_type != "MatMul" or node.name not in names:
            nodes.append(node)
            continue
        x, name = node.input
        weight = numpy_helper.to_array(initializers[name]).T  # [N, K]
        codes, scales, minimum = _blocks(weight, block)
        n, k = weight.shape
        graph.initializer.extend(
            numpy_helper.from_array(array, f"{name}_{suffix}")
            for array, suffix in (
                (codes, "Q4"),
                (scales, "scales"),
                (np.zeros(n * -(-codes.shape[1] // 2), np.uint8), "zero_points"),
                (minimum, "minimum"),
            )
        )
        graph.initializer.remove(initializers[name])
        ones = f"block_sums.{k}x{block}"  # one 0/1 matrix a width K
        if ones not in initializers:
            matrix = np.zeros((k, codes.shape[1]), np.float32)
            matrix[np.arange(k), np.arange(k) // block] = 1.0  # [K, K/b]: input i to its block i // b
            initializers[ones] = numpy_helper.from_array(matrix, ones)
            graph.initializer.append(initializers[ones])
        if x not in sums:
            sums[x] = f"{node.name}.block_sums"
            nodes.append(helper.make_node("MatMul", [x, ones], [sums[x]], name=sums[x]))
            added.append(sums[x])
        out = node.output[0]
        nodes += [
            helper.make_node(
                "MatMulNBits",
                [x, f"{name}_Q4", f"{name}_scales", f"{name}_zero_points"],
                [f"{out}.codes"],
                name=f"{node.name}_Q4",
                domain="com.microsoft",
                K=k,
                N=n,
                bits=BITS,
                block_size=block,
                accuracy_level=accuracy_level,
            ),
            helper.make_node("MatMul", [sums[x], f"{name}_minimum"], [f"{out}.minimum"], name=f"{node.name}.minimum"),
            helper.make_node("Add", [f"{out}.codes", f"{out}.minimum"], [out], name=f"{node.name}.add_minimum"),
        ]
        added.append(f"{node.name}.minimum")
    del graph.node[:]
    graph.node.extend(nodes)
    return added


def on_grids(weights: Iterable[np.ndarray], block: int) -> bool:
    """Whether nearly every block of `weights` (each `[N, K]`) already lies on a 16-level grid
    from its minimum to its maximum: weights dequantized from a Q4_1 GGUF (whose quantizer puts
    each block's extremes at codes 0 and 15), which only this layout keeps exactly. A float
    model's blocks do not, and there the integer zero points cost about as little (a block's
    extreme weights move by at most half a step) without the two extra nodes a projection
    (SmolLM2 decoding with the minima: 15.6 against 13.2 ms a token, docs/measurements.md)."""
    on = total = 0
    for weight in weights:
        k = weight.shape[1] - weight.shape[1] % block  # whole blocks
        grouped = weight[:, :k].astype(np.float32, copy=False).reshape(weight.shape[0], -1, block)
        low, step = _grid(grouped)
        codes = (grouped - low) / step
        on += int((np.abs(codes - np.rint(codes)).max(axis=-1) < GRID_TOLERANCE).sum())
        total += grouped.shape[0] * grouped.shape[1]
    return total > 0 and on >= ON_GRIDS * total


def _blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight [N, K]` -> packed codes `[N, K/b, b/2]` (low nibble first, as MatMulNBits reads
    them), scales `[N * K/b]` and minima `[K/b, N]` (the correction's right-hand side). A ragged
    last block is padded with its own last weight, which moves neither its minimum nor its maximum."""
    n, k = weight.shape
    blocks = -(-k // block)
    padded = np.pad(weight.astype(np.float32), ((0, 0), (0, blocks * block - k)), mode="edge")
    grouped = padded.reshape(n, blocks, block)
    low, step = _grid(grouped)  # each [N, K/b, 1]
    codes = np.clip(np.rint((grouped - low) / step), 0, TOP).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [N, K/b, b/2]
    return packed, step.astype(np.float32).reshape(-1), np.ascontiguousarray(low[..., 0].T.astype(np.float32))


def _grid(grouped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks `[N, K/b, b]` -> each one's minimum and step `[N, K/b, 1]`, the 16 levels spanning it;
    a constant block's step is 1 (every code 0, its minimum the weight)."""
    low, high = grouped.min(axis=-1, keepdims=True), grouped.max(axis=-1, keepdims=True)
    return low, np.where(high > low, (high - low) / TOP, 1.0)
