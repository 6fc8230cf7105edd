"""int4 projections in blocks with a float minimum each, llama.cpp's Q4_1 grid: w = d·q + m, q in 0..15.

ONNX Runtime's MatMulNBits takes an integer zero point a block, w = d·(q - z), and its quantizer
(RTN) rounds the block's minimum to a whole step: every weight of the block moves by the same up
to half a step, an error that adds up over the block's inputs instead of averaging out. SmolLM2,
converted from its Q4_1 GGUF (every block of its weights on such a grid), read +21.8% perplexity
over tests/data's text at int4 that way (docs/measurements.md). Float zero points exist in the op,
but its fast kernels take integer ones only (2.1 ms against 25-49 µs a node). So each block keeps
its codes and step, takes the integer zero point nearest its minimum, z = round(-m/d), and what
that leaves, the residual r = m + d·z (at most half a step where the block spans 0), is added
back through the block's input sum, in the same MatMulNBits:

    x @ W^T = Σ_blocks d·Σ_i x_i (q_i - z) + r·Σ_i x_i
            = MatMulNBits([x, 0.., S(x), 0..]; codes and zero points [W | R], steps [d | s_r])

S(x) are the input's block sums (one MatMul by a 0/1 matrix a width, shared by the projections
that read the same input), laid after x as extra blocks of inputs whose weights R are the
residuals, 4-bit on a grid of their own a column (16 levels spanning them, as the weights'
blocks: |error| <= half its step, about 1/30 of the column's largest step). Worked, K = 80,
blocks of 32: x fills 0..79, 80..95 are the ragged last block's zero padding, 96, 97 and 98 hold
the sums of inputs 0-31, 32-63 and 64-79, 99..127 zeros: K' = 128, and row 96 + j of [W | R]^T
is block j's residual.

Why this layout (docs/measurements.md, 2026-11-29, SmolLM2 from its Q4_1 GGUF): a minimum kept as a
float32 product of its own (`[K/32, N]` a projection, 1 bit a weight) read 12.261 perplexity over
the text (+1.27%) in 113.0 MB and cost ~20% of ONNX decode, its 17 MB of float32 multiplied on one
core; this one reads 12.171 (+0.52%; likely as codes centred on their zero point let the int8
activations' rounding errors cancel) in 103.4 MB (1.05x the GGUF) and decodes ~10% faster. The
exporter takes it only for weights already on such grids (`on_grids`): a float model keeps ONNX
Runtime's quantizer.
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
    as described above, in place; returns the names of the block-sum MatMuls it added, which
    carry float initializers a later quantizer must leave alone."""
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    widened: dict[str, str] = {}  # input x -> [x, 0.., S(x), 0..]
    added: list[str] = []
    nodes = []
    for node in graph.node:
        if node.op_type != "MatMul" or node.name not in names:
            nodes.append(node)
            continue
        x, name = node.input
        weight = numpy_helper.to_array(initializers[name]).T  # [N, K]
        codes, scales, zero_points = _blocks(weight, block)
        n, k = weight.shape
        wide = codes.shape[1] * block  # K'
        graph.initializer.extend(
            numpy_helper.from_array(array, f"{name}_{suffix}")
            for array, suffix in ((codes, "Q4"), (scales, "scales"), (zero_points, "zero_points"))
        )
        graph.initializer.remove(initializers[name])
        ones = f"block_sums.{k}x{block}"  # one 0/1 matrix a width K
        if ones not in initializers:
            padded = -(-k // block) * block
            matrix = np.zeros((k, wide - k), np.float32)  # [K, K' - K]: input i to its block's sum
            matrix[np.arange(k), padded - k + np.arange(k) // block] = 1.0
            initializers[ones] = numpy_helper.from_array(matrix, ones)
            graph.initializer.append(initializers[ones])
        if x not in widened:
            sums, widened[x] = f"{node.name}.block_sums", f"{node.name}.with_block_sums"
            nodes += [
                helper.make_node("MatMul", [x, ones], [sums], name=sums),
                helper.make_node("Concat", [x, sums], [widened[x]], name=widened[x], axis=-1),
            ]
            added.append(sums)
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [widened[x], f"{name}_Q4", f"{name}_scales", f"{name}_zero_points"],
                [node.output[0]],
                name=f"{node.name}_Q4",
                domain="com.microsoft",
                K=wide,
                N=n,
                bits=BITS,
                block_size=block,
                accuracy_level=accuracy_level,
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)
    return added


def on_grids(weights: Iterable[np.ndarray], block: int) -> bool:
    """Whether nearly every block of `weights` (each `[N, K]`) already lies on a 16-level grid
    from its minimum to its maximum: weights dequantized from a Q4_1 GGUF (whose quantizer puts
    each block's extremes at codes 0 and 15), which only this layout keeps. A float model's
    blocks do not, and there the integer zero points cost about as little (a block's extreme
    weights move by at most half a step) without the block sums' two nodes a projection."""
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
    """`weight [N, K]` -> packed codes `[N, K'/b, b/2]` (low nibble first, as MatMulNBits reads
    them; the K/b blocks of the weight, then the residuals' blocks), steps `[N * K'/b]` and packed
    zero points `[N * ceil(K'/b / 2)]`. A ragged last block is padded with its own last weight,
    which moves neither its minimum nor its maximum."""
    n, k = weight.shape
    blocks = -(-k // block)
    padded = np.pad(weight.astype(np.float32), ((0, 0), (0, blocks * block - k)), mode="edge")
    grouped = padded.reshape(n, blocks, block)
    low, step = _grid(grouped)  # each [N, K/b, 1]
    codes = np.clip(np.rint((grouped - low) / step), 0, TOP).astype(np.uint8)
    zero = _zero_point(low, step)  # [N, K/b, 1]; clipped where a block's weights share a sign
    residual = np.zeros((n, -(-blocks // block) * block), np.float32)  # [N, E*b]: block j's at j
    residual[:, :blocks] = (low + step * zero)[..., 0]
    residual = residual.reshape(n, -1, block)  # [N, E, b], zeros among them: each grid spans 0
    residual_low, residual_step = _grid(residual)
    residual_zero = _zero_point(residual_low, residual_step)
    residual_codes = np.clip(np.rint(residual / residual_step + residual_zero), 0, TOP).astype(np.uint8)
    all_codes = np.concatenate([codes, residual_codes], axis=1)  # [N, K'/b, b]
    steps = np.concatenate([step, residual_step], axis=1).astype(np.float32).reshape(-1)
    zeros = np.concatenate([zero, residual_zero], axis=1)[..., 0].astype(np.uint8)  # [N, K'/b]
    zeros = np.pad(zeros, ((0, 0), (0, zeros.shape[1] % 2)))  # [N, even]
    return _packed(all_codes), steps, _packed(zeros).reshape(-1)


def _zero_point(low: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The code nearest each grid's 0, within the codes: where MatMulNBits' `d·(q - z)` puts 0."""
    return np.clip(np.rint(-low / step), 0, TOP)


def _packed(codes: np.ndarray) -> np.ndarray:
    """4-bit codes, two a byte along the last axis, the first in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << BITS)


def _grid(grouped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks `[N, K/b, b]` -> each one's minimum and step `[N, K/b, 1]`, the 16 levels spanning it;
    a constant block's step is 1 (every code 0, its minimum the weight)."""
    low, high = grouped.min(axis=-1, keepdims=True), grouped.max(axis=-1, keepdims=True)
    return low, np.where(high > low, (high - low) / TOP, 1.0)
