"""Mixtures of experts in fixed shapes (issue 64: Mixtral, Qwen3-MoE, OLMoE, gpt-oss) on tiny random
checkpoints transformers saved (tests/hf_models.py): greedy tokens equal transformers' at batch 4
and 1, on every backend and on the sliding cache where the family has windows; a decode step reads
k of E experts a token; routing sends a batch's tokens to different experts.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import MOE_FAMILIES

import staticrt
from staticrt.backends.cudagraph import HostReplayBackend
from staticrt.caches import CacheSpec, build_cache
from staticrt.errors import ConfigError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact
from staticrt.models.moe import SparseMoE

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 50)), [1, 2, 3], [77, 3, 3, 140, 9]]
NEW_TOKENS = 36  # past position 32, where gpt-oss's yarn and the windows of 16 matter
OPTIONS = dict(max_batch_size=4, max_cache_len=96)
WINDOWED = {"mixtral": "sliding", "gpt_oss": "hybrid"}
CASES = [(f, c) for f in MOE_FAMILIES for c in ("static", *([WINDOWED[f]] if f in WINDOWED else []))]


@pytest.fixture
def expected(transformers_tokens):
    """family -> transformers' greedy tokens for PROMPTS, each prompt alone."""
    return lambda family: transformers_tokens(family, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("family,cache", CASES)
def test_eager_tokens_equal_transformers_at_batch_4_and_1(hf_checkpoints, expected, family, cache):
    model = staticrt.load_model(hf_checkpoints[family][0])
    assert model.config.num_experts in (4, 8)
    gen = staticrt.Generator(model, cache=cache, **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected(family)
    assert [gen.generate([p], NEW_TOKENS)[0] for p in PROMPTS[:2]] == expected(family)[:2]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_equal_transformers_in_prefill_and_in_decode_steps(hf_checkpoints, family):
    """The logits of a 24-token prefill (every expert on every token, weighted) and of 16 decode
    steps after it (each token's own experts gathered) against transformers' over the whole."""
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder)
    ids = torch.tensor([PROMPTS[1]])  # 40 tokens
    cache = build_cache(model.config, CacheSpec(WINDOWED.get(family, "static"), 1, 64), torch.float32)
    with torch.no_grad():
        ours = [model(ids[:, :24], torch.tensor([0]), cache, last_only=False)[0]]
        ours += [model(ids[:, t : t + 1], torch.tensor([t]), cache, last_only=False)[0] for t in range(24, 40)]
        theirs = hf(ids).logits[0]
    torch.testing.assert_close(torch.cat(ours), theirs, rtol=1e-4, atol=1e-4)


def test_a_decode_step_reads_k_experts_a_token_and_a_batch_goes_to_different_experts(
    hf_checkpoints, expected, monkeypatch
):
    """At batch 1 and 2 (N * k < E) a decode step gathers each token's k experts and runs no
    other; a prefill (and a batch whose tokens could touch every expert) runs them all, weighted."""
    model = staticrt.load_model(hf_checkpoints["qwen3_moe"][0])  # E 8, k 2
    seen: list[tuple[int, list[list[int]]]] = []
    route = SparseMoE._route

    def recorded(self, logits):
        weights, chosen = route(self, logits)
        seen.append((logits.shape[0], sorted(chosen.tolist())))
        return weights, chosen

    every = SparseMoE._dense

    def dense(self, x, routing):
        assert x.shape[0] * self.k >= self.num_experts, "a decode step ran every expert"
        return every(self, x, routing)

    monkeypatch.setattr(SparseMoE, "_route", recorded)
    monkeypatch.setattr(SparseMoE, "_dense", dense)
    gen = staticrt.Generator(model, max_batch_size=2, max_cache_len=96)
    assert gen.generate(PROMPTS[:2], NEW_TOKENS) == expected("qwen3_moe")[:2]
    decode = [chosen for tokens, chosen in seen if tokens == 2]
    assert decode and all(len(set(map(tuple, c))) == 2 for c in decode[:5])  # the two rows chose apart
    assert len({e for c in decode for row in c for e in row}) == 8  # and over the steps, every expert


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_compiled_and_replayed_graphs_give_transformers_tokens(hf_checkpoints, expected, family):
    model = staticrt.load_model(hf_checkpoints[family][0])
    cache = WINDOWED.get(family, "static")
    compiled = staticrt.Generator(model, cache=cache, backend="compiled", prefill_buckets=[64], **OPTIONS)
    assert compiled.generate(PROMPTS, NEW_TOKENS) == expected(family)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert compiled.generate(PROMPTS[:1], NEW_TOKENS) == expected(family)[:1]
    replayed = staticrt.Generator(HostReplayBackend(model, cache=cache, prefill_buckets=[64], **OPTIONS))
    assert replayed.generate(PROMPTS, NEW_TOKENS) == expected(family)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_onnx_and_torch_export_artifacts_give_transformers_tokens(hf_checkpoints, expected, tmp_path, family):
    """The routing as standard ops (TopK, Gather, MatMul), the experts' weights stored once."""
    model = staticrt.load_model(hf_checkpoints[family][0])
    cache = WINDOWED.get(family, "static")
    folder = export_artifact(model, CacheSpec(cache, 4, 96), [64], tmp_path / family, ["pt2", "onnx"])
    for backend in ("onnx", "pt2"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected(family), backend


def test_aoti_runs_gpt_oss_sinks_biases_and_experts(hf_checkpoints, expected, tmp_path):
    model = staticrt.load_model(hf_checkpoints["gpt_oss"][0])
    folder = export_artifact(model, CacheSpec("hybrid", 4, 96), [64], tmp_path / "gpt_oss", ["aoti"])
    assert load_artifact(folder, "aoti").generate(PROMPTS, NEW_TOKENS) == expected("gpt_oss")


def test_moe_variants_not_implemented_and_quantized_experts_are_refused_by_name(hf_checkpoints):
    from staticrt.loading.hf_config import config_from_hf

    with pytest.raises(ConfigError, match="^config.json: model_type 'qwen2_moe' is not supported; staticrt runs"):
        config_from_hf({"model_type": "qwen2_moe"}, "config.json")
    with pytest.raises(ConfigError) as refused:
        staticrt.load_model(hf_checkpoints["mixtral"][0], quantize="int8")
    assert str(refused.value) == (
        "quantize 'int8': this mixtral model's 4 experts are stacked weights that staticrt's int8/int4 kernels do "
        "not take yet, and they hold most of its bytes; load it without --quantize"
    )


def test_a_mixtral_gguf_is_refused_by_name_before_transformers_reads_it_as_a_dense_llama(tmp_path):
    """llama.cpp writes Mixtral as a "llama" GGUF with experts; transformers' reader would drop them."""
    pytest.importorskip("gguf", reason="GGUF needs the gguf extra: use the README's test command")
    from gguf_files import stub_gguf

    from staticrt.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        staticrt.load_model(stub_gguf(tmp_path / "mixtral.gguf", "llama", experts=8))
    assert str(refused.value) == (
        "mixtral.gguf holds a Mixtral (llama.cpp writes it as a 'llama' model with experts), which transformers' "
        "GGUF reader reads as a dense Llama without them; convert the model's safetensors checkpoint folder instead "
        "(staticrt run --model FOLDER)"
    )
