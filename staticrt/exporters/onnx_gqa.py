"""A quantized graph's static attention layers as ONNX Runtime's GroupQueryAttention.

After `onnx_fuse`, a layer's attention is ~15 nodes: the q/k/v Split of the fused projection, a
Reshape and a Transpose of each, RotaryEmbedding of q and k, a TensorScatter of k and v into the
cache, the standard Attention, and a Transpose and Reshape of its output. ONNX Runtime's per-node
cost is what stands between its int8 decode and llama.cpp's Q8_0 (docs/measurements.md: SmolLM2's
~730 nodes besides MatMulNBits are ~3 ms of a 7.4 ms step), and its contrib op does all of it in one:

    Split..Reshape  ->  GroupQueryAttention(Reshape(qkv, [B, S, W]), past_k, past_v, seqlens_k,
                                            total, cos, sin)  ->  Reshape

the new keys and values written in place at `seqlens_k + 1 - S` (the graph's write index,
`marked_columns - S`: `seqlens_k = marked_columns - 1`), rotated at their columns, from tables of
the graph's own angles (positions 0..N-1 times its inverse frequencies, Cos and Sin in the graph,
so ONNX Runtime folds them with the kernels the step used), each query attending causally over
the columns up to its own. That is the graph's mask and positions for one row, which has no holes:
its columns are its positions, every one up to the last marked is real (a kept prefix included).
SmolLM2 int8: 856 nodes to ~470, the decode step 0.91-0.92x; the values it computes equal the
graph's to float rounding (1e-6), which the next layer's int8 activations can round apart.

Only where the pattern is exactly that, in a graph run one row at a time of a model without
windowed layers (the exporter's call: a static cache's sliding layers keep their window in the
mask, which the op would not see), is a layer rewritten:
a static (non-rotating) cache layer's float32 keys and values, full-width non-interleaved rotary,
no softcap, a head size that is a multiple of 16 (ONNX Runtime's CPU kernel). Only quantized
graphs take it, whose int8 activations are a CPU kernel's anyway: ONNX Runtime's CUDA kernel of
the op takes neither float32 nor an attention bias (contrib_ops/cuda/bert/group_query_attention.cc),
so on CUDA these layers fall back to the CPU provider, and a float graph keeps the standard
Attention it runs on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .onnx_fuse import GraphIndex, attribute, spliced

OP = "GroupQueryAttention"


def group_query_attention(path: Path, batch_size: int) -> int:
    """Rewrite each matching attention layer of the graph at `path` (weights as external data,
    untouched) as one GroupQueryAttention; returns how many it rewrote. A graph run with more than
    one row keeps its attention: ONNX Runtime's CPU kernel refuses a prefill of several rows over a
    held context ("batch_size must be 1 when sequence_length > 1 and past context is given"), which
    a server's rows do whenever a request joins the others."""
    import onnx
    from onnx import numpy_helper

    if batch_size != 1:
        return 0

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    g = GraphIndex(list(graph.node), graph.initializer)
    inputs = {value.name: value for value in graph.input}
    if not {"input_ids", "attention_mask", "position_ids"} <= inputs.keys():  # a graph of another step's form
        return 0
    layers = [m for m in (_layer(g, node, inputs) for node in graph.node if node.op_type == "Attention") if m]
    if not layers:
        return 0
    # the shared nodes serve layers of one write index, one set of rotary angles, one cache length and width
    same = ("marked_columns", "inverse_frequencies", "slots", "width")
    layers = [layer for layer in layers if all(layer[key] == layers[0][key] for key in same)]
    shared = _shared_nodes(layers[0])
    replaced: dict[int, list[Any]] = {}
    dropped: set[int] = set()
    for layer in layers:
        dropped.update(id(n) for n in layer["pattern"])
        replaced[id(layer["attention"])] = _rewritten(layer)
    nodes = spliced(list(graph.node), replaced, dropped)
    first = next(i for i, node in enumerate(nodes) if node.op_type == OP) - 1  # before the first layer's Reshape
    nodes[first:first] = shared["nodes"]
    graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in shared["constants"].items())
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(path))
    return len(layers)


def _layer(g: GraphIndex, attention: Any, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The nodes of one attention layer around `attention` and what its rewrite needs, or None
    where the layer is not the pattern above."""
    if len(attention.input) != 4 or attention.input[3] == "":
        return None
    if attribute(attention, "softcap", 0.0) or attribute(attention, "is_causal", 0):
        return None
    if attribute(attention, "qk_matmul_output_mode", 0):
        return None
    q_rot = g.made_by(attention.input[0], "RotaryEmbedding")
    k_write, v_write = g.made_by(attention.input[1], "TensorScatter"), g.made_by(attention.input[2], "TensorScatter")
    if q_rot is None or k_write is None or v_write is None:
        return None
    if any(attribute(w, "mode", b"linear") != b"linear" for w in (k_write, v_write)):  # a rotating layer's: circular
        return None
    if k_write.input[0] not in inputs or v_write.input[0] not in inputs or k_write.input[2] != v_write.input[2]:
        return None
    k_rot = g.made_by(k_write.input[1], "RotaryEmbedding")
    if k_rot is None or list(k_rot.input[1:]) != list(q_rot.input[1:]):
        return None
    if attribute(q_rot, "interleaved", 0) or attribute(k_rot, "interleaved", 0):
        return None
    heads = [_heads_of(g, name) for name in (q_rot.input[0], k_rot.input[0], v_write.input[1])]
    if any(h is None for h in heads):
        return None
    (q_tr, q_rs), (k_tr, k_rs), (v_tr, v_rs) = heads
    split = g.made_by(q_rs.input[0], "Split")
    if split is None or list(split.output) != [q_rs.input[0], k_rs.input[0], v_rs.input[0]]:
        return None
    widths = g.constant(split.input[1]) if len(split.input) > 1 else None
    past = inputs[k_write.input[0]].type.tensor_type  # [B, H_kv, N, D]
    head_size, slots = past.shape.dim[3].dim_value, past.shape.dim[2].dim_value
    if past.elem_type != 1 or not widths or len(widths) != 3 or widths[1] != widths[2]:  # float32 keys and values
        return None
    if not head_size or not slots or head_size % 16 or any(w % head_size for w in widths) or widths[0] % widths[1]:
        return None
    out_tr = g.sole_reader(attention, "Transpose")
    out_rs = g.sole_reader(out_tr, "Reshape") if out_tr is not None else None
    write_index = g.made_by(k_write.input[2], "Sub")  # marked_columns - S
    angles = _angles(g, q_rot.input[1])
    if out_rs is None or write_index is None or angles is None:
        return None
    pattern = [split, q_rs, q_tr, q_rot, k_rs, k_tr, k_rot, v_rs, v_tr, k_write, v_write, attention, out_tr, out_rs]
    if any(not _read_only_by(g, node, pattern) for node in pattern[:-1]):
        return None
    return {
        "attention": attention,
        "pattern": pattern,
        "qkv": split.input[0],
        "heads": (widths[0] // head_size, widths[1] // head_size),
        "past": (k_write.input[0], v_write.input[0]),
        "present": (k_write.output[0], v_write.output[0]),
        "marked_columns": write_index.input[0],
        "inverse_frequencies": angles,
        "slots": slots,
        "width": sum(widths),
        "scale": attribute(attention, "scale"),
        "out": (out_rs.input[1], out_rs.output[0]),
    }


def _heads_of(g: GraphIndex, name: str) -> tuple[Any, Any] | None:
    """The Transpose `[B, S, H, D] -> [B, H, S, D]` making `name` and the Reshape before it."""
    transpose = g.made_by(name, "Transpose")
    if transpose is None or list(attribute(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = g.made_by(transpose.input[0], "Reshape")
    return (transpose, reshape) if reshape is not None else None


def _angles(g: GraphIndex, cos: str) -> str | None:
    """The inverse frequencies `[D/2]` where the layer's cos table is `Cos(Cast(position_ids) * inv)`."""
    table = g.made_by(cos, "Cos")
    product = g.made_by(table.input[0], "Mul") if table is not None else None
    if product is None:
        return None
    frequencies = [name for name in product.input if len(g.dims.get(name, ())) == 1]
    casts = [g.made_by(name, "Cast") for name in product.input]
    positions = [g.made_by(cast.input[0], "Unsqueeze") for cast in casts if cast is not None]
    if len(frequencies) != 1 or len(positions) != 1 or positions[0] is None:
        return None
    return frequencies[0] if positions[0].input[0] == "position_ids" else None


def _read_only_by(g: GraphIndex, node: Any, pattern: list[Any]) -> bool:
    """Whether every output of `node` is read only inside the pattern (or is a graph output the
    rewrite makes again: the cache's present)."""
    inside = {id(n) for n in pattern}
    return all(id(reader) in inside for out in node.output for reader in g.readers.get(out, []))


def _shared_nodes(layer: dict[str, Any]) -> dict[str, Any]:
    """What every rewritten layer reads, made once a step: the query's 3D shape, `seqlens_k`,
    the total length and the rotary tables `[N, D/2]` (constants, which ONNX Runtime folds)."""
    from onnx import TensorProto, helper

    slots, width = layer["slots"], layer["width"]
    constants = {
        "gqa.one": np.array(1, np.int64),
        "gqa.width": np.array([width], np.int64),
        "gqa.positions": np.arange(slots, dtype=np.float32)[:, None],  # [N, 1]
    }
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["gqa.input_shape"]),  # [B, S]
        helper.make_node("Concat", ["gqa.input_shape", "gqa.width"], ["gqa.query_shape"], axis=0),
        helper.make_node("Sub", [layer["marked_columns"], "gqa.one"], ["gqa.seqlens_64"]),
        helper.make_node("Cast", ["gqa.seqlens_64"], ["gqa.seqlens_k"], to=TensorProto.INT32),
        # T, the columns up to the last marked one, not the mask's width: staticrt's runner keeps its
        # mask at a fixed width, genai's grows, and both then take the op's same path (a first
        # prefill's S = T), so that they compute the same to the last bit
        helper.make_node("ReduceMax", [layer["marked_columns"]], ["gqa.total_64"], keepdims=0),
        helper.make_node("Cast", ["gqa.total_64"], ["gqa.total"], to=TensorProto.INT32),
        helper.make_node("Mul", ["gqa.positions", layer["inverse_frequencies"]], ["gqa.angles"]),  # [N, D/2]
        helper.make_node("Cos", ["gqa.angles"], ["gqa.cos"]),
        helper.make_node("Sin", ["gqa.angles"], ["gqa.sin"]),
    ]
    return {"nodes": nodes, "constants": constants}


def _rewritten(layer: dict[str, Any]) -> list[Any]:
    """The layer's three nodes: the fused projection as `[B, S, W]`, the op, its output as the
    `[B*S, H*D]` the output projection reads."""
    from onnx import helper

    name = layer["attention"].output[0]
    heads, kv_heads = layer["heads"]
    key, value = layer["past"]
    shape, out = layer["out"]
    return [
        helper.make_node("Reshape", [layer["qkv"], "gqa.query_shape"], [f"{name}.qkv"]),
        helper.make_node(
            OP,
            [f"{name}.qkv", "", "", key, value, "gqa.seqlens_k", "gqa.total", "gqa.cos", "gqa.sin"],
            [f"{name}.gqa", *layer["present"]],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=layer["scale"],
            do_rotary=1,
            rotary_interleaved=0,
        ),
        helper.make_node("Reshape", [f"{name}.gqa", shape], [out]),
    ]
