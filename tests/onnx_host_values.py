"""Which values of an ONNX graph ONNX Runtime's CUDA provider would compute on the CPU and copy to
the GPU: a CUDA graph cannot hold such a copy, so ONNX Runtime then refuses to capture one.

ONNX Runtime keeps shape arithmetic on the CPU (`Shape` and the small integer ops over its
results), since a CUDA kernel reads shapes, starts and axes through host-memory ports. A value so
computed is free where a host port reads it (Reshape's shape, Slice's starts, Range's limits) and
costs a `MemcpyFromHost` where a device port does (`Sub(write_index, S)`). Seen on an H200 with
onnxruntime-gpu 1.31.1 (bench/onnx_placement.py): exactly the values this finds in a graph.
"""

from __future__ import annotations

import onnx

SIZES = {"Shape", "Size"}
# Integer arithmetic over shapes that ONNX Runtime leaves on the CPU with its inputs.
SCALAR_OPS = {
    "Gather", "Squeeze", "Unsqueeze", "Concat", "Slice", "Cast", "Identity", "Add", "Sub", "Mul",
    "Div", "Mod", "Neg", "Abs", "Max", "Min", "Equal", "Less", "Greater", "Where", "Not", "And", "Or", "Reshape",
}  # fmt: skip
# Inputs a CUDA kernel reads from host memory (by op type, input positions).
HOST_PORTS = {
    "Reshape": {1}, "Expand": {1}, "Slice": {1, 2, 3, 4}, "Range": {0, 1, 2}, "ConstantOfShape": {0},
    "Squeeze": {1}, "Unsqueeze": {1}, "Tile": {1}, "TopK": {1}, "Split": {1}, "CumSum": {1},
    "ReduceSum": {1}, "ReduceMax": {1}, "ReduceMin": {1}, "ReduceMean": {1}, "Trilu": {1},
}  # fmt: skip


def host_values_read_on_the_device(graph: onnx.GraphProto) -> list[str]:
    """'value (from OP) -> OP' for each shape value a node reads through a device port."""
    constants = {init.name for init in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    host, made_by, found = set(), {}, []
    for node in graph.node:  # ONNX lists nodes in topological order
        inputs = [name for name in node.input if name]
        on_host = node.op_type in SIZES or (
            node.op_type in SCALAR_OPS
            and inputs
            and all(n in host or n in constants for n in inputs)
            and any(n in host for n in inputs)
        )
        if on_host:
            host.update(node.output)
            made_by.update((out, node.op_type) for out in node.output)
            continue
        ports = HOST_PORTS.get(node.op_type, set())
        found += [
            f"{name} (from {made_by[name]}) -> {node.op_type}"
            for i, name in enumerate(node.input)
            if name in host and i not in ports
        ]
    return found
