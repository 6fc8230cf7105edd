"""The compiled backend never recompiles within a bucket and agrees with eager, sampling included."""

from __future__ import annotations

import pytest
import torch

import staticrt


@pytest.fixture(scope="module")
def tiny():
    return staticrt.load_model("tiny-llama")


def test_no_recompile_across_generations_in_one_bucket(tiny):
    eager = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64)
    compiled = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64, backend="compiled")
    prompts_a = [[3, 1, 4, 1, 5], [9, 2, 6]]  # bucket 16
    prompts_b = [list(range(20, 31))]  # 11 tokens, bucket 16, one row of two
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = compiled.generate(prompts_a, max_new_tokens=40)
        graphs = dict(compiled.backend._graphs)
        second = compiled.generate(prompts_b, max_new_tokens=40)
    assert set(graphs) == {(16, False), (1, False)}  # one prefill graph, one decode graph
    assert compiled.backend._graphs == graphs
    assert first == eager.generate(prompts_a, max_new_tokens=40)
    assert second == eager.generate(prompts_b, max_new_tokens=40)


def test_seeded_sampling_is_reproducible_and_backend_independent(tiny):
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=50, top_p=0.95)
    prompts = [[7, 8, 9], [1, 2, 3, 4, 5, 6]]
    eager = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64)
    compiled = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64, backend="compiled")
    a = eager.generate(prompts, seed=123, **kwargs)
    assert eager.generate(prompts, seed=123, **kwargs) == a
    assert eager.generate(prompts, seed=124, **kwargs) != a
    assert compiled.generate(prompts, seed=123, **kwargs) == a
    greedy = eager.generate(prompts, max_new_tokens=24)
    assert a != greedy


def test_guards_are_checked_once_a_generation_and_a_changed_model_recompiles(monkeypatch):
    from staticrt.backends.compiled import CompiledBackend

    model = staticrt.load_model("tiny-llama")
    compiled = staticrt.Generator(model, max_batch_size=1, max_cache_len=64, backend="compiled")
    eager = staticrt.Generator(model, max_batch_size=1, max_cache_len=64)
    direct_calls = []
    checked_code = CompiledBackend._checked_code

    def counting_checked_code(graph):
        code = checked_code(graph)

        def counted(*args):
            direct_calls.append(code.__name__)
            return code(*args)

        return counted

    monkeypatch.setattr(CompiledBackend, "_checked_code", staticmethod(counting_checked_code))
    prompt = [[5, 6, 7]]
    first = compiled.generate(prompt, max_new_tokens=10)
    # prefill and the first decode step go through dynamo's guards; the other 8 decode steps
    # call the code whose guards passed
    assert direct_calls == ["run_step_decode_greedy"] * 8
    assert first == eager.generate(prompt, max_new_tokens=10)
    # Between generations the model changes in a way the graphs depend on: the head goes from the
    # column-major layout the CPU loader gives it back to row-major. The next generation checks
    # guards again, recompiles, and still gives eager's tokens. (With the guards skipped, the
    # stale graph gets the head with strides it was not compiled for and raises on them.)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert not head.is_contiguous()
    head.data = head.data.contiguous()
    direct_calls.clear()
    assert compiled.generate(prompt, max_new_tokens=10) == first
    assert direct_calls == ["run_step_decode_greedy"] * 8
    # Back to column-major: dynamo hits the first graph again, and its code is the one called
    # directly after it (dynamo keeps the entry it used first in its list).
    head.data = head.data.t().contiguous().t()
    direct_calls.clear()
    assert compiled.generate(prompt, max_new_tokens=10) == first
    assert direct_calls == ["run_step_decode_greedy"] * 8
