"""The int8 caches: K/V quantized per token and head as they are written, dequantized where
attention reads them; contents, bytes, tokens against the full-precision cache (tiny models and
SmolLM2), compiled without recompiles."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
from conftest import FAMILIES
from hf_models import NEW_FAMILIES

import staticrt
from staticrt.caches import CacheSpec, build_cache
from staticrt.caches.quantized import quantize_int8
from staticrt.loading.checkpoint import load_config

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], [1, 2]]


def test_each_entry_is_its_own_int8_grid_and_lands_where_the_float_layout_puts_it():
    model = staticrt.load_model("tiny-gemma2", dtype=torch.float32)  # sliding and global layers
    quantized = build_cache(model.config, CacheSpec("hybrid-int8", 2, 96), torch.float32)  # window 64
    full = build_cache(model.config, CacheSpec("hybrid", 2, 96), torch.float32)
    gen = torch.Generator().manual_seed(0)
    heads, dim = model.config.num_kv_heads, model.config.head_dim
    for write_index, width, real in [((0, 0), 70, (70, 5)), ((70, 5), 1, (1, 1)), ((71, 6), 8, (8, 3))]:
        key = torch.randn(2, heads, width, dim, generator=gen) * 3
        value = torch.randn(2, heads, width, dim, generator=gen)
        index, num_new = torch.tensor(write_index), torch.tensor(real)
        for layer in range(model.config.num_layers):
            round_trip = [q.float() * s for q, s in map(quantize_int8, (key, value))]
            full.update(*round_trip, layer, index, num_new)
            quantized.update(key, value, layer, index, num_new)
            for ours, theirs in zip(quantized.layer_buffers(layer), full.layer_buffers(layer)):
                assert torch.equal(ours, theirs)
    error = (quantize_int8(key)[0].float() * quantize_int8(key)[1] - key).abs()
    assert (error <= quantize_int8(key)[1] / 2 + 1e-6).all()  # round to nearest on each token's grid


def test_bytes_are_int8_plus_one_scale_a_token_and_head(smollm2):
    config = load_config(smollm2)  # head_dim 64: a scale costs 1/16 of a token's int8 values
    for dtype, limit in ((torch.float32, 0.30), (torch.bfloat16, 0.55)):
        spec = dict(max_batch_size=1, max_cache_len=4096)
        full = build_cache(config, CacheSpec("static", **spec), dtype, "meta").device_bytes()
        ours = build_cache(config, CacheSpec("static-int8", **spec), dtype, "meta").device_bytes()
        dim = config.head_dim
        assert ours / full == pytest.approx((dim + dtype.itemsize) / (dim * dtype.itemsize), rel=1e-3)
        assert ours / full <= limit


def teacher_forced_logits(model, cache_kind: str, ids: list[int], prompt: int) -> torch.Tensor:
    """Logits `[len(ids), V]`: the prompt in one step, then one token a step, so that every
    position's attention reads K/V back from the cache."""
    cache = build_cache(model.config, CacheSpec(cache_kind, 1, 64), torch.float32)
    ids = torch.tensor([ids])
    with torch.no_grad():
        steps = [model(ids[:, :prompt], torch.tensor([0]), cache, last_only=False)[0]]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], torch.tensor([t]), cache, last_only=False)[0])
    return torch.cat(steps)


@pytest.mark.parametrize("family", FAMILIES + NEW_FAMILIES)
def test_tiny_models_logits_stay_near_the_full_precision_cache(hf_checkpoints, family):
    """Random-weight models amplify small errors (free-running greedy tokens part after 6 to 32
    tokens, measured), so the check runs along the full-precision cache's own continuation."""
    model = staticrt.load_model(hf_checkpoints[family][0], dtype=torch.float32)
    kind = "hybrid" if "sliding_attention" in model.config.layer_types else "static"
    options = dict(max_batch_size=2, max_cache_len=128)  # Phi-3 restarts at 32 in a step 64 wide beside the other row
    full = staticrt.Generator(model, cache=kind, **options).generate(PROMPTS, 32)
    ours = staticrt.Generator(model, cache=f"{kind}-int8", **options).generate(PROMPTS, 32)
    assert [t[:4] for t in ours] == [t[:4] for t in full]
    ids = PROMPTS[0] + full[0]
    theirs, mine = (teacher_forced_logits(model, k, ids, len(PROMPTS[0])) for k in (kind, f"{kind}-int8"))
    difference = (theirs - mine).abs().mean() / theirs.abs().mean()  # measured 0.8% to 1.2%
    assert 0 < difference < 0.02
    assert (theirs.argmax(-1) == mine.argmax(-1)).float().mean() >= 0.95  # measured 97% to 100%


def test_compiled_int8_cache_gives_the_eager_tokens_without_recompiling():
    model = staticrt.load_model("tiny-mistral")
    options = dict(cache="static-int8", max_batch_size=2, max_cache_len=64, prefill_buckets=[16])
    eager = staticrt.Generator(model, **options).generate(PROMPTS, 40)
    gen = staticrt.Generator(model, backend="compiled", **options)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert gen.generate(PROMPTS, 40) == eager
        assert gen.generate(PROMPTS[:1], 20) == [eager[0][:20]]


def test_the_real_model_keeps_its_answer_with_an_int8_cache(smollm2, chat_prompt):
    model = staticrt.load_model(smollm2)
    options = dict(max_cache_len=96, prefill_buckets=[32])
    full = staticrt.Generator(model, cache="static", **options)
    ours = staticrt.Generator(model, cache="static-int8", **options)
    assert ours.generate([chat_prompt], 32, stop_token_ids=[]) == full.generate([chat_prompt], 32, stop_token_ids=[])
    with torch.no_grad():
        ids = torch.tensor([chat_prompt])
        logits = [
            model(ids, torch.tensor([0]), gen.backend.cache, last_only=False) for gen in (full, ours)
        ]  # [1, T, V]
    difference = (logits[0] - logits[1]).abs().mean().item()
    print(f"SmolLM2 int8 cache: mean |logit difference| over the chat prompt {difference:.4f}")
    assert 0 < difference < 0.05 * logits[0].abs().mean().item()


def test_pt2_and_onnx_artifacts_run_the_int8_cache_with_the_eager_tokens(tmp_path):
    """pt2 and ONNX here; AOTInductor (the same programs compiled, ~50 s a tiny model) gave the same
    tokens by hand. The ONNX graph's rotating layers attend before they write, every step, so this
    also holds them to the tokens of eager's write-first decode (the step's own K/V round-trip)."""
    from staticrt.exporters import export_artifact

    model = staticrt.load_model("tiny-gemma2")  # sliding and global layers: hybrid-int8
    export_artifact(model, CacheSpec("hybrid-int8", 2, 96), [16], tmp_path / "artifact", formats=["pt2", "onnx"])
    prompts = [[5, 17, 99, 3, 200, 45, 8], list(range(1, 15))]
    expected = staticrt.Generator(model, cache="hybrid-int8", max_batch_size=2, max_cache_len=96).generate(prompts, 80)
    for backend in ("pt2", "onnx"):
        gen = staticrt.load_artifact(tmp_path / "artifact", backend=backend)
        assert gen.backend.cache_kind == "hybrid-int8"
        assert gen.generate(prompts, 80) == expected, backend  # past gemma2's window of 64: the int8 buffers rotate
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    inputs = {spec["name"]: (spec["shape"], spec["dtype"]) for spec in manifest["onnx"]["inputs"]}
    assert inputs["past_key_values.0.key"] == (["batch_size", 2, 80, 16], "int8")  # a sliding layer: 64 + 16 slots
    assert inputs["past_key_values.1.value_scale"] == (["batch_size", 2, 96, 1], "float32")
    assert manifest["onnx"]["genai_config"] is None and not (tmp_path / "artifact" / "genai_config.json").exists()


def test_bench_times_the_int8_cache_beside_the_static_one_and_transformers_quantized_cache(
    tmp_path, monkeypatch, capsys
):
    """Through the CLI: the JSON and the table (CSV here), where each cache's bytes show."""
    from staticrt.bench.plan import BenchRequest
    from staticrt.bench.probes import kv_bytes_per_step
    from staticrt.cli.main import main
    from staticrt.errors import BenchError

    command = ["bench", "--model", "tiny-llama", "--backends", "eager,hf", "--kv-int8", "--new-tokens", "8"]
    command += ["--prompt-len", "24", "--repeats", "1", "--device", "cpu", "--format", "csv"]
    assert main([*command, "--json", str(tmp_path / "bench.json")]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    runs = report["backends"]
    table = {row[0]: row for row in csv.reader(io.StringIO(capsys.readouterr().out))}
    column = table["backend"].index("cache MB device/host")
    assert [table[label][column] for label in runs] == ["0.0/0.0", "0.0/0.0", "-", "0.0/0.0"]
    assert [(label, r["cache"]) for label, r in runs.items()] == [
        ("eager-static", "static"),
        ("eager-kvint8", "static-int8"),
        ("hf", "static"),
        ("hf-kvquanto", "quanto-int4"),
    ]
    assert report["tokens_agree"]  # the float caches' tokens; the quantized ones are reported
    assert runs["eager-kvint8"]["tokens"][0][:4] == runs["eager-static"]["tokens"][0][:4]
    for label in ("eager-kvint8", "hf-kvquanto"):
        assert report["ratios"][f"{label}_step_cost_vs_static"] > 0
    config = staticrt.load_model("tiny-llama").config  # 2 layers, 2 KV heads, head_dim 16
    assert kv_bytes_per_step(config, 1, 100, torch.float32) == 2 * 2 * 2 * 100 * 16 * 4
    assert kv_bytes_per_step(config, 1, 100, torch.float32, int8=True) == 2 * 2 * 2 * 100 * (16 + 4)
    assert runs["eager-kvint8"]["cache_device_bytes"] == 2 * 2 * 2 * 32 * (16 + 4) + 8  # 32 slots, and seq_lens
    # transformers' cache, measured on its tensors: 24 prompt entries as int4 with group scales and
    # shifts, and the 7 decoded since in float32 (its residual)
    quanto = runs["hf-kvquanto"]["cache_device_bytes"]
    assert 2 * 2 * 2 * 24 * 16 // 2 + 2 * 2 * 2 * 7 * 16 * 4 < quanto < 2 * 2 * 2 * 31 * 16 * 4
    assert runs["hf-kvquanto"]["kv_bytes_per_step"] == quanto
    with pytest.raises(BenchError, match="^--window and --offload/--kv-int8 compare different things"):
        BenchRequest("bench-llama", ("compiled",), prompt_len=64, window=32, kv_int8=True).check()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # optimum-quanto not installed
    with pytest.raises(BenchError) as raised:
        BenchRequest("bench-llama", ("compiled", "hf"), kv_int8=True).check()
    assert str(raised.value) == (
        "--kv-int8 with hf also times transformers' QuantizedCache, which needs optimum-quanto: "
        "pip install 'staticrt[kvquant]', or drop hf from --backends"
    )
