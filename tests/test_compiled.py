"""The compiled backend never recompiles within a bucket and agrees with eager, sampling included."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest
import torch

import staticrt
from staticrt.errors import GenerationError
from staticrt.generation.params import SamplingParams


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
    assert set(graphs) == {(16, "pick", True), (1, "pick", False)}  # one prefill graph, one decode graph
    assert compiled.backend._graphs == graphs
    assert first == eager.generate(prompts_a, max_new_tokens=40)
    assert second == eager.generate(prompts_b, max_new_tokens=40)


@pytest.mark.parametrize("threads", [2, 1])
def test_a_prefill_graphs_kernels_build_as_one_library_a_compile_thread(tiny, monkeypatch, tmp_path, threads):
    """The Python-wrapper prefill graph's kernels (one library each, as inductor builds them)
    go into as many libraries as inductor has compile threads (kernel_libraries.py), with the
    eager backend's tokens; the decode graph keeps its one C++-wrapper library. One thread (a
    1-CPU machine) builds them in the thread that loads them: it hung in inductor's file lock."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    built, load_async = [], CppPythonBindingsCodeCache.load_async.__func__

    def counted(cls, source, *args, **kwargs):
        built.append(source)
        return load_async(cls, source, *args, **kwargs)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_async", classmethod(counted))
    if threads == 1:  # its libraries built here, not found in the run's inductor cache
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]  # bucket 16, as the test above: inductor's FX cache may hold it
    with torch._inductor.config.patch(compile_threads=threads):
        compiled = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64, backend="compiled")
        tokens = compiled.generate(prompts, max_new_tokens=8)
    assert tokens == staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64).generate(prompts, max_new_tokens=8)
    libraries = [source.count("namespace staticrt_kernel_") for source in built if "PyInit_kernel(void)" in source]
    assert len(libraries) == threads and min(libraries) >= 3, libraries  # no kernel in a library of its own
    assert sum("inductor_entry_cpp" in source for source in built) == 1  # decode's C++ wrapper


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


def test_greedy_and_sampling_steps_share_one_graph_and_give_the_eager_tokens(tiny):
    """On the CPU one graph a width serves greedy and sampling steps (`sampling.pick`): after a
    greedy generation, a sampling one compiles nothing. Its tokens are eager's when every row
    samples, when every row is top-k 1 (the graph's argmax branch, against eager's sort), and when
    a batch mixes such a row with a sampling one (a server's rows)."""
    eager = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64)
    compiled = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64, backend="compiled")
    prompts = [[7, 8, 9], [1, 2, 3, 4, 5, 6]]
    assert compiled.generate(prompts, max_new_tokens=24) == eager.generate(prompts, max_new_tokens=24)
    graphs = dict(compiled.backend._graphs)
    assert set(graphs) == {(16, "pick", True), (1, "pick", False)}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for options in (dict(temperature=0.9, top_k=50, top_p=0.95), dict(temperature=0.7, top_k=1)):
            kwargs = dict(max_new_tokens=24, do_sample=True, seed=5, **options)
            assert compiled.generate(prompts, **kwargs) == eager.generate(prompts, **kwargs), options
        assert compiled.last_stats.compile_s == 0.0 and compiled.backend._graphs == graphs
        # row 0 greedy as a server writes it (top-k 1), row 1 sampling; prompts of 3 in the 16 bucket
        temperature, top_p = np.array([0.7, 1.3], np.float32), np.array([1.0, 0.9], np.float32)
        mixed = SamplingParams(True, temperature, np.array([1, 40]), top_p)
        prompt = np.zeros((2, 16), dtype=np.int64)
        prompt[:, :3] = [[5, 6, 7], [8, 9, 10]]
        ids = {}
        for gen in (eager, compiled):
            backend, rng = gen.backend, np.random.default_rng(3)
            backend.reset()
            chosen = [backend.step(prompt, np.zeros(2, np.int64), np.array([3, 3]), mixed, rng.random(2, np.float32))]
            for position in range(3, 12):
                where = (np.full(2, position), np.ones(2, np.int64))
                chosen.append(backend.step(chosen[-1].reshape(2, 1), *where, mixed, rng.random(2, np.float32)))
            ids[backend.name] = np.stack(chosen).tolist()
    assert ids["compiled"] == ids["eager"]


def test_guards_are_checked_once_a_generation_and_a_changed_model_recompiles(monkeypatch):
    from staticrt.backends import compiled as compiled_module

    model = staticrt.load_model("tiny-llama")
    compiled = staticrt.Generator(model, max_batch_size=1, max_cache_len=64, backend="compiled")
    eager = staticrt.Generator(model, max_batch_size=1, max_cache_len=64)
    direct_calls = []
    code_past_guards = compiled_module.code_past_guards

    def counting_code_past_guards(graph):
        code = code_past_guards(graph)
        assert code is not None, "torch's cache-entry API changed: see staticrt/backends/guards.py"

        def counted(*args, **kwargs):
            direct_calls.append(code.__name__)
            return code(*args, **kwargs)

        return counted

    monkeypatch.setattr(compiled_module, "code_past_guards", counting_code_past_guards)
    prompt = [[5, 6, 7]]
    first = compiled.generate(prompt, max_new_tokens=10)
    # prefill and the first decode step go through dynamo's guards; the other 8 decode steps
    # call the code whose guards passed
    assert direct_calls == ["run_step_decode"] * 8
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
    assert direct_calls == ["run_step_decode"] * 8
    # Back to column-major: dynamo hits the first graph again, and its code is the one called
    # directly after it (dynamo keeps the entry it used first in its list).
    head.data = head.data.t().contiguous().t()
    direct_calls.clear()
    assert compiled.generate(prompt, max_new_tokens=10) == first
    assert direct_calls == ["run_step_decode"] * 8


def test_code_past_guards_is_the_code_dynamo_ran_and_gives_its_result():
    from staticrt.backends.guards import code_past_guards

    def scaled(x):
        return x * 2 + 1

    compiled = torch.compile(scaled, fullgraph=True, dynamic=False)
    x = torch.arange(4.0)
    assert compiled(x).tolist() == [1.0, 3.0, 5.0, 7.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a changed torch API warns: fail here, loudly
        direct = code_past_guards(compiled)
    assert direct is not None and direct.__code__ is not scaled.__code__
    assert direct(torch.arange(4.0) + 1).tolist() == [3.0, 5.0, 7.0, 9.0]


def test_without_the_private_api_the_backend_warns_once_and_keeps_dynamo(monkeypatch):
    from staticrt.backends import guards

    monkeypatch.setattr(guards, "_WARNED", set())
    monkeypatch.delattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list")
    model = staticrt.load_model("tiny-llama")
    compiled = staticrt.Generator(model, max_batch_size=1, max_cache_len=64, backend="compiled")
    with pytest.warns(guards.GuardSkipWarning, match="compiled steps go through dynamo's guard check") as record:
        tokens = compiled.generate([[5, 6, 7]], max_new_tokens=6)
        assert compiled.generate([[5, 6, 7]], max_new_tokens=6) == tokens
    assert len([w for w in record if issubclass(w.category, guards.GuardSkipWarning)]) == 1
    graph = compiled.backend._graphs[1, "pick", False]
    assert compiled.backend.step_function(1, "pick", False) is graph  # steps go through dynamo, as before the change
    assert tokens == staticrt.Generator(model, max_batch_size=1, max_cache_len=64).generate(
        [[5, 6, 7]], max_new_tokens=6
    )


def test_a_first_compile_is_announced_and_timed_apart_from_prefill(capfd):
    """`run --backend compiled` says, on stderr, which graph it compiles before it starts and how
    long it took; the JSON's compile_s holds that time and prefill_ms only the prefill's."""
    from staticrt.cli.main import main

    argv = ["run", "--model", "tiny-llama", "--backend", "compiled", "--prompt-ids", "1,2,3", "--json"]
    assert main([*argv, "--max-new-tokens", "4"]) == 0
    # 3 + 4 positions, in a cache of 256 (`run` sizes a compiled cache in steps of 256, so that
    # the next prompt finds its graphs): the prompt pads to the smallest bucket, 16
    out, err = capfd.readouterr()
    lines = [
        re.sub(r"about (\d+ min )?\d+ s left", "about N s left", line.split(" in ")[0]) for line in err.splitlines()
    ]
    lines = [line for line in lines if "step graph" in line]
    assert lines == [
        "compiling the prefill16 step graph, 1 of 2 (first use; later generations reuse it) ...",
        "compiled the prefill16 step graph",
        "compiling the decode step graph, 2 of 2 (first use; later generations reuse it; about N s left) ...",
        "compiled the decode step graph",
    ]
    report = json.loads(out)
    assert report["compile_s"] > report["prefill_ms"] / 1000 > 0


def test_graphs_built_once_are_not_compiled_again(tiny):
    gen = staticrt.Generator(tiny, max_cache_len=64, backend="compiled")
    gen.generate([[1, 2, 3]], max_new_tokens=3)
    assert gen.last_stats.compile_s > 0
    gen.generate([[4, 5]], max_new_tokens=3)
    assert gen.last_stats.compile_s == 0.0
    gen.generate([list(range(1, 20))], max_new_tokens=1)  # a new prefill bucket (32), no decode
    assert gen.last_stats.compile_s > 0
    assert set(gen.backend._built) == {(16, "pick", True), (1, "pick", False), (32, "pick", True)}


def test_a_server_builds_the_graphs_of_continuing_rows_before_it_serves(tiny):
    """A multi-token step of rows that hold tokens (a chunked prompt) runs a graph of its own
    (`starts_fresh`); `prepare(continuing=True)` builds it up front, and it gives eager's logits."""
    eager = staticrt.Generator(tiny, max_batch_size=1, max_cache_len=64, prefill_buckets=[16])
    gen = staticrt.Generator(tiny, max_batch_size=1, max_cache_len=64, prefill_buckets=[16], backend="compiled")
    assert gen.backend.prepare((16, 1), False, continuing=True) > 0
    assert set(gen.backend._built) == {(16, "pick", True), (16, "pick", False), (1, "pick", False)}
    chunks = [np.arange(1, 17).reshape(1, 16), np.arange(20, 36).reshape(1, 16)]  # positions 0..15, then 16..31
    ids = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for backend in (eager.backend, gen.backend):
            backend.reset()
            ids[backend.name] = [
                backend.step(chunk, np.array([16 * i]), np.array([16]), SamplingParams(), None).tolist()
                for i, chunk in enumerate(chunks)
            ]
    assert set(gen.backend._graphs) == set(gen.backend._built)  # nothing compiled while stepping
    assert ids["compiled"] == ids["eager"]
    torch.testing.assert_close(gen.backend.cache.key_0[:, :, :32], eager.backend.cache.key_0[:, :, :32])


def test_a_decoder_of_hidden_256_and_up_decodes_with_frozen_weights_packed_for_onednn(monkeypatch):
    """The CPU decode graph of a model with matrices that large, compiled in the process (the
    compile cache off), freezes its weights and packs them for oneDNN's GEMM (backends/compiled.py);
    this fails if torch drops a name that relies on. A stored graph reads a packed twin instead
    (test_compile_cache)."""
    from torch._dynamo.utils import counters

    from staticrt.backends import freezing
    from staticrt.models.packed_linear import PACK_MIN_HIDDEN
    from staticrt.models.presets import PRESETS

    config = dataclasses.replace(
        PRESETS["tiny-llama"], hidden_size=256, intermediate_size=512, num_heads=4, head_dim=64
    )
    assert config.hidden_size >= PACK_MIN_HIDDEN
    monkeypatch.setitem(PRESETS, "test-256", config)
    monkeypatch.setenv("STATICRT_COMPILE_CACHE", "off")
    model = staticrt.load_model("test-256")
    asked = []
    ask = freezing._OneDnnLinears.__getattr__
    monkeypatch.setattr(
        freezing._OneDnnLinears, "__getattr__", lambda self, name: asked.append(name) or ask(self, name)
    )
    counters.clear()
    compiled = staticrt.Generator(model, max_batch_size=2, max_cache_len=64, backend="compiled")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    with torch._inductor.config.patch(fx_graph_cache=False), torch._dynamo.config.patch(error_on_recompile=True):
        tokens = compiled.generate(prompts, max_new_tokens=24)
    # the decode graph's 9 matrices (2 layers of qkv, o, gate_up, down; the head), none of the prefill graph's
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 9
    assert "_is_mkldnn_acl_supported" in asked  # the pack pass asked which library, and heard oneDNN
    assert tokens == staticrt.Generator(model, max_batch_size=2, max_cache_len=64).generate(prompts, max_new_tokens=24)
    assert compiled.generate(prompts, max_new_tokens=24) == tokens  # a second generation: the same graphs
    # Weights changed in place are not in the frozen graph: refused by name, not computed with the old ones.
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(2)
    with pytest.raises(GenerationError, match="weights changed in place after its decode graph froze them"):
        compiled.generate(prompts, max_new_tokens=24)


def test_a_cpu_prefill_graph_traces_one_layer_for_all_and_gives_the_same_tokens(monkeypatch):
    """A float model's CPU prefill graph compiles its layer once (`Decoder.forward`'s
    `layers_once`): dynamo captures one layer's ops for four layers, and the tokens are those of
    the same graph with every layer inlined. The decode graph inlines every layer."""
    from torch._dynamo.utils import counters

    from staticrt.backends.compiled import CompiledBackend
    from staticrt.models.presets import PRESETS

    tiny = PRESETS["tiny-llama"]
    config = dataclasses.replace(tiny, num_layers=4, layer_types=tiny.layer_types[:1] * 4)
    monkeypatch.setitem(PRESETS, "test-4-layers", config)
    model = staticrt.load_model("test-4-layers")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    captured, tokens = {}, {}
    for once in (True, False):
        monkeypatch.setattr(
            CompiledBackend, "layers_once", lambda self, seq_len, choice="pick", once=once: seq_len > 1 and once
        )
        compiled = staticrt.Generator(model, max_batch_size=2, max_cache_len=64, backend="compiled")
        for width in (16, 1):
            counters.clear()
            compiled.backend.prepare([width], False)
            captured[once, width] = counters["stats"]["calls_captured"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            tokens[once] = compiled.generate(prompts, max_new_tokens=24)
    assert tokens[True] == tokens[False]
    assert captured[True, 1] == captured[False, 1]  # decode: the same graph either way
    per_layer = (captured[False, 16] - captured[True, 16]) / 3  # three layers fewer traced
    assert per_layer > 10 and captured[True, 16] < captured[False, 16] / 2
    monkeypatch.undo()  # the rule itself: CPU prefill graphs of a float model
    backend = staticrt.Generator(model, max_cache_len=64, backend="compiled").backend
    assert (backend.layers_once(16), backend.layers_once(1)) == (True, False)
