"""quantize "int8-a8": staticrt's int8 kernel (models/int8_kernel.py), built for AVX512-VNNI or AVX2.
Its tokens, with the build this CPU takes and with the AVX2 one, against a
float model that rounds the same weights and activations to the same int8 grids (the oracle is
plain torch: weights per output channel, activations per block of 32 along each row); eager and
compiled; what cannot run it refused by name; on SmolLM2 the perplexity within 1% of fp32."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import staticrt
from staticrt.bench.perplexity import perplexity
from staticrt.caches import CacheSpec
from staticrt.errors import ArtifactError, ConfigError
from staticrt.exporters import export_artifact
from staticrt.models import int8_kernel
from staticrt.models.quant_spec import parse_quantize

FAMILIES = ("llama", "qwen2", "gemma2", "llama-linear-tied")  # qwen2: q/k/v biases; the last: a tied head
PROMPT = [200, 1, 64, 64, 9, 31, 7, 120, 88, 14, 2, 77]
kernel = pytest.mark.skipif(
    int8_kernel.unavailable() is not None,
    reason=f"{int8_kernel.unavailable()}: int8-a8 is refused there (test_a_cpu_without_the_kernel_is_refused_by_name)",
)


def on_the_grids(folder) -> staticrt.Generator:
    """The float model with each projection's and the head's weight rounded to its int8 grid
    (absmax / 127 a row) and each input rounded to the int8 grid of its block of 32 values."""
    model = staticrt.load_model(folder)
    if model.lm_head is None:  # the head as a module of its own, so that its input is rounded too
        model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone(), requires_grad=False)

    def rounded(x: torch.Tensor, block: int) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1] // block, block)
        scale = rows.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.round(rows / scale) * scale).reshape(x.shape)

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = rounded(module.weight.data, module.in_features)
            module.register_forward_pre_hook(lambda _module, args: (rounded(args[0], 32),))
    return staticrt.Generator(model, max_cache_len=64)


@kernel
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_a8_tokens_equal_the_float_model_on_its_grids_eager_and_compiled(hf_checkpoints, family):
    folder = hf_checkpoints[family][0]
    model = staticrt.load_model(folder, quantize="int8-a8")
    assert type(model.lm_head).__name__ == "Int8Linear" and model.quantization.name == "int8-a8"
    assert model.layers[0].self_attn.qkv_proj.codes.dtype == torch.int8
    want = on_the_grids(folder).generate([PROMPT], 24)[0]
    assert staticrt.Generator(model, max_cache_len=64).generate([PROMPT], 24)[0] == want
    compiled = staticrt.Generator(model, max_cache_len=64, backend="compiled", prefill_buckets=(16,))
    assert compiled.generate([PROMPT], 24)[0] == want


@kernel
def test_the_avx2_build_gives_the_float_models_tokens_on_its_grids(hf_checkpoints):
    """Where the CPU has AVX512-VNNI the AVX2 build is tested too, in a process of its own (a
    process holds one build of the op)."""
    folder = hf_checkpoints["qwen2"][0]
    code = (
        "import json, sys, staticrt; from staticrt.models import int8_kernel; int8_kernel.isa = lambda: 'avx2'; "
        "m = staticrt.load_model(sys.argv[1], quantize='int8-a8'); "
        "print(json.dumps(staticrt.Generator(m, max_cache_len=64).generate([json.loads(sys.argv[2])], 24)[0]))"
    )
    run = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(PROMPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == on_the_grids(folder).generate([PROMPT], 24)[0]


def test_a_cpu_without_the_kernel_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(int8_kernel, "isa", lambda: None)
    monkeypatch.setattr(int8_kernel, "_loaded", False)
    with pytest.raises(ConfigError) as raised:
        staticrt.load_model("tiny-llama", quantize="int8-a8")
    assert str(raised.value) == (
        "quantize 'int8-a8' runs staticrt's int8 kernel, and this CPU has neither AVX512-VNNI nor AVX2 (or no "
        "/proc/cpuinfo says so); use --quantize int8"
    )


def test_int8_a8_refuses_another_dtype_and_every_artifact_format(tmp_path):
    with pytest.raises(ConfigError) as raised:
        staticrt.load_model("tiny-llama", quantize="int8-a8", dtype="bfloat16")
    assert str(raised.value) == (
        "quantize 'int8-a8' with dtype bfloat16: its kernel takes float32 activations; leave --dtype out (or pass "
        "float32), or use --quantize int8 for bfloat16"
    )
    refusal = (
        "quantize 'int8-a8' runs in staticrt's own CPU kernel, which artifacts do not carry yet; export with "
        "--quantize int8 (torchao's weights in the torch formats, ONNX Runtime's in the onnx one)"
    )
    model = staticrt.load_model("tiny-llama")
    with pytest.raises(ArtifactError) as raised:
        export_artifact(
            model, CacheSpec("static", 1, 32), [16], tmp_path / "a", ["onnx"], quantize=parse_quantize("int8-a8")
        )
    assert str(raised.value) == refusal


@kernel
def test_int8_a8_keeps_the_real_models_perplexity_and_refuses_to_export_it(smollm2, tmp_path):
    """SmolLM2-135M over the first 512 tokens of the text test_quantize.py reads: within 1% of fp32
    (by hand: +0.2% simulated on these 512 tokens, docs/measurements.md)."""
    text = open("tests/data/python-execution-model.txt").read()
    fp32 = staticrt.load_model(smollm2)
    ids = fp32.tokenizer.encode(text)[:512]
    model = staticrt.load_model(smollm2, quantize="int8-a8")
    assert perplexity(model, ids) / perplexity(fp32, ids) < 1.01
    with pytest.raises(ArtifactError, match="^quantize 'int8-a8' runs in staticrt's own CPU kernel"):
        export_artifact(model, CacheSpec("static", 1, 64), [16], tmp_path / "a", ["aoti"])
