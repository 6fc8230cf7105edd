"""`staticrt convert --keep-quantized`: a GGUF's Q4_0/Q4_1/Q8_0 projections kept as their codes.

The GGUFs are SmolLM2's first two layers with projections re-quantized to Q4_0 or Q8_0 by the
gguf library (tests/gguf_files.py). The oracle for each weight is the GGUF's own values, as the
gguf library dequantizes them and transformers loads them (rows of Q and K un-permuted); the
weight under test is what torch's int4/int8 kernel multiplies by, read back through the kernel.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf_files import cut_gguf

import staticrt
from staticrt.cli.main import main
from staticrt.errors import CheckpointError, ConfigError
from staticrt.loading.convert import convert_gguf
from staticrt.models.gguf_blocks import PROJECTIONS
from staticrt.models.quant_spec import QuantSpec

pytest.importorskip("torchao", reason="kept codes load as torchao tensors: install the test extra")

LAYERS = 2
SHORT = {hf: short for short, hf in PROJECTIONS.items()}  # transformers' projection name -> llama.cpp's


def kept(smollm2_gguf, root, qtype: str):
    source = cut_gguf(smollm2_gguf, root / f"cut.{qtype}.gguf", LAYERS, qtype)
    assert main(["convert", "--keep-quantized", str(source), str(root / qtype)]) == 0
    return source, root / qtype


@pytest.fixture(scope="module")
def q4_0(smollm2_gguf, tmp_path_factory):
    return kept(smollm2_gguf, tmp_path_factory.mktemp("kept"), "Q4_0")


@pytest.fixture(scope="module")
def q8_0(smollm2_gguf, tmp_path_factory):
    return kept(smollm2_gguf, tmp_path_factory.mktemp("kept"), "Q8_0")


def kernel_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32: what the quantized kernel multiplies by, read back as the product with an identity."""
    return torch.nn.functional.linear(torch.eye(weight.shape[1], dtype=torch.bfloat16), weight).t().float()


def projection_weights(model) -> dict[str, torch.Tensor]:
    """'layers.L.mlp.up_proj' -> that projection's kernel weight, fused ones cut into their parts."""
    weights = {}
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, torch.nn.Linear):
            owner = name.rpartition(".")[0]
            parts = getattr(module, "parts", {name.rpartition(".")[2]: module.out_features})
            for part, rows in zip(parts, kernel_weight(module.weight).split(list(parts.values()))):
                weights[f"{owner}.{part}"] = rows
    return weights


def test_kept_folder_holds_the_codes_and_no_float_projection(q4_0):
    from safetensors import safe_open

    source, folder = q4_0
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "staticrt_gguf", "weights": "int4-g32"}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        fields = {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()}
    assert not [key for key in fields if key.endswith("proj.weight")]
    down = "model.layers.1.mlp.down_proj.weight"  # [576, 1536]
    assert fields[f"{down}.codes"] == ("U8", [576, 768])  # two 4-bit codes a byte
    assert fields[f"{down}.scales"] == fields[f"{down}.mins"] == ("F16", [576, 48])
    # The embedding, Q8_0 in the file, is kept too (it loads as float: it is only gathered from).
    assert fields["model.embed_tokens.weight.codes"] == ("I8", [49152, 576])
    assert len([key for key in fields if key.endswith(".codes")]) == LAYERS * len(PROJECTIONS) + 1
    assert (folder / "model.safetensors").stat().st_size < 1.1 * source.stat().st_size


def test_kept_q4_0_codes_reach_the_int4_kernel_unchanged(q4_0):
    """Every projection, Q and K included, within 1/20 of its block's step of the GGUF's value
    (the scale and zero rounded to bfloat16); torchao's own int4 quantization of the same values
    moves weights by half a step (Q4_0's grid is symmetric, torchao's asymmetric)."""
    import transformers
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    source, folder = q4_0
    model = staticrt.load_model(folder)
    assert model.quantization == QuantSpec(4, 32) and model.embed_tokens.weight.dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    ours = projection_weights(model)
    assert len(ours) == LAYERS * len(PROJECTIONS)
    for name, weight in ours.items():
        exact = hf.get_parameter(f"model.{name}.weight").detach()  # [N, K] float32
        step = exact.view(exact.shape[0], -1, 32).abs().amax(-1).div(8).repeat_interleave(32, 1)  # Q4_0's |d|
        assert ((weight - exact).abs() <= step / 20).all(), name
    requantized = torch.nn.Linear(*exact.shape[::-1], bias=False, dtype=torch.bfloat16)
    requantized.weight.data = exact.to(torch.bfloat16)
    quantize_(requantized, PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False))
    assert ((kernel_weight(requantized.weight) - exact).abs() > step * 0.4).any()


def test_kept_q8_0_loads_as_int8_a_channel_from_the_exact_values(q8_0):
    """Q8_0 has a scale a block of 32, torch's int8 kernel one a channel: the projections load as
    torchao's per-channel int8 of the GGUF's exact values (bfloat16), bit for bit."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    source, folder = q8_0
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["weights"] == "int8-wo"
    model = staticrt.load_model(folder)
    assert model.quantization == QuantSpec(8)
    tensors = {t.name: t for t in GGUFReader(str(source)).tensors}
    ours = projection_weights(model)
    for name, weight in ours.items():
        if name.endswith(("q_proj", "k_proj")):
            continue  # rows permuted in the file; the int4 test checks them against transformers
        layer, projection = name.removeprefix("layers.").split(".", 1)
        gguf_tensor = tensors[f"blk.{layer}.{SHORT[projection]}.weight"]
        assert gguf_tensor.tensor_type == GGMLQuantizationType.Q8_0
        exact = torch.from_numpy(dequantize(np.asarray(gguf_tensor.data), gguf_tensor.tensor_type))
        expected = torch.nn.Linear(*exact.shape[::-1], bias=False, dtype=torch.bfloat16)
        expected.weight.data = exact.to(torch.bfloat16)
        quantize_(expected, Int8WeightOnlyConfig(set_inductor_config=False))
        assert torch.equal(weight, kernel_weight(expected.weight)), name


def test_keep_quantized_refuses_projections_it_cannot_keep_before_writing(q4_0, tmp_path):
    source = cut_gguf(q4_0[0], tmp_path / "mixed.gguf", LAYERS, "Q4_0", {"blk.1.attn_q.weight": "F16"})
    with pytest.raises(CheckpointError) as refused:
        convert_gguf(source, tmp_path / "out", keep_quantized=True)
    assert str(refused.value) == (
        "--keep-quantized keeps projections that are all Q8_0 (as int8-wo) or all Q4_0/Q4_1 (as int4-g32); "
        "mixed.gguf's are 13 Q4_0, 1 F16. Convert without --keep-quantized (float32 weights) and load with "
        "--quantize int8 or int4"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.gguf"]


def test_a_kept_folder_refuses_another_quantization_and_foreign_ones_are_named(q4_0, tmp_path, capsys):
    _, folder = q4_0
    assert main(["export", "--model", str(folder), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "an ONNX graph quantizes float weights itself (MatMulNBits): convert the GGUF without --keep-quantized "
            "and export that folder with --format onnx --quantize int4-g32, or export this one to pt2"
        )
    )
    assert not (tmp_path / "onnx").exists()
    with pytest.raises(ConfigError) as refused:
        staticrt.load_model(folder, quantize="int8")
    assert str(refused.value) == (
        f"{folder} holds int4-g32 weights kept from a GGUF (staticrt convert --keep-quantized), not quantize "
        "'int8': leave quantize out (or pass int4-g32), or convert the GGUF without --keep-quantized to "
        "quantize the float weights otherwise"
    )
    assert staticrt.load_model(folder, quantize="int4").quantization == QuantSpec(4, 32)  # "int4": the kept codes
    foreign = tmp_path / "gptq"
    foreign.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (foreign / "config.json").write_text(json.dumps(config))
    shutil.copy(folder / "model.safetensors", foreign)
    with pytest.raises(CheckpointError) as refused:
        staticrt.load_model(foreign)
    assert str(refused.value) == (
        f"{foreign}: config.json says its weights are quantized by 'gptq'; staticrt reads float checkpoints "
        "(and quantizes them with --quantize) and GGUF codes kept by staticrt convert --keep-quantized: use "
        "the float checkpoint, or a GGUF of the model with staticrt convert"
    )
