"""The token embedding's lookup in a quantized ONNX graph, over int8 codes instead of float32 rows.

The float table was most of a quantized artifact: SmolLM2's 49,152 x 576 rows are 113 MB of a
216 MB int4 artifact, against its 98 MB Q4_1 GGUF. ONNX Runtime's `GatherBlockQuantized`
(com.microsoft) gathers rows of uint8 codes in blocks along the row, each with a scale, and
dequantizes only the rows a step looks up, with MatMulNBits' conventions: no zero points means
128 for 8 bits. So:

- a tied model's lookup reads the head's own MatMulNBits codes and scales (`[V, K/64, 64]` and
  `[V, K/64]`: a row of the head is a row of the table), and the table leaves the artifact;
- an untied model's table becomes codes of its own, symmetric int8 in the head's blocks.

Either way a row is on an int8 grid of the head's blocks (64 inputs): each element within half a
step of its float value.
Measured on SmolLM2 (tied, from its Q4_1 GGUF; 2-core AMD EPYC, onnxruntime 1.31.1): the int4
artifact 216.1 -> 102.9 MB, int8 260.9 -> 147.6 MB; perplexity over tests/data's text (fp32
12.108) int8 12.217 -> 12.182, int4 14.788 -> 14.752; decode ms/token the same within the noise
(`run --threads 1`, four alternating runs: 25.3 against 25.6 mean); peak RSS of `staticrt run`
358 -> 371 MB, the head's codes now held as stored for the lookup beside MatMulNBits' packed copy.
The codes are `[V, K/b, b]` (the head's layout, b its block), so the op gathers `[*indices, K/b, b]`
and a Reshape makes it `[*indices, K]`, a Slice dropping the padding where b does not divide K.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def lookup_from_codes(model: Any, table: str, head_weight: str, block: int) -> dict[str, Any]:
    """Rewrite `model`'s one Gather over the float initializer `table` ([V, K]) into a
    GatherBlockQuantized over int8 codes in blocks of `block` (the head's): the head's own (whose
    quantized weight came from `head_weight`) where `table` is the head's weight, else its own.
    Returns the manifest's description of the lookup."""
    from onnx import helper, numpy_helper

    graph = model.graph
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == table]
    if len(gathers) != 1:
        raise AssertionError(f"{len(gathers)} Gathers read the embedding {table!r}, not one")
    (gather,) = gathers
    initializers = {init.name: init for init in graph.initializer}
    width = int(initializers[table].dims[1])  # K
    tied = head_weight == table
    if tied:  # the head's codes, quantized from the table's transposed copy (onnx_quantize._gemms_as_matmuls)
        heads = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith(f"{table}.T_Q")]
        if len(heads) != 1:
            raise AssertionError(f"{len(heads)} MatMulNBits read the tied head's codes of {table!r}, not one")
        codes, scales = heads[0].input[1], heads[0].input[2]
        vocab, blocks = (int(d) for d in initializers[codes].dims[:2])
    else:
        codes, scales = f"{table}_Q8", f"{table}_scales"
        quantized, steps = int8_blocks(numpy_helper.to_array(initializers[table]), block)
        graph.initializer.extend([numpy_helper.from_array(quantized, codes), numpy_helper.from_array(steps, scales)])
        vocab, blocks = quantized.shape[:2]
    name = gather.name or "embed_tokens"
    sizes = (vocab, blocks, block, width)
    nodes, ints = _lookup_nodes(name, codes, scales, gather.input[1], gather.output[0], sizes)
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), f"{name}.{k}") for k, v in ints.items())
    order = list(graph.node)
    at = order.index(gather)
    order[at : at + 1] = nodes
    del graph.node[:]
    graph.node.extend(order)
    if not any(table in node.input for node in graph.node):
        graph.initializer.remove(initializers[table])
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    codes_of = "the head's" if tied else "its own"
    return {"op": "com.microsoft.GatherBlockQuantized", "bits": 8, "block_size": block, "codes": codes_of}


def _lookup_nodes(
    name: str, codes: str, scales: str, indices: str, out: str, sizes: tuple[int, int, int, int]
) -> tuple[list[Any], dict[str, list[int]]]:
    """The nodes that write `out` `[*indices, K]` from the codes `[V, K/b, b]` and scales `[V, K/b]`
    (`sizes`: V, K/b, b, K), and the int64 constants they read (by name after `name.`)."""
    from onnx import helper

    vocab, blocks, block, width = sizes
    padded = blocks * block != width  # the last block runs past K: sliced off
    ints = {"scales_shape": [vocab, blocks, 1], "row": [-1]}
    ints |= {"start": [0], "width": [width], "axis": [-1]} if padded else {}
    at = lambda part: f"{name}.{part}"  # noqa: E731
    lookup = helper.make_node(
        "GatherBlockQuantized",
        [codes, indices, at("scales3")],
        [at("blocks")],  # [*indices, K/b, b]
        name=at("lookup"),
        domain="com.microsoft",
        block_size=block,
        bits=8,
        gather_axis=0,
        quantize_axis=2,
    )
    nodes = [
        helper.make_node("Reshape", [scales, at("scales_shape")], [at("scales3")], name=at("scales")),
        lookup,
        # the indices' shape, then K: whatever their rank
        helper.make_node("Shape", [indices], [at("indices_shape")], name=at("indices_shape")),
        helper.make_node("Concat", [at("indices_shape"), at("row")], [at("rows_shape")], name=at("rows_shape"), axis=0),
        helper.make_node(
            "Reshape", [at("blocks"), at("rows_shape")], [at("padded") if padded else out], name=at("rows")
        ),
    ]
    if padded:
        ends = [at("padded"), at("start"), at("width"), at("axis")]
        nodes.append(helper.make_node("Slice", ends, [out], name=at("unpad")))
    return nodes, ints


def int8_blocks(table: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """`table [V, K]` float32 as symmetric int8 in blocks of `block` along a row, in MatMulNBits'
    layout: uint8 codes `[V, ceil(K/block), block]` (zero point 128, the padding at it) and float32
    scales `[V, ceil(K/block)]`, each element within half a scale of its value. Each block is a row
    of a8_linear's `int8_codes` (absmax / 127)."""
    import torch

    from ..models.a8_linear import int8_codes

    vocab, width = table.shape
    blocks = -(-width // block)
    padded = np.zeros((vocab, blocks * block), np.float32)
    padded[:, :width] = table
    codes, scales = int8_codes(torch.from_numpy(padded).view(vocab * blocks, block))  # a row a block
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8)
    return shifted.view(vocab, blocks, block).numpy(), scales.view(vocab, blocks).numpy()
