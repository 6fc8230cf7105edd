"""The packed copy of an ONNX graph (backends/onnx_packed.py, onnx_aligned.py) on a graph where
ONNX Runtime's own layout of the saved weights crashes it: no torch, no model, one child process a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest

# A float MatMul [3, 120] then [120, 40], run through backends/onnx_packed.py in a child process
# (a crash must fail the test, not the worker): ONNX Runtime 1.31.1 saves the first MatMul's
# packed B right after its 1,440 bytes, 32 bytes off the 64-byte boundary MLAS's aligned loads need.
_PACKED_CHILD = """
import json, sys
import numpy as np, onnxruntime as ort
from pathlib import Path
from staticrt.backends.onnx_packed import packed_session
graph = Path(sys.argv[1])
made = packed_session(
    graph, {"files": {"onnx/m.onnx": "g", "onnx/m.onnx.data": "d"}},
    lambda path, options: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]),
    ort.SessionOptions,
)
x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
print(json.dumps(made.run(None, {"x": x})[0].tolist()))
"""


def test_a_packed_copy_places_every_blob_where_mlas_reads_it_and_runs_as_the_graph_does(tmp_path):
    """ONNX Runtime's own layout of a saved graph's prepacked weights crashes its MatMul
    (backends/onnx_aligned.py); the copy in the user cache puts every tensor and blob on a page
    and gives the graph's outputs, in the process that writes it and in a later one."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 120), (120, 40))]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["y"]), helper.make_node("MatMul", ["y", "w1"], ["z"])]
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 40])],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    (tmp_path / "onnx").mkdir()
    path = tmp_path / "onnx" / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    expected = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    env = {**os.environ, "STATICRT_CACHE": str(tmp_path / "cache")}
    for _ in ("writes the copy", "loads it"):
        command = [sys.executable, "-c", _PACKED_CHILD, str(path)]
        child = subprocess.run(command, capture_output=True, text=True, env=env)
        assert child.returncode == 0, child.stderr[-2000:]
        assert np.array_equal(np.array(json.loads(child.stdout)), expected)
    (copy,) = (tmp_path / "cache" / "onnx").glob("*/model.onnx")
    saved = onnx.load(str(copy), load_external_data=False).graph.initializer
    offsets = [
        int(part.split(";")[0])
        for tensor in saved
        for entry in tensor.external_data
        if entry.key == "offset" or entry.key.startswith("prepacked")
        for part in (entry.value.split("|")[1:] if entry.key.startswith("prepacked") else [entry.value])
    ]
    blobs = sum(entry.key.startswith("prepacked") for tensor in saved for entry in tensor.external_data)
    assert blobs == 2 and len(offsets) == 4 and all(offset % 4096 == 0 for offset in offsets), offsets


def test_external_data_in_a_form_it_does_not_know_is_refused_by_name_and_the_files_are_left(tmp_path):
    """A saved graph whose prepacked entry is not ONNX Runtime 1.31's `key|offset;length;checksum`
    (another version's form) is not laid out half: the error names the tensor, and the graph and
    its data file are as they were (the packed copy then falls back to the artifact's graph)."""
    from onnx import TensorProto, helper, numpy_helper

    from staticrt.backends.onnx_aligned import align_external_data
    from staticrt.errors import StaticrtError

    weight = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None, 4]) for name in ("x", "y")]
    model = helper.make_model(helper.make_graph([node], "one", io[:1], io[1:], [weight]), ir_version=9)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    saved = onnx.load(str(path), load_external_data=False)
    saved.graph.initializer[0].external_data.add(key="prepacked_1", value="MatMul+1|64;no-length")
    onnx.save(saved, str(path))
    before = path.read_bytes(), (tmp_path / "m.onnx.data").read_bytes()
    with pytest.raises(StaticrtError, match=r"the external data of 'w' is not in the form this staticrt lays out"):
        align_external_data(path, tmp_path / "m.onnx.data")
    assert (path.read_bytes(), (tmp_path / "m.onnx.data").read_bytes()) == before
    assert sorted(found.name for found in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]  # nothing half-written
