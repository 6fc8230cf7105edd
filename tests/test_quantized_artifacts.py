"""Quantized artifacts. ONNX (`export --format onnx --quantize ...`, exporters/onnx_quantize.py): each
weight in ONNX Runtime's MatMulNBits, read back and dequantized against the float weight it came
from; onnxruntime-genai runs the artifact token for token as staticrt's runner does; the bench
times the quantized graph beside the float one. pt2 / AOTInductor: torchao's weights unwrapped into
plain tensors, stored once, run without torchao with the eager / compiled backends' tokens."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from genai_runner import genai_greedy
from onnx import numpy_helper

import staticrt
from staticrt.artifacts.manifest import INDEXED_LOGITS, LOGITS_INDEX, aoti_package_weights
from staticrt.bench import run_bench
from staticrt.bench.perplexity import perplexity
from staticrt.cli.main import main
from staticrt.generation.generator import load_artifact

PROMPT = [5, 17, 99, 3, 250, 31, 7]


def dequantized(
    node: onnx.NodeProto, initializers: dict[str, np.ndarray], inputs: int | None = None
) -> tuple[np.ndarray, ...]:
    """A MatMulNBits node's weight as floats `[N, K]`, each element's step `[N, K]`, and where a
    symmetric grid's top code clips, from its packed blocks `[N, K/block, block*bits/8]` (low
    nibble first), scales and uint zero points. Without zero points the grid is symmetric: each is
    2^(bits-1) (the op's default), and the scale, negative where the block's largest magnitude is
    positive, puts that weight at code 0; a weight of the other sign as large would lie one code
    past the top and is clipped to it (within a step). `inputs`: the layer's width K where the node
    reads `[x, 0.., S(x), 0..]` (onnx_q4_min.py), whose block j's residual, row ceil(K/block)*block + j,
    is added to each weight of block j."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    packed, scales = (initializers[name] for name in node.input[1:3])
    blocks = -(-k // block)
    zeros = initializers[node.input[3]] if len(node.input) > 3 else np.full(n * blocks, 2 ** (bits - 1), np.uint8)
    if bits == 4 and len(node.input) > 3:
        zeros = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1) if bits == 4 else packed
    q = q.reshape(n, blocks * block)
    scales = scales.reshape(n, blocks)
    per_element = np.repeat(scales, block, axis=1)
    weight = (q.astype(np.float32) - np.repeat(zeros.reshape(n, blocks), block, axis=1)) * per_element
    if inputs is not None:
        k, first = inputs, -(-inputs // block) * block
        weight[:, :first] += np.repeat(weight[:, first : first + first // block], block, axis=1)
    clipped = (q == 2**bits - 1) & (len(node.input) == 3)
    return weight[:, :k], np.abs(per_element[:, :k]), clipped[:, :k]


def lookup_rows(graph: onnx.GraphProto, initializers: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """The rows `[N, K]` the graph's embedding lookup (onnx_lookup.py's nodes, named after the
    Gather they replaced) gives for the token ids `[N]`, run alone by ONNX Runtime."""
    (lookup,) = [node for node in graph.node if node.op_type == "GatherBlockQuantized"]
    prefix = lookup.name.rsplit(".", 1)[0] + "."
    nodes = [node for node in graph.node if node.name.startswith(prefix)]
    read = {name for node in nodes for name in node.input}
    (out,) = [name for node in nodes for name in node.output if name not in read]
    sub = onnx.helper.make_graph(
        nodes,
        "lookup",
        [onnx.helper.make_tensor_value_info(lookup.input[1], onnx.TensorProto.INT64, [None])],
        [onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(initializers[name], name) for name in sorted(read & set(initializers))],
    )
    opsets = [onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(sub, opset_imports=opsets, ir_version=10)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {lookup.input[1]: ids})[0]


def test_the_onnx_graph_holds_each_weight_in_matmulnbits_and_genai_runs_it(hf_checkpoints, tmp_path, capsys):
    """The tied tiny Llama at int4: every projection at 4 bits in groups of 32, the head (a
    transposed copy of the tied embedding) at 8 bits; each dequantizes to its float weight within
    half a step of its block. The lookup reads the head's codes (GatherBlockQuantized): no float
    table is left, and each row it gives is the head's row dequantized, exactly."""
    folder = hf_checkpoints["llama-linear-tied"][0]
    out = tmp_path / "int4"
    argv = ["export", "--model", str(folder), "--format", "onnx", "--quantize", "int4", "--max-cache-len", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "int4-g32 weights) to" in said
    assert "done quantize the weights to int4-g32 (ONNX Runtime's MatMulNBits)" in said
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx"]["fused"]["GroupQueryAttention"] == 2  # each layer's attention (onnx_gqa.py)
    assert manifest["onnx"]["quantize"] == {
        "name": "int4-g32",
        "op": "com.microsoft.MatMulNBits",
        "accuracy_level": 4,
        "projections": {"bits": 4, "block_size": 32, "symmetric": False},
        "head": {"bits": 8, "block_size": 64, "symmetric": True},
        "embedding": {"op": "com.microsoft.GatherBlockQuantized", "bits": 8, "block_size": 64, "codes": "the head's"},
    }
    graph = onnx.load(str(out / "onnx" / "model.onnx")).graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    assert not [node.op_type for node in graph.node if node.op_type in ("Gemm", "MatMul")]
    model = staticrt.load_model(folder)
    floats = {name: p.detach().numpy() for name, p in model.named_parameters(prefix="model")}
    assert model.lm_head is None and not [
        name
        for name in initializers
        if initializers[name].dtype == np.float32
        and initializers[name].size >= floats["model.embed_tokens.weight"].size
    ]
    seen = {}
    for node in (node for node in graph.node if node.op_type == "MatMulNBits"):
        source = node.input[1].rsplit("_Q", 1)[0].removesuffix(".T")
        weight, scale, clipped = dequantized(node, initializers)
        assert weight.shape == floats[source].shape, source
        error = np.abs(weight - floats[source])
        assert np.all((error <= scale / 2 + 1e-6) | (clipped & (error <= scale + 1e-6))), source
        seen[source] = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits"))
        if source == "model.embed_tokens.weight":
            ids = np.array([0, 7, 255, 7, 31])
            np.testing.assert_array_equal(lookup_rows(graph, initializers, ids), weight[ids])
    projections = {name for name in floats if name.endswith("proj.weight")}
    assert seen == {**dict.fromkeys(projections, 4), "model.embed_tokens.weight": 8}

    og = pytest.importorskip(
        "onnxruntime_genai", reason="install onnxruntime-genai (--no-deps), as the README's test command does"
    )
    tokens = load_artifact(out, backend="onnx").generate([PROMPT], max_new_tokens=24)[0]
    assert genai_greedy(og, og.Model(str(out)), PROMPT, 24) == tokens


def test_an_untied_table_is_looked_up_in_int8_codes_of_its_own(tmp_path):
    """An untied model's table at int8 in blocks of 64 along a row, symmetric (zero point 128): a
    hidden size of 96 pads the second block, which the lookup slices off; each row within half a
    step of its float values, and the float table gone from the graph."""
    from hf_models import save_hf_model

    from staticrt.caches import CacheSpec
    from staticrt.exporters import export_artifact
    from staticrt.models.quant_spec import QuantSpec

    save_hf_model("llama", tmp_path / "hf", hidden_size=96, intermediate_size=128)
    model = staticrt.load_model(tmp_path / "hf")
    spec = CacheSpec("static", 1, 64)
    out = export_artifact(model, spec, [16], tmp_path / "int8", ["onnx"], quantize=QuantSpec(8, None, None))
    graph = onnx.load(str(out / "onnx" / "model.onnx")).graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    table = model.embed_tokens.weight.detach().numpy()  # [256, 96]
    assert "model.embed_tokens.weight" not in initializers
    assert initializers["model.embed_tokens.weight_Q8"].shape == (256, 2, 64)
    steps = np.repeat(initializers["model.embed_tokens.weight_scales"], 64, axis=1)[:, :96]
    ids = np.arange(256)
    assert np.all(np.abs(lookup_rows(graph, initializers, ids) - table) <= steps / 2 + 1e-7)
    assert np.all(initializers["model.embed_tokens.weight_Q8"][:, 1, 32:] == 128)  # the padding: zeros
    assert len(load_artifact(out, "onnx").generate([PROMPT], max_new_tokens=8)[0]) == 8


def on_q4_1_grids(weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`weight [N, K]` as a Q4_1 GGUF holds it: each block of `block` inputs (a ragged last one
    too) at its minimum plus a multiple of (max - min)/15."""
    out = weight.clone()
    for start in range(0, weight.shape[1], block):
        part = weight[:, start : start + block]
        low, high = part.min(dim=1, keepdim=True).values, part.max(dim=1, keepdim=True).values
        step = (high - low) / 15
        out[:, start : start + block] = low + step * torch.round((part - low) / step)
    return out


def test_weights_on_4_bit_grids_keep_their_codes_and_steps_and_their_minima_within_a_thirtieth_of_a_step(tmp_path):
    """A model dequantized from a 4-bit GGUF (its blocks on Q4_1's grids: SmolLM2 here read +21.8%
    perplexity at int4 with ONNX Runtime's integer zero points) keeps each block's codes and step,
    and its minimum through the nearest integer zero point plus a residual on a grid of its own
    (onnx_q4_min.py): every weight within half a residual step, which is at most 1/15 of the
    column's largest step; and the graph's first tokens are the eager model's. A width of 80
    leaves a ragged last block."""
    from hf_models import save_hf_model

    from staticrt.caches import CacheSpec
    from staticrt.exporters import export_artifact
    from staticrt.models.quant_spec import parse_quantize

    save_hf_model("llama", tmp_path / "hf", intermediate_size=80)
    model = staticrt.load_model(tmp_path / "hf")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("proj"):
                module.weight.copy_(on_q4_1_grids(module.weight))
    spec = CacheSpec("static", 1, 64)
    out = export_artifact(model, spec, [16], tmp_path / "int4", ["onnx"], quantize=parse_quantize("int4"))
    projections = json.loads((out / "manifest.json").read_text())["onnx"]["quantize"]["projections"]
    minimum = "integer zero point and a 4-bit residual a block"
    assert projections == {"bits": 4, "block_size": 32, "minimum": minimum}
    graph = onnx.load(str(out / "onnx" / "model.onnx")).graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    floats = {name: p.detach().numpy() for name, p in model.named_parameters(prefix="model")}
    seen = set()
    for node in (node for node in graph.node if node.op_type == "MatMulNBits"):
        source = node.input[1].rsplit("_Q", 1)[0].removesuffix(".T")
        if source.endswith("proj.weight"):
            width = floats[source].shape[1]
            weight, step, _ = dequantized(node, initializers, inputs=width)
            blocks = -(-width // 32)  # then one block of residuals (at most 32 blocks a row here)
            residual_step = initializers[node.input[2]].reshape(weight.shape[0], blocks + 1)[:, blocks:]  # [N, 1]
            assert np.all(residual_step <= step.max(axis=1, keepdims=True) / 15 * (1 + 1e-6)), source
            assert np.all(np.abs(weight - floats[source]) <= residual_step / 2 + 1e-6), source
            seen.add(source)
    assert seen == {name for name in floats if name.endswith("proj.weight")}
    # the head's int8 codes and the int8 activations part the two later (at the 12th token here)
    eager = staticrt.Generator(model, max_cache_len=64).generate([PROMPT], 8)
    assert load_artifact(out, "onnx").generate([PROMPT], max_new_tokens=8) == eager


@pytest.fixture(scope="module")
def float_graph(smollm2, english_text, tmp_path_factory) -> tuple[list[int], float, Path]:
    """The text's token ids, the float model's perplexity over them and its float ONNX graph
    (`staticrt export`, cache as long as the text), made once for both widths: each quantizes a
    copy, as `--quantize` does after the same export (a SmolLM2 export is ~40 s)."""
    model = staticrt.load_model(smollm2)
    ids = model.tokenizer.encode(english_text)
    out = tmp_path_factory.mktemp("float") / "artifact"
    argv = ["export", "--model", str(smollm2), "--format", "onnx", "--max-cache-len", str(len(ids))]
    assert main([*argv, "--out", str(out)]) == 0
    return ids, perplexity(model, ids), out / "onnx"


@pytest.mark.parametrize("quantize,within", [("int8", 1.01), ("int4", 1.05)])
def test_the_onnx_quantized_graph_keeps_the_real_models_perplexity(
    smollm2_gguf, float_graph, tmp_path, quantize, within
):
    """SmolLM2-135M over the whole of tests/data's text (2,211 predictions, one graph step that
    returns every column's logits), the lookup's rows the head's int8 codes. int8 (symmetric
    blocks of 64, int8 activations in blocks of 64) within 1% of the float model's perplexity
    (measured +0.61%, +0.90% with float rows; over the first 512 tokens alone every int8 layout
    reads higher, +1.3% at this one, so the whole text it is). int4 within 5% (measured +0.52%:
    the GGUF's own Q4_1 codes and steps kept, +21.8% with ONNX Runtime's integer zero points) in at
    most 1.2x the bytes of the Q4_1 GGUF the model came from (measured 1.05x)."""
    from staticrt.exporters.onnx_quantize import EMBEDDING, quantize_graph
    from staticrt.models.quant_spec import parse_quantize

    ids, reference, floats = float_graph
    folder = shutil.copytree(floats, tmp_path / quantize)
    layouts = quantize_graph(folder / "model.onnx", parse_quantize(quantize), EMBEDDING)  # SmolLM2's head is tied
    if quantize == "int4":
        assert "minimum" in layouts["projections"]
        size = sum(f.stat().st_size for f in folder.iterdir())
        assert size <= 1.2 * smollm2_gguf.stat().st_size, (size, smollm2_gguf.stat().st_size)
    # One thread: the 2,211-column step is long, and with two it stalls the other pytest worker's
    # CPU-bound steps for seconds at a time (an eager 32-token prefill and a decode step beside it:
    # up to 3.2 s with two threads, 0.6 s with one, 0.1 s alone), which that worker's timing checks feel.
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    graph = str(folder / "model.onnx")
    session = onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    n = len(ids) - 1
    feed = {
        "input_ids": np.array([ids[:n]]),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n)[None],
        LOGITS_INDEX: np.arange(-n, 0),
    }
    for spec in session.get_inputs():  # every cache empty: [1, H_kv, N, D]
        if spec.name.startswith("past_key_values."):
            feed[spec.name] = np.zeros([1, *spec.shape[1:]], np.float32)
    logits = torch.from_numpy(session.run([INDEXED_LOGITS], feed)[0][0]).double()  # [n, V]
    quantized = math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item())  # as `perplexity`
    assert len(ids) == 2212 and quantized / reference < within, (quantized, reference)


def test_bench_times_the_graph_quantized_from_the_float_weights():
    report = run_bench("tiny-llama", ["onnx"], new_tokens=4, prompt_len=8, repeats=1, quantize=("int8",))
    assert list(report["backends"]) == ["onnx-int8"] and list(report["weight_bytes_per_step"]) == ["none"]
    int8 = report["backends"]["onnx-int8"]
    assert int8["quantize"] == "int8" and len(int8["tokens"][0]) == 4
    # int8 blocks of 64 with a float32 scale each (symmetric: no zero points): 68 bytes for 256 in float32
    assert int8["weight_bytes_per_step"] < report["weight_bytes_per_step"]["none"] / 3
    assert int8["kernel"] == "ONNX Runtime com.microsoft.MatMulNBits (accuracy_level 4: int8 activations)"


def test_pt2_and_aoti_artifacts_hold_torchaos_weights_once_and_run_without_torchao(tmp_path):
    """`export --quantize int8-wo --format pt2,aoti` (and int4-g32): weights.safetensors holds the int8 data and scales
    (torchao's tensors unwrapped into plain ones), at most 1.1x the quantized model's bytes; the pt2
    programs give the eager backend's tokens (the same dequantizing matmul), the AOTInductor packages
    the compiled backend's (the same fused int8 / int4 kernel), in a process where torchao cannot load.
    The int4 packages hold the one constant inductor adds a matmul (its group size), nothing more."""
    pytest.importorskip("torchao", reason="quantization needs torchao: install the test extra")
    from safetensors import safe_open

    from staticrt.bench.probes import stored_bytes

    prompt, argv = [5, 17, 99, 3, 250], ["export", "--model", "tiny-llama", "--max-cache-len", "64"]
    tokens = {}
    for quantize, formats in (("int8-wo", "pt2,aoti"), ("int4-g32", "pt2,aoti")):
        out = tmp_path / quantize
        assert main([*argv, "--quantize", quantize, "--format", formats, "--out", str(out)]) == 0
        model = staticrt.load_model("tiny-llama", quantize=quantize)
        for backend in ("eager", "compiled"):
            gen = staticrt.Generator(model, max_cache_len=64, backend=backend)
            tokens[quantize, backend] = gen.generate([prompt], max_new_tokens=24)[0]
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["quantize"], manifest["dtype"]) == (quantize, "bfloat16")
        with safe_open(out / "weights.safetensors", "pt") as weights:
            dtypes = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}
        data = "model.layers.0.mlp.down_proj.parametrizations.weight.original0"
        assert dtypes[data] == ("I8" if quantize == "int8-wo" else "U8")
        assert not [name for name in dtypes if name.endswith("proj.weight")]  # no float projection left
        size = (out / "weights.safetensors").stat().st_size
        assert size <= 1.1 * sum(stored_bytes(p) for p in model.parameters())
    script = (
        "import sys, json; sys.modules['torchao'] = None\n"
        "from staticrt.generation.generator import load_artifact\n"
        "runs = [('int8-wo', 'pt2'), ('int8-wo', 'aoti'), ('int4-g32', 'pt2'), ('int4-g32', 'aoti')]\n"
        f"print(json.dumps([load_artifact('{tmp_path}/' + q, backend=b).generate([{prompt}], 24)[0] for q, b in runs]))"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    int8_pt2, int8_aoti, int4_pt2, int4_aoti = json.loads(ran.stdout.strip().splitlines()[-1])
    assert int8_pt2 == tokens["int8-wo", "eager"] and int8_aoti == tokens["int8-wo", "compiled"]
    assert int4_pt2 == tokens["int4-g32", "eager"] and int4_aoti == tokens["int4-g32", "compiled"]
    with zipfile.ZipFile(tmp_path / "int4-g32" / "aoti" / "decode.pt2") as package:
        held = aoti_package_weights(package)[1]
        values = {torch.load(io.BytesIO(package.read(where[0]))).item() for where in held.values()}
    assert len(held) == 8 and values == {32}  # 2 layers x 4 int4 matmuls, each its group size
