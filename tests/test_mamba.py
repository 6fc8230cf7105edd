"""Mamba2 layers (issue 65): a convolution's inputs and a recurrent state `[B, H, D, N]` kept in the
cache (caches/recurrent.py), on tiny checkpoints transformers saved from its own `Mamba2Config`
(Mamba2 layers alone), `GraniteMoeHybridConfig` (Granite 4.0-H: Mamba2, attention without rotary,
Mamba2; experts beside a shared MLP) and `FalconH1Config` (a Mamba2 beside the attention in
each layer, µP multipliers). All scan in chunks of 16 positions, so the 70-token prompt spans
five. Tokens and logits equal transformers' on eager, compiled, cudagraph's host side, AOTInductor
and ONNX, batch 4 and 1, 200 new tokens (logits, in one step, two and a token at a time:
test_recurrent.py, as is the state, transformers' and kept bit for bit in a row that sits a step
out); a conversation continues from its row where the state stopped, and anything shorter is
prefilled again.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

import staticrt
from staticrt.backends.cudagraph import HostReplayBackend
from staticrt.caches import CacheSpec, build_cache
from staticrt.caches.row_state import load_row, save_row
from staticrt.errors import CacheError, GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact
from staticrt.generation.prefix import RECURRENT, continues, draft_room, kept_prefix

FAMILIES = ("mamba2", "granitemoehybrid", "falcon_h1")
PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 80)), [1, 2, 3], list(range(100, 120))]
NEW_TOKENS = 200
OPTIONS = dict(max_cache_len=288, prefill_buckets=(16, 128))


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    loaded = {family: staticrt.load_model(hf_checkpoints[family][0]) for family in FAMILIES}
    assert loaded["mamba2"].config.layer_types == ("mamba", "mamba")
    assert loaded["granitemoehybrid"].config.layer_types == ("mamba", "full_attention", "mamba")
    assert loaded["falcon_h1"].config.layer_types == ("mamba", "full_attention") * 2  # two cache layers a layer
    return loaded


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_tokens_equal_transformers_batch_four_and_one(transformers_tokens, models, family):
    expected = transformers_tokens(family, PROMPTS, NEW_TOKENS)
    gen = staticrt.Generator(models[family], max_batch_size=4, **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected
    alone = staticrt.Generator(models[family], max_batch_size=1, **OPTIONS)
    assert alone.generate([PROMPTS[1]], NEW_TOKENS) == [expected[1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_graphs_give_transformers_tokens(transformers_tokens, models, family):
    """The compiled step graphs write the state and conv buffers at their fixed addresses; Granite's
    too through the CUDA-graph backend's host side replayed on the CPU."""
    expected = transformers_tokens(family, PROMPTS, NEW_TOKENS)
    gen = staticrt.Generator(models[family], max_batch_size=4, backend="compiled", **OPTIONS)
    assert gen.generate(PROMPTS, NEW_TOKENS) == expected
    if family == "granitemoehybrid":
        replayed = staticrt.Generator(HostReplayBackend(models[family], max_batch_size=4, **OPTIONS))
        assert replayed.generate(PROMPTS, NEW_TOKENS) == expected


def conversation_turns(gen, hf) -> list[int]:
    """Three turns, each the whole conversation so far; the prompt tokens the row kept each turn."""
    conversation, kept = list(PROMPTS[0]), []
    for user in ([7, 8, 9, 10], list(range(30, 50)), [3]):
        conversation += user
        answer = gen.generate([conversation], 12, reuse_prefix=True)[0]
        assert answer == hf_greedy(hf, conversation, 12)
        kept.append(gen.last_stats.kept[0])
        conversation += answer
    return kept


def test_a_conversation_continues_where_the_state_stopped_and_a_shorter_prefix_starts_over(hf_checkpoints, models):
    """Each turn keeps all the row fed (the conversation and the answer but its last token): the
    state stopped there. A prompt that parts from the row earlier keeps nothing (the state cannot
    go back) and gives transformers' tokens."""
    hf = hf_checkpoints["granitemoehybrid"][1]
    gen = staticrt.Generator(models["granitemoehybrid"], max_batch_size=1, **OPTIONS)
    kept = conversation_turns(gen, hf)
    assert kept == [0, 7 + 4 + 11, 7 + 4 + 12 + 20 + 11]
    branch = gen.held[0][:30] + [5, 5]
    assert gen.generate([branch], 12, reuse_prefix=True)[0] == hf_greedy(hf, branch, 12)
    assert gen.last_stats.kept == [0]


def test_the_host_pool_keeps_a_state_whole_whose_width_equals_the_cache_length(models):
    """A row stashed to the host and restored into another (the server's prefix pool, row_state.py)
    takes the state whole: here a Mamba2 state's D (16) equals max_cache_len, the length by which a
    linear layer's K/V is cut to the positions the row holds."""
    model = models["granitemoehybrid"]
    cache = build_cache(model.config, CacheSpec("static", 2, 16), torch.float32)
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0][:5], [0] * 5]), torch.tensor([0, 0]), cache, num_new=torch.tensor([5, 0]))
    assert cache.ssm_0.shape[2] == cache.max_sequence_len == 16 and cache.ssm_0[0].any()
    buffers = dict(cache.named_buffers())
    load_row(buffers, 1, save_row(buffers, 0, 5, cache.max_sequence_len))
    assert torch.equal(cache.ssm_0[1], cache.ssm_0[0]) and torch.equal(cache.conv_0[1], cache.conv_0[0])
    assert torch.equal(cache.key_1[1, :, :5], cache.key_1[0, :, :5])


def test_a_recurrent_state_continues_only_from_where_it_stopped_and_takes_no_drafts():
    """prefix.py's layout (0, 0): H - P <= 0. A row that fed 100 tokens continues from 100 alone."""
    layouts = ((64, 4), RECURRENT)
    assert continues(100, 100, layouts) and not continues(100, 99, layouts)
    assert kept_prefix([1, 2, 3], [1, 2, 3, 4], layouts) == 3
    assert kept_prefix([1, 2, 3], [1, 2, 9], layouts) == 0
    assert kept_prefix([1, 2, 3], [1, 2, 3], layouts) == 0  # backing off one token would rewind
    assert draft_room(50, 4, layouts) == 0 and draft_room(50, 4, ((64, 4),)) == 4


def test_speculation_is_refused_by_name(models):
    gen = staticrt.Generator(models["mamba2"], max_batch_size=1, **OPTIONS)
    with pytest.raises(GenerationError) as raised:
        gen.generate([PROMPTS[0]], 8, speculative="ngram:4")
    assert str(raised.value) == (
        "this model's Mamba2 or DeltaNet layers keep a recurrent state, which a verify step would advance past its "
        "rejected drafts (it cannot go back); run it without speculation (drop --speculative; speculative=None)"
    )


@pytest.mark.parametrize("kind", ["offloaded", "sink", "static-int8"])  # sink: named for its Mamba2, not its rotary
def test_caches_that_cannot_hold_mamba_layers_are_refused_by_name(models, kind):
    with pytest.raises(CacheError) as raised:
        build_cache(models["granitemoehybrid"].config, CacheSpec(kind, 1, 64), torch.float32)
    assert str(raised.value) == (
        f"cache {kind!r} cannot hold this granitemoehybrid model's mamba layers (their state is kept in float on "
        "the device); use cache='static'"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_artifacts_run_the_mamba_layers_with_transformers_tokens(transformers_tokens, models, family, tmp_path):
    """AOTInductor's library holds the state and conv buffers as it holds K/V. The ONNX graph takes
    them as past/present inputs (onnx_step.py's GraphStateView), its holes given dt 0, each step's
    S positions scanned as one chunk: tokens equal still."""
    expected = transformers_tokens(family, PROMPTS, NEW_TOKENS)
    folder = export_artifact(models[family], CacheSpec("static", 4, 288), [128], tmp_path / "a", ["aoti", "onnx"])
    for backend in ("aoti", "onnx"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected, backend
    assert not (folder / "genai_config.json").exists()


def test_an_onnx_row_continues_its_conversation(hf_checkpoints, models, tmp_path):
    """A batch-1 ONNX row moves back to where its kept prefix ends, which for a Mamba2 layer is
    where its state stopped."""
    folder = export_artifact(models["granitemoehybrid"], CacheSpec("static", 1, 160), [64], tmp_path / "o", ["onnx"])
    kept = conversation_turns(load_artifact(folder, "onnx"), hf_checkpoints["granitemoehybrid"][1])
    assert kept == [0, 7 + 4 + 11, 7 + 4 + 12 + 20 + 11]


@pytest.mark.parametrize("family", ["granitemoehybrid", "falcon_h1"])
def test_the_bench_builds_transformers_model_from_the_decoders_weights(hf_checkpoints, models, family):
    """The bench's transformers contender (bench/hf.py): config_to_hf and the family's names give
    back the model transformers saved: Granite's experts, shared MLP and Mamba2 layers, Falcon-H1's
    parallel Mamba2 and µP multipliers alike."""
    from staticrt.bench.hf import hf_model_like

    rebuilt, saved = hf_model_like(models[family]), hf_checkpoints[family][1]
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        # its attention is transformers' default (sdpa), the saved one eager: equal to rounding
        torch.testing.assert_close(rebuilt(ids).logits, saved(ids).logits, rtol=1e-5, atol=1e-5)
