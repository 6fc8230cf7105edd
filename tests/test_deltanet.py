"""Gated DeltaNet layers (issue 65): Qwen3.5's linear attention, a convolution's inputs and a delta-rule
state `[B, Hv, Dk, Dv]` kept in the cache (caches/recurrent.py), on a tiny checkpoint transformers
saved from its own `Qwen3_5TextConfig`: three DeltaNet layers (2 key heads serving 4 value heads)
and gated attention with a quarter rotary and (1 + w) norms. The chunked form works in chunks of
64, so the 157-token prompt spans three. Tokens equal transformers' on eager, compiled,
AOTInductor and ONNX, batch 4 and 1, 200 new tokens (logits in one step, two and a token at a time:
test_recurrent.py, as is the state, transformers' and kept bit for bit in a row that sits a step
out); a conversation continues from where the state stopped.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

import staticrt
from staticrt.caches import CacheSpec
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 80)) + list(range(3, 90)), [1, 2, 3], list(range(100, 120))]
NEW_TOKENS = 200
OPTIONS = dict(max_cache_len=384, prefill_buckets=(16, 160))


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    loaded = staticrt.load_model(hf_checkpoints["qwen3_5_text"][0])
    assert loaded.config.layer_types == ("deltanet", "deltanet", "deltanet", "full_attention")
    assert loaded.config.rotary_dim == 4 and loaded.config.attention_output_gate
    return loaded


@pytest.fixture(scope="module")
def expected(transformers_tokens):
    return transformers_tokens("qwen3_5_text", PROMPTS, NEW_TOKENS)


def test_eager_and_compiled_tokens_equal_transformers_batch_four_and_one(model, expected):
    for backend in ("eager", "compiled"):
        gen = staticrt.Generator(model, max_batch_size=4, backend=backend, **OPTIONS)
        assert gen.generate(PROMPTS, NEW_TOKENS) == expected, backend
    alone = staticrt.Generator(model, max_batch_size=1, **OPTIONS)
    assert alone.generate([PROMPTS[1]], NEW_TOKENS) == [expected[1]]


def test_a_conversation_continues_where_the_state_stopped(hf_checkpoints, model):
    hf = hf_checkpoints["qwen3_5_text"][1]
    gen = staticrt.Generator(model, max_batch_size=1, **OPTIONS)
    conversation, kept = list(PROMPTS[0]), []
    for user in ([7, 8, 9, 10], list(range(30, 100))):
        conversation += user
        answer = gen.generate([conversation], 12, reuse_prefix=True)[0]
        assert answer == hf_greedy(hf, conversation, 12)
        kept.append(gen.last_stats.kept[0])
        conversation += answer
    assert kept == [0, 7 + 4 + 11]


@pytest.mark.parametrize("size", [1, 2, 5, 64, 160])
def test_solving_by_doubling_is_solve_triangular_for_systems_up_to_the_longest(size):
    """The ONNX graph's solve: (I + N)^-1 as ceil(log2(384)) = 9 factors, for any L <= 384, equals
    torch.linalg.solve_triangular's (unitriangular: the diagonal read as ones). With one factor
    (a longest of 2), a system of 3 or more is not solved."""
    from staticrt.models.gated_deltanet import _solve_by_doubling

    gen = torch.Generator().manual_seed(size)
    system = torch.randn(2, 3, size, size, generator=gen, dtype=torch.float64).tril() * 0.3
    rhs = torch.randn(2, 3, size, 4, generator=gen, dtype=torch.float64)
    exact = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    torch.testing.assert_close(_solve_by_doubling(system, rhs, 384), exact)
    if size > 2:
        assert not torch.allclose(_solve_by_doubling(system, rhs, 2), exact)


def test_the_artifacts_run_the_deltanet_layers_with_transformers_tokens(model, expected, tmp_path):
    """AOTInductor holds the state as a buffer. The ONNX graph takes it as past/present and solves
    each step's S positions as one chunk, its triangular system by doubling (gated_deltanet.py):
    tokens equal still."""
    folder = export_artifact(model, CacheSpec("static", 4, 384), [160], tmp_path / "a", ["aoti", "onnx"])
    for backend in ("aoti", "onnx"):
        assert load_artifact(folder, backend).generate(PROMPTS, NEW_TOKENS) == expected, backend


def test_a_qwen3_5_vision_language_checkpoint_runs_its_text_half(tmp_path):
    """`qwen3_5` checkpoints (the released Qwen3.5 models) hold the text model as `text_config` and
    `model.language_model.*`; staticrt loads that half, the vision tower left out, and its tokens
    are transformers' own model's."""
    import transformers as tf
    from hf_models import recurrent_config

    text = recurrent_config(tf, "qwen3_5_text").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.02 if "embed" in name else 0.1 if "norm" in name else 0.15))
    hf.save_pretrained(tmp_path)
    model = staticrt.load_model(tmp_path)
    assert model.config.family == "qwen3_5_text"
    gen = staticrt.Generator(model, max_batch_size=1, **OPTIONS)
    assert gen.generate([PROMPTS[3]], 30)[0] == hf_greedy(hf, PROMPTS[3], 30)
