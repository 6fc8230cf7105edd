"""Quantized ONNX artifacts (`export --format onnx --quantize ...`, exporters/onnx_quantize.py): each
weight in ONNX Runtime's MatMulNBits, read back and dequantized against the float weight it came
from; onnxruntime-genai runs the artifact token for token as staticrt's runner does; the bench
times the quantized graph beside the float one."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from genai_runner import genai_greedy
from onnx import numpy_helper

import staticrt
from staticrt.bench import run_bench
from staticrt.cli import main
from staticrt.runtime import load_artifact

PROMPT = [5, 17, 99, 3, 250, 31, 7]


def dequantized(node: onnx.NodeProto, initializers: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A MatMulNBits node's weight as floats `[N, K]`, and each element's scale `[N, K]`, from its
    packed blocks `[N, K/block, block*bits/8]` (low nibble first), scales and uint zero points."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    packed, scales, zeros = (initializers[name] for name in node.input[1:4])
    blocks = -(-k // block)
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks * block)
        zeros = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        q = packed.reshape(n, blocks * block)
    scales = scales.reshape(n, blocks)
    per_element = np.repeat(scales, block, axis=1)
    weight = (q.astype(np.float32) - np.repeat(zeros.reshape(n, blocks), block, axis=1)) * per_element
    return weight[:, :k], per_element[:, :k]


def test_the_onnx_graph_holds_each_weight_in_matmulnbits_and_genai_runs_it(hf_checkpoints, tmp_path, capsys):
    """The tied tiny Llama at int4: every projection at 4 bits in groups of 32, the head (a
    transposed copy of the tied embedding, which the graph keeps in float32 for its lookup) at 8
    bits; each dequantizes to its float weight within half a step of its block."""
    folder = hf_checkpoints["llama-linear-tied"][0]
    out = tmp_path / "int4"
    argv = ["export", "--model", str(folder), "--format", "onnx", "--quantize", "int4", "--max-cache-len", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "int4-g32 weights) to" in said
    assert "done quantize the weights to int4-g32 (ONNX Runtime's MatMulNBits)" in said
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx"]["quantize"] == {
        "name": "int4-g32",
        "op": "com.microsoft.MatMulNBits",
        "accuracy_level": 4,
        "projections": {"bits": 4, "block_size": 32},
        "head": {"bits": 8, "block_size": 64},
    }
    graph = onnx.load(str(out / "onnx" / "model.onnx")).graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    assert not [node.op_type for node in graph.node if node.op_type in ("Gemm", "MatMul")]
    model = staticrt.load_model(folder)
    floats = {name: p.detach().numpy() for name, p in model.named_parameters(prefix="model")}
    assert model.lm_head is None and initializers["model.embed_tokens.weight"].dtype == np.float32
    seen = {}
    for node in (node for node in graph.node if node.op_type == "MatMulNBits"):
        source = node.input[1].rsplit("_Q", 1)[0].removesuffix(".T")
        weight, scale = dequantized(node, initializers)
        assert weight.shape == floats[source].shape, source
        assert np.all(np.abs(weight - floats[source]) <= scale / 2 + 1e-6), source
        seen[source] = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits"))
    projections = {name for name in floats if name.endswith("proj.weight")}
    assert seen == {**dict.fromkeys(projections, 4), "model.embed_tokens.weight": 8}

    og = pytest.importorskip(
        "onnxruntime_genai", reason="install onnxruntime-genai (--no-deps), as the README's test command does"
    )
    tokens = load_artifact(out, backend="onnx").generate([PROMPT], max_new_tokens=24)[0]
    assert genai_greedy(og, og.Model(str(out)), PROMPT, 24) == tokens


def test_bench_times_the_graph_quantized_from_the_float_weights():
    report = run_bench("tiny-llama", ["onnx"], new_tokens=4, prompt_len=8, repeats=1, quantize=("int8",))
    assert list(report["backends"]) == ["onnx-int8"] and list(report["weight_bytes_per_step"]) == ["none"]
    int8 = report["backends"]["onnx-int8"]
    assert int8["quantize"] == "int8" and len(int8["tokens"][0]) == 4
    # int8 blocks of 64 with a float32 scale and a uint8 zero point each: 69 bytes for 256 in float32
    assert int8["weight_bytes_per_step"] < report["weight_bytes_per_step"]["none"] / 3
