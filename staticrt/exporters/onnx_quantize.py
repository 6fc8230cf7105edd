"""Weight-only int8 / int4 in the ONNX graph, with ONNX Runtime's own quantizer (`MatMulNBits`).

The exporter writes the float graph, in which each projection and the head is a `Gemm(x, W,
transB=1)` over an initializer `W [N, K]`. ONNX Runtime's `MatMulNBitsQuantizer` (the one
onnxruntime-genai's model builder uses) rewrites `MatMul(x, W [K, N])` nodes into `MatMulNBits`, a
com.microsoft contrib op holding `W` as blocks of `block_size` inputs with a scale and a zero point
each, so those Gemms are first turned into MatMuls over the transposed weight.

Why MatMulNBits and not the standard `DequantizeLinear` (blocked, opset 21) + `MatMul`: ONNX Runtime
fuses neither on the CPU. Measured (2-core AMD EPYC VM, 2 threads, decode ms/token, one process):
bench-llama float32 6.9-7.4, int4 MatMulNBits 2.3-3.5, int4 DequantizeLinear + MatMul 18.5 (it
dequantizes every weight every step). MatMulNBits is what onnxruntime-genai's own int4 models use,
and it runs them. `accuracy_level` 4 lets the CPU kernel quantize each block of activations to int8
and multiply in integers: int8 weights without it fall back to a kernel that took 109 ms/token
against 3.5 with it; at int4 it cost SmolLM2 no perplexity (14.81 against 14.75 without).

What is quantized follows quantize.py: every projection to the spec (int4: its group size, with a
zero point a group; int8: blocks of 64 inputs, symmetric), and the head at int8 whatever the spec.
The embedding's lookup reads int8 codes in the head's layout (onnx_lookup.py): a tied model's are
the head's own, so the float table leaves the artifact. The
activations' int8 blocks follow the weights', and they set the error: SmolLM2's perplexity over
tests/data's whole text (2,211 predictions; fp32 12.108) is +0.16% at blocks of 32 with zero points
(+0.72% without) and +0.90% at 64, the same with or without them (12.2167 / 12.2170); blocks of 128
pad its 576 inputs to 640 and cost +1.7%. 64, symmetric: no zero point to stream (as many bytes a
weight as llama.cpp's Q8_0), and ONNX Runtime's kernel over SmolLM2's weights alone takes 4.33 ms a
step against 4.58 with zero points and 4.90 at blocks of 32 (2 threads; docs/measurements.md). At 32
the greedy answer to "What is the capital of France?" once began "L'Étoile, la Cité" where fp32,
int4 and int8 at 64 say "The capital of France is Paris" (two other chat prompts: all four right).
Over the first 512 tokens alone every int8 layout is noisier: +1.3% at 64 symmetric, +0.74% at 32.

The fast kernels take integer zero points only; float ones (ORT's HQQ quantizer) ran bench-llama at
68 ms/token. A model whose weights already sit on 4-bit grids with a float minimum a block (one
converted from a GGUF Q4_1, as tests' SmolLM2) read +21.8% perplexity at int4 that way, every
block moved by up to half a step; such a model keeps its codes and steps, and its minima through
integer zero points and a residual a block (onnx_q4_min.py: +0.52%, in 1.05x the GGUF's bytes).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from ..models.quant_spec import QuantSpec
from .onnx_lookup import lookup_from_codes
from .onnx_q4_min import min_blocks, on_grids

INT8_BLOCK = 64
EMBEDDING = "model.embed_tokens.weight"  # the table the graph's one lookup Gather reads
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations in the CPU kernel (CUDA ignores it)


def quantize_graph(path: Path, spec: QuantSpec, head_weight: str) -> dict[str, Any]:
    """Rewrite the graph at `path` (weights as external data beside it) with `spec`'s weights in
    place; `head_weight` is the initializer the head multiplies by (the embedding's, when tied).
    Returns the manifest's description of what was quantized."""
    import onnx
    from onnx import numpy_helper

    # The quantizer's module calls logging.basicConfig when imported, which would print a second,
    # timestamped copy of every log line of the process (staticrt's included) from then on.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # it logs each node at INFO
    model = onnx.load(str(path))
    head = [node.name for node in model.graph.node if node.op_type == "Gemm" and node.input[1] == head_weight]
    if len(head) != 1:
        raise AssertionError(f"{len(head)} Gemms multiply by the head's weight {head_weight!r}, not one")
    matmuls = _gemms_as_matmuls(model)
    layouts = {
        "projections": {"bits": spec.bits, "block_size": spec.group_size or INT8_BLOCK, "symmetric": spec.bits == 8},
        "head": {"bits": 8, "block_size": INT8_BLOCK, "symmetric": True},
    }
    steps = [(head, layouts["projections"]), ([], layouts["head"])]
    weights = {init.name: init for init in model.graph.initializer if len(init.dims) == 2}
    projections = {n.name: n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    for name in head:
        projections.pop(name)
    arrays = (numpy_helper.to_array(weights[w]).T for w in projections.values())  # one at a time
    if spec.bits == 4 and on_grids(arrays, spec.group_size):  # a Q4_1 GGUF's grids, kept (onnx_q4_min.py)
        minimum = "integer zero point and a 4-bit residual a block"
        layouts["projections"] = {"bits": 4, "block_size": spec.group_size, "minimum": minimum}
        steps = [(min_blocks(model, set(projections), spec.group_size, ACCURACY_LEVEL), layouts["head"])]
    # The projections first (the head left out), then the one MatMul over a weight left: the head.
    for skip, layout in steps:
        config = DefaultWeightOnlyQuantConfig(
            block_size=layout["block_size"],
            is_symmetric=layout["symmetric"],
            accuracy_level=ACCURACY_LEVEL,
            bits=layout["bits"],
        )
        quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=skip, algo_config=config)
        quantizer.process()
        model = quantizer.model.model
    layouts["embedding"] = lookup_from_codes(model, EMBEDDING, head_weight, INT8_BLOCK)
    data = path.with_name(path.name + ".data")
    data.unlink()  # onnx.save appends to an existing data file
    onnx.save(model, str(path), save_as_external_data=True, location=data.name)
    quantized = sum(node.op_type == "MatMulNBits" for node in model.graph.node)
    if quantized != matmuls:
        raise AssertionError(f"{quantized} of the graph's {matmuls} weight MatMuls were quantized")
    return {"name": spec.layout, "op": "com.microsoft.MatMulNBits", "accuracy_level": ACCURACY_LEVEL, **layouts}


def _gemms_as_matmuls(model: Any) -> int:
    """Turn each `Gemm(x, W [N, K], transB=1)` over an initializer into `MatMul(x, W^T [K, N])`,
    the form the quantizer takes; a weight another node also reads (a tied head's embedding) gets
    a transposed copy of its own. Returns how many there were."""
    import numpy as np
    from onnx import helper, numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    readers = Counter(name for node in model.graph.node for name in node.input)
    count = 0
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in initializers:
            continue
        if node.input[1].endswith("mlp.gate.weight"):  # a mixture of experts' router stays float (expert_quant.py)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transB") != 1 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            raise AssertionError(f"Gemm {node.name} is not x @ W^T: {attrs}")
        name = node.input[1]
        weight = numpy_helper.to_array(initializers[name])  # [N, K]
        transposed = numpy_helper.from_array(np.ascontiguousarray(weight.T), name)  # [K, N]
        if readers[name] > 1:
            transposed.name = f"{name}.T"
            model.graph.initializer.append(transposed)
            node.input[1] = transposed.name
        else:
            initializers[name].CopyFrom(transposed)
        node.op_type = "MatMul"
        del node.attribute[:]
        count += 1
    return count
