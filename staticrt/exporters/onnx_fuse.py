"""The exported graph's RMSNorms and rotary embeddings as the standard ops opset 23 has for them.

torch's exporter writes each RMSNorm out op by op (Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul,
Mul) and each rotary embedding too (two Slices, Neg, Concat, two Muls, Add): about 27 nodes a layer
that ONNX Runtime runs one by one (its graph optimizer, at its highest level, left every one of
them in place: counted in the graph it writes with `optimized_model_filepath`). `fuse_graph`
rewrites each into one `RMSNormalization` or `RotaryEmbedding` node, one kernel each in ONNX
Runtime's CPU provider (its CUDA provider has both too; not yet run on a GPU).

Why: in a small model's decode step these nodes cost what separated ONNX Runtime from llama.cpp.
SmolLM2-135M exported with `--quantize int8`, 2 threads, decode ms/token, alternating processes
beside llama.cpp Q8_0 (docs/measurements.md): 6.47-6.58 as written by torch, 5.54-5.92 fused, Q8_0
5.69-5.94. Float graphs are fused too, and give the same tokens (tests/test_onnx.py against
transformers).

What is matched, exactly (anything else is left as it was, and counted out):
- RMSNorm in float32: `Mul(s, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps)))))`
  -> `RMSNormalization(x, s, axis=-1, epsilon=eps)`; `s` is the weight, or Gemma2's `1 + w`.
  A chain with a Cast inside it stays: Llama's in bfloat16 or float16, which rounds before the
  weight as transformers does (Gemma2's multiplies in float32 and casts after: it fuses).
- rotate_half: `Add(Mul(t, cos), Mul(Concat(Neg(t[..., h:]), t[..., :h]), sin))` over tables
  `cos = Unsqueeze(Cos(Concat(f, f)), 1)`, `sin` alike, where `f [B, S, h]` are the step's
  position x inverse-frequency products -> `RotaryEmbedding(t, Cos(f), Sin(f))`, non-interleaved,
  `t [B, H, S, 2h]` (the op's 4D layout; tables of the op's 3D form `[B, S, h]`, no position ids).
  In bfloat16 or float16 the tables are cast before the Unsqueeze, and the pattern stays.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

FUSED_OPS = ("RMSNormalization", "RotaryEmbedding")


class GraphIndex:
    """Who makes and who reads each value, and the values known without running the graph."""

    def __init__(self, nodes: list[Any], initializers: Any) -> None:
        from onnx import numpy_helper

        self.producer = {out: node for node in nodes for out in node.output}
        self.readers: dict[str, list[Any]] = {}
        for node in nodes:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.dims = {init.name: list(init.dims) for init in initializers}
        inline = [init for init in initializers if not init.external_data]
        self.constants = {init.name: numpy_helper.to_array(init).tolist() for init in inline}
        for node in nodes:
            if node.op_type == "Constant" and node.attribute[0].name == "value":
                self.constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t).tolist()

    def made_by(self, name: str, op: str) -> Any:
        """The node of type `op` that makes `name`, or None."""
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def sole_reader(self, node: Any, op: str) -> Any:
        """The one node reading `node`'s output, if it is of type `op`; else None."""
        readers = self.readers.get(node.output[0], [])
        return readers[0] if len(readers) == 1 and readers[0].op_type == op else None

    def constant(self, name: str) -> Any:
        return self.constants.get(name)


def attribute(node: Any, name: str, default: Any = None) -> Any:
    """`node`'s attribute `name`, or `default`."""
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _other(node: Any, name: str) -> str | None:
    """The input of a two-input node that is not `name` (None where both are, or neither)."""
    inputs = list(node.input)
    if len(inputs) != 2 or inputs.count(name) != 1:
        return None
    return inputs[1 - inputs.index(name)]


Match = tuple[list[Any], Any, str | None]  # a pattern's nodes, the node replacing them, its angles f


def _rms_norm(g: GraphIndex, power: Any) -> Match | None:
    """The RMSNorm chain that starts at `power`."""
    from onnx import helper

    x = power.input[0]
    if g.constant(power.input[1]) != 2.0:
        return None
    mean = g.sole_reader(power, "ReduceMean")
    axes = g.constant(mean.input[1]) if mean is not None and len(mean.input) == 2 else None
    if axes != [-1] or attribute(mean, "keepdims", 1) != 1:
        return None
    add = g.sole_reader(mean, "Add")
    eps = g.constant(_other(add, mean.output[0]) or "") if add is not None else None
    sqrt = g.sole_reader(add, "Sqrt") if isinstance(eps, float) else None
    inverse = g.sole_reader(sqrt, "Reciprocal") if sqrt is not None else None
    scaled = g.sole_reader(inverse, "Mul") if inverse is not None else None
    if scaled is None or _other(scaled, inverse.output[0]) != x:
        return None
    weighted = g.sole_reader(scaled, "Mul")
    weight = _other(weighted, scaled.output[0]) if weighted is not None else None
    if weight is None:
        return None
    fused = helper.make_node("RMSNormalization", [x, weight], [weighted.output[0]], axis=-1, epsilon=eps, stash_type=1)
    return [power, mean, add, sqrt, inverse, scaled, weighted], fused, None


def _half_table(g: GraphIndex, table: str, op: str) -> str | None:
    """`f` where `table = Unsqueeze(op(Concat(f, f)), [1])`, else None."""
    unsqueeze = g.made_by(table, "Unsqueeze")
    trig = g.made_by(unsqueeze.input[0], op) if unsqueeze is not None else None
    if trig is None or g.constant(unsqueeze.input[1]) != [1]:
        return None
    doubled = g.made_by(trig.input[0], "Concat")
    if doubled is None or len(doubled.input) != 2 or doubled.input[0] != doubled.input[1]:
        return None
    return doubled.input[0]


def _half_width(g: GraphIndex, f: str) -> int | None:
    """The width h of `f = positions * inv_freq`: the inverse frequencies' length."""
    product = g.made_by(f, "Mul")
    widths = [g.dims[name][-1] for name in (product.input if product is not None else ()) if g.dims.get(name)]
    return widths[0] if len(widths) == 1 else None


def _slice_of(g: GraphIndex, name: str, start: int, end: int) -> str | None:
    """`t` where `name = t[..., start:end]` on the last axis (an end past the axis reads to it)."""
    cut = g.made_by(name, "Slice")
    if cut is None or len(cut.input) < 4:
        return None
    step = g.constant(cut.input[4]) if len(cut.input) > 4 else [1]
    bounds = (g.constant(cut.input[1]), g.constant(cut.input[2]), g.constant(cut.input[3]), step)
    if bounds[0] != [start] or bounds[2] not in ([-1], [3]) or bounds[3] != [1]:
        return None
    reaches = bounds[1] == [end] or (end < 0 and isinstance(bounds[1], list) and bounds[1][0] >= 2 * start)
    return cut.input[0] if reaches else None


def _rotary(g: GraphIndex, negate: Any) -> Match | None:
    """The rotate_half pattern around `negate`."""
    from onnx import helper

    joined = g.sole_reader(negate, "Concat")
    if joined is None or list(joined.input)[:1] != [negate.output[0]] or len(joined.input) != 2:
        return None
    if attribute(joined, "axis") not in (-1, 3):
        return None
    by_sin = g.sole_reader(joined, "Mul")
    total = g.sole_reader(by_sin, "Add") if by_sin is not None else None
    by_cos = g.made_by(_other(total, by_sin.output[0]) or "", "Mul") if total is not None else None
    if by_cos is None:
        return None
    f = _half_table(g, _other(by_sin, joined.output[0]) or "", "Sin")
    h = _half_width(g, f) if f is not None else None
    t = _slice_of(g, negate.input[0], h, -1) if h else None
    if t is None or _slice_of(g, joined.input[1], 0, h) != t or _other(by_cos, t) is None:
        return None
    if _half_table(g, _other(by_cos, t), "Cos") != f:
        return None
    halves = [g.producer[negate.input[0]], g.producer[joined.input[1]]]
    fused = helper.make_node("RotaryEmbedding", [t, f"{f}.cos", f"{f}.sin"], [total.output[0]], interleaved=0)
    return [*halves, negate, joined, by_sin, by_cos, total], fused, f


def fuse_graph(path: Path) -> dict[str, int]:
    """Rewrite the graph at `path` (weights as external data, untouched) with its RMSNorms and
    rotary embeddings fused; returns how many of each it fused (zero where none matched)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node)  # one list: nodes are told apart by id() below
    g = GraphIndex(nodes, model.graph.initializer)
    replaced: dict[int, list[Any]] = {}  # id(last node of a pattern) -> [its fused node]
    dropped: set[int] = set()
    counts: Counter[str] = Counter()
    matchers = {"Pow": _rms_norm, "Neg": _rotary}
    for node in nodes:
        match = matchers[node.op_type](g, node) if node.op_type in matchers else None
        if match is None or any(id(n) in dropped for n in match[0]):
            continue
        pattern, fused, f = match
        if f is not None:  # the half tables, once a step, right after the node making their angles
            angles = g.producer[f]
            replaced[id(angles)] = [
                angles,
                helper.make_node("Cos", [f], [f"{f}.cos"]),
                helper.make_node("Sin", [f], [f"{f}.sin"]),
            ]
        dropped.update(id(n) for n in pattern)
        replaced[id(pattern[-1])] = [fused]
        counts[fused.op_type] += 1
    rewritten = spliced(nodes, replaced, dropped)
    del model.graph.node[:]
    model.graph.node.extend(_without_dead_nodes(rewritten, {out.name for out in model.graph.output}))
    onnx.save(model, str(path))
    return {op: counts[op] for op in FUSED_OPS}


def spliced(nodes: list[Any], replaced: dict[int, list[Any]], dropped: set[int]) -> list[Any]:
    """`nodes` in their order, each one `replaced` names (by id) as its list of nodes, and each other
    one in `dropped` left out: a rewrite keeps the graph's order, which ONNX requires topological."""
    kept = []
    for node in nodes:
        if id(node) in replaced:
            kept += replaced[id(node)]
        elif id(node) not in dropped:
            kept.append(node)
    return kept


def _without_dead_nodes(nodes: list[Any], outputs: set[str]) -> list[Any]:
    """`nodes` less those whose outputs nothing reads (the full tables once every use is fused)."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        alive = [node for node in nodes if any(out in read for out in node.output)]
        if len(alive) == len(nodes):
            return alive
        nodes = alive
