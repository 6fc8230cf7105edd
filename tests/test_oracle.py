"""staticrt against transformers on tiny random-weight checkpoints of every family, loaded
through staticrt's own loader: logits within 1e-4 and identical greedy tokens, both backends."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import FAMILIES
from hf_models import hf_greedy

import staticrt
from staticrt.caches import CacheSpec, build_cache

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], [1, 2], list(range(10, 23))]  # lengths 7, 2, 13: one bucket
NEW_TOKENS = 32


def forward_fn(backend: str, family: str):
    def logits(model, ids, write_index, cache, fresh=False):
        return model(ids, write_index, cache, last_only=False, fresh=fresh)

    if backend == "eager":
        return logits
    # a code object of its own a family: dynamo counts its recompile limit (8) by code object, and
    # each family compiles three shapes here
    code = logits.__code__.replace(co_name=f"logits_{family.replace('-', '_')}")
    copy = types.FunctionType(code, logits.__globals__, code.co_name, logits.__defaults__)
    return torch.compile(copy, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("family", FAMILIES + ("llama-linear-tied",))
def test_state_dict_is_the_checkpoints(hf_checkpoints, family):
    """q/k/v and gate/up load into one fused matrix each, yet `state_dict` gives back the
    checkpoint's tensors under the checkpoint's names and in its order (Qwen2's q/k/v biases too)."""
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder)
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    if model.config.tie_word_embeddings:
        del theirs["lm_head.weight"]
    ours = model.state_dict()
    assert list(ours) == list(theirs)
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []
    assert {name for name, _ in model.named_parameters()} >= {
        "layers.0.self_attn.qkv_proj.weight",
        "layers.0.mlp.gate_up_proj.weight",
    }


# The linear-RoPE / tied / MQA Llama variant runs eager only: its compiled graph is the Llama one.
LOGIT_CASES = [(f, b) for f in FAMILIES for b in ("eager", "compiled")] + [("llama-linear-tied", "eager")]


@pytest.mark.parametrize(("family", "backend"), LOGIT_CASES)
def test_logits_match_transformers(hf_checkpoints, family, backend):
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder, dtype=torch.float32)
    prompt = PROMPTS[0]
    continuation = hf_greedy(hf, prompt, 20)
    kind = "sliding" if family == "mistral-sw16" else "static"  # 27 positions: past its window of 16
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + continuation])).logits[0]  # [S, V], no cache
        cache = build_cache(model.config, CacheSpec(kind, 1, 64), torch.float32)
        step = forward_fn(backend, family)
        # the prompt in two chunks: from position 0 (the step's own K/V alone), then over the cache
        got = [
            step(model, torch.tensor([prompt[:4]]), torch.tensor([0]), cache, True)[0],  # [4, V]
            step(model, torch.tensor([prompt[4:]]), torch.tensor([4]), cache)[0],  # [T - 4, V]
        ]
        for i, token in enumerate(continuation):
            got.append(step(model, torch.tensor([[token]]), torch.tensor([len(prompt) + i]), cache)[0])
    got = torch.cat(got)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(hf_checkpoints, generators, family, backend):
    hf = hf_checkpoints[family][1]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    gen = generators(family, backend)
    assert gen.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS) == [expected[0]]
    assert gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
    # The tokens are not a degenerate repeat, so the comparison can tell models apart.
    assert len(set(expected[0])) > 4


@pytest.mark.parametrize("family", ["mistral-sw16", "llama"])
def test_a_first_prefill_in_causal_blocks_gives_transformers_logits(hf_checkpoints, family, monkeypatch):
    """A first prefill of 20 tokens in blocks of 8 queries (`view.FRESH_BLOCK`, 512 in use), each
    against the keys from its window's start to its last query (Mistral's window of 16 leaves the
    first keys out of the last block), then 7 decode steps: every position's logits within 1e-4 of
    transformers', and the blocks did run (three fused calls a layer)."""
    from staticrt.caches import view

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    counting = types.SimpleNamespace(scaled_dot_product_attention=lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    monkeypatch.setattr(view, "FRESH_BLOCK", 8)
    monkeypatch.setattr(view, "F", counting)
    folder, hf = hf_checkpoints[family]
    model = staticrt.load_model(folder, dtype=torch.float32)
    ids = PROMPTS[0] + hf_greedy(hf, PROMPTS[0], 20)  # 27 tokens, past Mistral's window
    kind = "sliding" if family == "mistral-sw16" else "static"
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [27, V], no cache
        cache = build_cache(model.config, CacheSpec(kind, 1, 32), torch.float32)
        got = [model(torch.tensor([ids[:20]]), torch.tensor([0]), cache, last_only=False, fresh=True)[0]]
        assert len(calls) == 3 * model.config.num_layers
        for i in range(20, len(ids)):
            got.append(model(torch.tensor([ids[i : i + 1]]), torch.tensor([i]), cache, last_only=False)[0])
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)
