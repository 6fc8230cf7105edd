"""The CUDA-graph runner: on a GPU, the eager backend's tokens from replayed graphs with no
allocation after capture; without one, the compiled path with one warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import staticrt
from staticrt.backends import cudagraph

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 250, 11, 64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [9, 8], [33] * 41, [1, 2, 3]]
NO_CUDA = "no CUDA device: the CUDA-graph capture and replay run only on a GPU"


def test_without_cuda_cudagraph_runs_the_compiled_path_and_warns_once(monkeypatch):
    from staticrt.backends.compiled import CompiledBackend

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the fallback is not taken")
    monkeypatch.setattr(cudagraph, "_WARNED", False)
    model = staticrt.load_model("tiny-llama")
    options = dict(cache="static", max_batch_size=4, max_cache_len=128, prefill_buckets=[64])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = staticrt.Generator(model, backend="cudagraph", **options)
        second = staticrt.Generator(model, backend="cudagraph", **options)
    messages = [str(w.message) for w in caught if issubclass(w.category, cudagraph.CudaGraphWarning)]
    assert messages == [
        "backend 'cudagraph' needs a CUDA device and the model is on cpu; running the compiled backend "
        "instead (the same tokens, without CUDA graphs)"
    ]
    # The compiled backend's tokens are the eager ones (test_compiled.py); eager compiles nothing.
    expected = staticrt.Generator(model, backend="eager", **options).generate(PROMPTS, max_new_tokens=16)
    assert type(first.backend).step_function is CompiledBackend.step_function and (
        first.backend.compile_options == CompiledBackend.compile_options
    )
    assert first.generate(PROMPTS, max_new_tokens=16) == expected
    assert second.generate(PROMPTS[:1], max_new_tokens=16) == expected[:1]


# (checkpoint, cache): every family with every cache it takes (sliding needs a windowed model).
CUDA_CASES = [(f, c) for f in ("llama", "qwen2", "mistral-sw16", "gemma2") for c in ("static", "offloaded")] + [
    ("mistral-sw16", "sliding"),
    ("gemma2", "hybrid"),
    ("llama", "static-int8"),
    ("mistral-sw16", "sliding-int8"),
    ("gemma2", "hybrid-int8"),
    ("llama", "sink"),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("family,cache", CUDA_CASES)
def test_cudagraph_tokens_equal_eager_and_nothing_is_allocated_after_capture(hf_checkpoints, family, cache, batch):
    model = staticrt.load_model(hf_checkpoints[family][0], device="cuda")
    options = dict(cache=cache, max_batch_size=batch, max_cache_len=256)
    prompts = PROMPTS[:batch]
    reference = staticrt.Generator(model, backend="eager", **options).generate(prompts, max_new_tokens=128)
    gen = staticrt.Generator(model, backend="cudagraph", **options)
    assert gen.generate(prompts, max_new_tokens=128) == reference  # captures prefill and decode
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert gen.generate(prompts, max_new_tokens=128) == reference
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cudagraph_sampling_with_a_seed_is_reproducible(hf_checkpoints):
    model = staticrt.load_model(hf_checkpoints["llama"][0], device="cuda")
    gen = staticrt.Generator(model, cache="static", max_batch_size=4, max_cache_len=256, backend="cudagraph")
    options = dict(max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.9, seed=7)
    first = gen.generate(PROMPTS, **options)
    assert gen.generate(PROMPTS, **options) == first
    assert (
        staticrt.Generator(model, cache="static", max_batch_size=4, max_cache_len=256).generate(PROMPTS, **options)
        == first
    )  # the same uniforms drive every backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_reduce_overhead_gives_the_eager_tokens(hf_checkpoints):
    model = staticrt.load_model(hf_checkpoints["gemma2"][0], device="cuda")
    options = dict(cache="hybrid", max_batch_size=4, max_cache_len=256)
    reference = staticrt.Generator(model, backend="eager", **options).generate(PROMPTS, max_new_tokens=64)
    assert (
        staticrt.Generator(model, backend="reduce-overhead", **options).generate(PROMPTS, max_new_tokens=64)
        == reference
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_cudagraph_beam_search_gives_the_eager_beams_in_captured_graphs(hf_checkpoints, family):
    """Beam steps and the in-place row reorder replay as graphs; the cache never moves, and a
    second generation allocates nothing."""
    model = staticrt.load_model(hf_checkpoints[family][0], device="cuda")
    options = dict(cache="static", max_batch_size=8, max_cache_len=256)
    beams = dict(max_new_tokens=32, num_beams=4, stop_token_ids=[7])
    reference = staticrt.Generator(model, backend="eager", **options).generate(PROMPTS[:2], **beams)
    gen = staticrt.Generator(model, backend="cudagraph", **options)
    addresses = [b.data_ptr() for b in gen.backend.cache.buffers()]
    assert gen.generate(PROMPTS[:2], **beams) == reference
    assert gen.backend.reorder_graph is not None
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert gen.generate(PROMPTS[:2], **beams) == reference
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert [b.data_ptr() for b in gen.backend.cache.buffers()] == addresses


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_run_with_the_cudagraph_backend_loads_the_model_on_the_gpu(hf_checkpoints, capsys):
    """`staticrt run --backend cudagraph` with no --device replays graphs on the GPU (it used to
    run the compiled path on the CPU with a warning), and gives eager's tokens on the same device."""
    import json

    from staticrt.cli.main import main

    command = ["run", "--model", str(hf_checkpoints["llama"][0]), "--prompt-ids", "5,17,3,99", "--json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", cudagraph.CudaGraphWarning)
        assert main([*command, "--max-new-tokens", "64", "--backend", "cudagraph"]) == 0
    replayed = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*command, "--max-new-tokens", "64", "--backend", "eager", "--device", "cuda"]) == 0
    assert replayed == json.loads(capsys.readouterr().out)["tokens"]
