"""Where ONNX Runtime's CUDA provider puts an artifact's graph: the copies between host and device
it inserts, which keep it from capturing a CUDA graph (`OnnxCudaGraphWarning`), and what each copy
sits between. Needs a CUDA GPU and onnxruntime-gpu.

    python bench/onnx_placement.py ARTIFACT_FOLDER

ONNX Runtime writes the graph as it will run it (partitioned, the copies inserted) to a temporary
file (`SessionOptions.optimized_model_filepath`); this reads the copies back out of it. ONNX
Runtime's own placement log (log level 0) goes to standard error beside it.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort


def main() -> None:
    folder = Path(sys.argv[1])
    section = json.loads((folder / "manifest.json").read_text())["onnx"]
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 0
        options.optimized_model_filepath = str(Path(tmp) / "placed.onnx")
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "0"}), "CPUExecutionProvider"]
        ort.InferenceSession(str(folder / section["graph"]), options, providers=providers)
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    copies = [node for node in graph.node if node.op_type.startswith("Memcpy")]
    print(f"{len(graph.node)} nodes, {len(copies)} copies between host and device")
    for node in copies:
        source = producers.get(node.input[0])
        origin = f"{source.op_type} {source.name}" if source else "a graph input"
        into = ", ".join(f"{c.op_type} {c.name}" for c in consumers[node.output[0]])
        print(f"{node.op_type}: {node.input[0]} from {origin} -> {into}")


if __name__ == "__main__":
    main()
