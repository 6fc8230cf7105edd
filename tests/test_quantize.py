"""Weight-only int8 / int4 quantization with torchao (`load_model(..., quantize="int8-wo" or
"int4-g32")`, and "int8" / "int4" where torchao's kernels are the device's choice): tokens against
transformers given the same torchao-quantized weights, the compiled graph on torch's int8 kernel,
the refusals, the choice of kernels, and on the real SmolLM2 model the perplexity and the chat
answer against fp32 (staticrt's own int8-activation kernels: test_a8_kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_models import hf_greedy
from torch import nn

import staticrt
from staticrt.bench import run_bench
from staticrt.bench.perplexity import perplexity
from staticrt.bench.probes import weight_bytes_per_step
from staticrt.caches import CacheSpec, build_cache
from staticrt.cli.main import main
from staticrt.errors import ArtifactError, ConfigError

torchao = pytest.importorskip("torchao", reason="quantization needs torchao: install the test extra")

FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "llama-linear-tied")
PROMPTS = [[5, 17, 99, 3, 250], [200, 1, 64, 64, 9, 31, 7, 120, 88, 14, 2, 77]]


def hf_quantized(folder, quantize: str):
    """transformers' model of `folder` in bfloat16, quantized by torchao as staticrt says it
    quantizes: the projections at `quantize`, the head (untied by it) at int8."""
    import transformers
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    int8 = Int8WeightOnlyConfig(set_inductor_config=False)
    body = int8 if quantize == "int8-wo" else PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False)
    quantize_(model, body, filter_fn=lambda m, name: isinstance(m, nn.Linear) and name != "lm_head")
    quantize_(model, int8, filter_fn=lambda m, name: name == "lm_head")
    return model


@pytest.mark.parametrize("quantize", ["int8-wo", "int4-g32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_tokens_equal_transformers_with_the_same_torchao_weights(hf_checkpoints, family, quantize):
    folder = hf_checkpoints[family][0]
    hf = hf_quantized(folder, quantize)
    model = staticrt.load_model(folder, quantize=quantize)
    gen = staticrt.Generator(model, max_batch_size=1, max_cache_len=64)
    for prompt in PROMPTS:
        assert gen.generate([prompt], 24)[0] == hf_greedy(hf, prompt, 24)


def test_quantized_weights_are_torchaos_and_read_in_fewer_bytes(hf_checkpoints):
    """The tied head gets an int8 copy of its own; the embedding stays bfloat16 (only gathered)."""
    folder = hf_checkpoints["llama-linear-tied"][0]
    fp32, int8, int4 = (staticrt.load_model(folder, quantize=q) for q in (None, "int8-wo", "int4-g32"))
    assert type(int8.layers[0].self_attn.qkv_proj.weight).__name__ == "Int8Tensor"
    assert type(int4.layers[0].mlp.down_proj.weight).__name__ == "Int4OpaqueTensor"
    assert type(int4.lm_head.weight).__name__ == "Int8Tensor"
    assert fp32.lm_head is None and int8.embed_tokens.weight.dtype == torch.bfloat16
    assert int4.quantization.name == "int4-g32"
    # projections and head: 4 bytes a weight in fp32, 1 in int8 plus 5 a row (a float32 scale and an
    # int8 zero point); of the embedding, the row a token looks up (bfloat16 when quantized)
    c = fp32.config
    body = sum(m.weight.numel() for m in fp32.layers.modules() if isinstance(m, nn.Linear))
    rows = sum(m.out_features for m in fp32.layers.modules() if isinstance(m, nn.Linear))
    norms = sum(p.numel() for n, p in fp32.named_parameters() if "norm" in n)
    assert weight_bytes_per_step(fp32, 1) == 4 * (body + c.vocab_size * c.hidden_size + norms)
    assert weight_bytes_per_step(int8, 1) == (
        body + 5 * rows + c.vocab_size * (c.hidden_size + 5) + 2 * c.hidden_size + 2 * norms
    )


def test_compiled_quantized_decode_runs_on_the_int8_kernel_without_recompiles(hf_checkpoints):
    """Compiled: each projection becomes torch's `_weight_int8pack_mm` (inductor's weight-only
    pattern), so its logits round differently from eager's `mm` of the dequantized weight; they stay
    within bfloat16's rounding of eager's, well inside the quantization's own error."""
    from torch._dynamo.utils import counters

    folder = hf_checkpoints["llama"][0]
    fp32, int8 = staticrt.load_model(folder), staticrt.load_model(folder, quantize="int8-wo")
    ids = torch.tensor([PROMPTS[1]])
    logits = {}
    counters.clear()
    for name, model, fn in [
        ("fp32", fp32, fp32),
        ("eager", int8, int8),
        ("compiled", int8, torch.compile(int8, fullgraph=True, dynamic=False)),
    ]:
        cache = build_cache(model.config, CacheSpec("static", 1, 16), model.embed_tokens.weight.dtype)
        with torch.no_grad():
            logits[name] = fn(ids, torch.tensor([0]), cache, last_only=False)[0].float()  # [T, V]
    assert counters["inductor"]["woq_matcher_count"] == 2 * 4 + 1  # q/k/v, o, gate/up, down a layer; the head
    scale = logits["fp32"].abs().max()
    quantization_error = (logits["eager"] - logits["fp32"]).abs().max()
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=0, atol=0.04 * scale)
    assert quantization_error > 0.02 * scale

    gen = staticrt.Generator(int8, max_batch_size=2, max_cache_len=64, backend="compiled", prefill_buckets=[16])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompts in ([PROMPTS[0]], PROMPTS, [PROMPTS[1], [3]]):
            assert [len(t) for t in gen.generate(prompts, 20)] == [20] * len(prompts)


def test_quantize_refuses_what_it_cannot_run_before_changing_anything(tmp_path):
    with pytest.raises(ConfigError) as err:
        staticrt.load_model("tiny-llama", dtype="float32", quantize="int8-wo")
    assert str(err.value) == (
        "quantize 'int8-wo' with dtype float32: torch's int8/int4 weight kernels take bfloat16 (or float16) "
        "activations, and with float32 ones run slower than float32 weights; use --dtype bfloat16, or leave "
        "--dtype out (it then defaults to bfloat16)"
    )
    with pytest.raises(ConfigError) as err:
        staticrt.load_model("tiny-llama", quantize="int3")
    assert str(err.value) == (
        "quantize 'int3' is not supported; choose one of int8, int8-a8, int8-wo, int4, int4-a8, int4-g32, int4-g64, "
        "int4-g128, or none (int8 and int4: the kernels this device runs fastest)"
    )
    with pytest.raises(ConfigError) as err:
        staticrt.load_model("tiny-llama", quantize="int4-g128")
    assert str(err.value) == (
        "quantize 'int4-g128': the group size 128 must divide every projection's input size, and this "
        "model's are [64, 128]; use int4-g32, int4-g64"
    )
    model = staticrt.load_model("tiny-llama", dtype="bfloat16")
    with pytest.raises(ConfigError):
        from staticrt.models.quant_spec import QuantSpec
        from staticrt.models.quantize import quantize_weights

        quantize_weights(model, QuantSpec(4, 128))
    assert model.quantization is None and model.lm_head is not None
    assert type(model.layers[0].mlp.down_proj.weight) is nn.Parameter

    from staticrt.exporters import export_artifact

    with pytest.raises(ArtifactError) as err:
        export_artifact(model, CacheSpec("static", 1, 16), [16], tmp_path / "a", quantize=QuantSpec(8))
    assert str(err.value) == (
        "exporting int8-wo weights to aoti, pt2 and onnx in one artifact is not supported: the torch programs run "
        "the weights as loaded (torchao's or staticrt's kernels) and the ONNX graph ONNX Runtime's quantization of "
        "the float weights; export them to two artifacts (--format aoti,pt2, then --format onnx)"
    )
    with pytest.raises(ArtifactError, match=r"^quantize='int8-wo' with format\(s\) pt2: the torch formats export the"):
        export_artifact(model, CacheSpec("static", 1, 16), [16], tmp_path / "a", ["pt2"], quantize=QuantSpec(8))
    with pytest.raises(ArtifactError, match=r"loaded with quantize='int8-wo'; the ONNX exporter takes the float model"):
        export_artifact(
            staticrt.load_model("tiny-llama", quantize="int8-wo"), CacheSpec("static", 1, 16), [16], tmp_path / "a"
        )
    assert not (tmp_path / "a").exists()


def test_cli_runs_quantized_and_refuses_quantize_on_an_artifact(capsys, tmp_path):
    assert (
        main(
            ["run", "--model", "tiny-llama", "--quantize", "int4-g32", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
        )
        == 0
    )
    assert main(["inspect", "--model", "tiny-llama", "--quantize", "int8-wo", "--format", "csv"]) == 0
    # torchao's quantized model computes in bfloat16, so its cache holds 2 bytes a value (fp32's would be 262,144)
    assert '0,full_attention,static,device,1x2x1024x16,"131,072"' in capsys.readouterr().out
    (tmp_path / "art").mkdir()
    assert main(["run", str(tmp_path / "art"), "--quantize", "int8", "--prompt-ids", "1"]) == 2
    assert "an artifact's weights and dtype were fixed when it was exported" in capsys.readouterr().err


def test_bench_runs_quantized_variants_beside_the_float_weights():
    report = run_bench(
        "tiny-llama", ["eager", "hf"], new_tokens=4, prompt_len=8, repeats=1, quantize=("none", "int8-wo")
    )
    assert list(report["backends"]) == ["eager", "hf", "eager-int8-wo"]
    assert report["backends"]["eager-int8-wo"]["quantize"] == "int8-wo"
    assert set(report["ratios"]) >= {"eager-int8-wo_decode_speedup_vs_eager", "eager-int8-wo_decode_speedup_vs_hf"}
    assert report["weight_bytes_per_step"]["int8-wo"] < report["weight_bytes_per_step"]["none"] / 3
    assert report["tokens_agree"]


def test_quantized_real_model_keeps_its_perplexity_and_its_answer(smollm2, english_text):
    """SmolLM2-135M over the first 512 tokens of an English text: int8 within 1% of fp32's
    perplexity, int4 within 5%; and the greedy answer to a chat question still names the capital.
    (512, not the text's 2,212: on an AVX2-only host, with no bfloat16 instructions, the eager int8
    and int4 passes over the whole text took 311 s; measured there: 512 tokens fp32 18.44, int8
    +0.3%, int4 +0.5%; 1,024 tokens 12.99, +0.5%, +0.3%.)"""
    results = {}
    for quantize in (None, "int8-wo", "int4-g32"):
        model = staticrt.load_model(smollm2, quantize=quantize)
        ids = model.tokenizer.encode(english_text)[:512]
        results[quantize] = perplexity(model, ids)
        if quantize:
            prompt = model.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}]
            )
            gen = staticrt.Generator(model, max_cache_len=len(prompt) + 16)
            answer = model.tokenizer.decode(gen.generate([prompt], 16)[0])
            assert "Paris" in answer, (quantize, answer)
    assert len(ids) == 512
    assert 5 < results[None] < 25  # a trained 135M model on reference prose (a random one: ~49,000)
    assert results["int8-wo"] / results[None] < 1.01, results
    assert results["int4-g32"] / results[None] < 1.05, results


def test_int8_and_int4_take_the_kernels_this_device_runs_fastest(monkeypatch):
    """ "int8" / "int4": staticrt's int8-activation kernels on a CPU that has them (computing in
    float32), torchao's weight-only ones with bfloat16 asked for, on CUDA, where an input size does
    not fit the kernels' step, or where the kernels cannot be built (a warning says so); a named
    spelling is taken as named."""
    from staticrt.loading.checkpoint import load_config
    from staticrt.models import a8_kernels
    from staticrt.models.quant_spec import QuantSpec, parse_quantize
    from staticrt.models.quantize import kernels_for, quantize_weights

    config, cpu = load_config("tiny-llama"), torch.device("cpu")
    int8, int4 = parse_quantize("int8"), parse_quantize("int4")
    built = []
    monkeypatch.setattr(a8_kernels, "isa", lambda: "avx2")
    monkeypatch.setattr(a8_kernels, "load", built.append)
    assert kernels_for(int8, cpu, None, config).name == "int8-a8" and built == ["int8-a8"]
    assert kernels_for(int4, cpu, torch.float32, config).name == "int4-a8"
    assert kernels_for(int8, cpu, torch.bfloat16, config).name == "int8-wo"
    assert kernels_for(int4, torch.device("cuda"), None, config).name == "int4-g32"
    assert kernels_for(int8, cpu, None, dataclasses.replace(config, intermediate_size=96)).name == "int8-wo"
    assert kernels_for(int4, cpu, None, config, build=False).name == "int4-a8" and len(built) == 2
    assert kernels_for(QuantSpec(8), cpu, None, config) == QuantSpec(8)
    bfloat16 = staticrt.load_model("tiny-llama", dtype="bfloat16")  # quantized as it is: torchao's
    assert quantize_weights(bfloat16, int8).quantization.name == "int8-wo"
    monkeypatch.setattr(a8_kernels, "isa", lambda: None)
    assert kernels_for(int8, cpu, None, config).name == "int8-wo"

    def no_compiler(quantize: str) -> None:
        raise ConfigError(f"quantize {quantize!r} could not build staticrt's int8-activation kernels")

    monkeypatch.setattr(a8_kernels, "isa", lambda: "avx2")
    monkeypatch.setattr(a8_kernels, "load", no_compiler)
    message = "could not build staticrt's int8-activation kernels. Until then quantize 'int4' runs torchao's kernels"
    with pytest.warns(UserWarning, match=rf"^quantize 'int4-a8' {message} \(int4-g32\)$"):
        assert kernels_for(int4, cpu, None, config).name == "int4-g32"
