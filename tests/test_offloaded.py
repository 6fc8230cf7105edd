"""The offloaded caches: host storage, two working buffers that take turns, the write-through.

On the CPU the same class runs the same logic with synchronous copies, so the bookkeeping is
checked on every machine: element by element, and token for token against transformers for all
four families (and for five-layer models, where the two working buffers are reused). The CUDA
tests (pinned memory, side-stream prefetch, device memory, CUDA-graph capture) skip without CUDA.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from hf_models import hf_greedy, save_hf_model

import staticrt
from staticrt.backends.step import run_step
from staticrt.caches import CacheSpec, OffloadedStaticCache, OffloadWarning, build_cache, offloaded
from staticrt.config import ModelConfig
from staticrt.errors import CacheError
from staticrt.generation.params import SamplingParams
from staticrt.models.presets import PRESETS

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], [1, 2], list(range(10, 23))]  # lengths 7, 2, 13
NEW_TOKENS = 64
CPU_WARNING = (
    "offloaded cache on cpu: this machine has no pinned memory for cpu (CUDA is not available); host storage "
    "falls back to ordinary memory and the working buffers are filled by synchronous copies: the same tokens, "
    "but no overlap and no CUDA-graph capture. Offload from a CUDA device with pinned memory, or use "
    "cache='static'"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: pinned host storage, the side-stream prefetch, CUDA graphs"
)
pytestmark = pytest.mark.filterwarnings("ignore::staticrt.caches.OffloadWarning")


def one_head_cache(num_layers: int = 3, batch: int = 2, max_cache_len: int = 4) -> OffloadedStaticCache:
    config = ModelConfig(
        family="llama",
        vocab_size=8,
        hidden_size=1,
        intermediate_size=1,
        num_layers=num_layers,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
    )
    return OffloadedStaticCache(config, CacheSpec("offloaded", batch, max_cache_len), torch.float32)


def run_layers(cache, start: list[int], steps: int) -> list[list[list[int]]]:
    """One step as the model runs it: lengths and the first prefetch, then per layer the wait and
    the write (layer l writes 10*l + position). Returns what each layer attended to, row by row."""
    write_index = torch.tensor(start)
    num_new = torch.full((len(start),), steps)
    pos = (write_index[:, None] + torch.arange(steps))[:, None, :, None].float()  # [B, 1, T, 1]
    meta = cache.begin_step(write_index, num_new, steps)
    seen = []
    for layer in range(len(cache.rotating)):
        cache.view(layer, meta, pos)
        keys, _ = cache.update(pos + 10 * layer, -pos, layer, write_index, num_new)
        seen.append(keys[:, 0, :, 0].int().tolist())
    return seen


def host(cache, layer: int) -> list[list[int]]:
    return cache.host_buffers(layer)[0][:, 0, :, 0].int().tolist()


def test_cpu_cache_warns_once_that_there_is_no_pinned_memory(monkeypatch):
    monkeypatch.setattr(offloaded, "_WARNED", set())
    with pytest.warns(OffloadWarning) as record:
        one_head_cache()
        one_head_cache()
    assert [str(w.message) for w in record] == [CPU_WARNING]


def test_layers_take_turns_in_two_working_buffers_and_write_through_to_host_storage():
    cache = one_head_cache()
    assert cache.layer_buffers(0)[0] is cache.layer_buffers(2)[0]  # layers 0 and 2 share slot 0
    assert cache.layer_buffers(1)[0] is not cache.layer_buffers(0)[0]
    # Two rows prefill two positions each; every layer sees its own entries, nothing else.
    assert run_layers(cache, [0, 0], 2) == [[[0, 1, 0, 0]] * 2, [[10, 11, 0, 0]] * 2, [[20, 21, 0, 0]] * 2]
    assert [host(cache, layer) for layer in range(3)] == [
        [[10 * layer, 10 * layer + 1, 0, 0]] * 2 for layer in range(3)
    ]
    # Decode at positions 2 (row 0) and 3 (row 1; its slot 2 stays empty): each layer finds its own
    # history brought back from the host, although slot 0 last held layer 2.
    assert run_layers(cache, [2, 3], 1) == [
        [[10 * layer, 10 * layer + 1, 10 * layer + 2, 0], [10 * layer, 10 * layer + 1, 0, 10 * layer + 3]]
        for layer in range(3)
    ]
    assert [host(cache, layer) for layer in range(3)] == [
        [[10 * layer, 10 * layer + 1, 10 * layer + 2, 0], [10 * layer, 10 * layer + 1, 0, 10 * layer + 3]]
        for layer in range(3)
    ]
    assert cache.get_seq_length().tolist() == [3, 4]


def test_memory_accounting_counts_two_working_layers_on_the_device_and_every_layer_on_the_host():
    cache = one_head_cache(num_layers=5, batch=2, max_cache_len=4)
    layer = 2 * 2 * 4 * 4  # K and V, [2, 1, 4, 1] float32 each
    assert cache.host_bytes() == 5 * layer
    assert cache.device_bytes() == 2 * layer + 2 * 8  # two working slots and the int64 lengths
    assert sorted(n for n, _ in cache.named_buffers() if not n.startswith("host_")) == [
        "seq_lens",
        "work_key_0",
        "work_key_1",
        "work_value_0",
        "work_value_1",
    ]


def test_reset_zeroes_host_storage_and_keeps_every_address():
    cache = one_head_cache()
    run_layers(cache, [0, 0], 2)
    addresses = [b.data_ptr() for b in cache.state_buffers()]
    cache.reset()
    assert [b.data_ptr() for b in cache.state_buffers()] == addresses
    assert all(b.abs().sum() == 0 for b in cache.state_buffers())


def test_a_cache_on_another_device_or_for_another_model_is_refused_before_anything_runs():
    model = staticrt.load_model("tiny-llama")
    on_meta = build_cache(model.config, CacheSpec("offloaded", 1, 64), torch.float32, "meta")
    with pytest.raises(CacheError) as err:
        staticrt.Generator(model, cache=on_meta)
    assert str(err.value) == (
        "the offloaded cache is on meta, the model on cpu; build the cache with device='cpu' (its working "
        "buffers must sit where the model computes)"
    )
    half = build_cache(model.config, CacheSpec("offloaded", 1, 64), torch.float16)
    with pytest.raises(
        CacheError,
        match=r"^the cache holds torch.float16, the model computes in torch.float32; "
        r"build the cache with dtype=torch.float32$",
    ):
        staticrt.Generator(model, cache=half)
    other = build_cache(PRESETS["tiny-qwen2"], CacheSpec("offloaded", 1, 64), torch.float32)
    with pytest.raises(CacheError, match="^the cache was built for another model config; build it from this"):
        staticrt.Generator(model, cache=other)
    mine = build_cache(model.config, CacheSpec("offloaded", 2, 64), torch.float32)
    with pytest.raises(CacheError, match=r"^max_batch_size=3 conflicts with the cache's max_batch_size=2; leave "):
        staticrt.Generator(model, cache=mine, max_batch_size=3)
    gen = staticrt.Generator(model, cache=mine)  # the cache's own spec: batch 2, 64 positions
    assert (gen.backend.batch_size, gen.backend.max_cache_len) == (2, 64)
    assert gen.generate([[1, 2, 3]], max_new_tokens=8) == staticrt.Generator(model, max_cache_len=64).generate(
        [[1, 2, 3]], max_new_tokens=8
    )


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_tokens_match_transformers(hf_checkpoints, generators, family, backend):
    hf = hf_checkpoints[family][1]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    gen = generators(family, backend, "offloaded")
    assert gen.backend.cache.kind == "offloaded"
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert gen.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS) == [expected[0]]
        assert gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """Five-layer Llama and Gemma2 checkpoints: the working buffers are reused (layers 0, 2, 4 in
    one, 1, 3 in the other); Gemma2 offloads only its global layers 1 and 3."""
    pytest.importorskip("transformers", reason="transformers is the oracle; install the test extra")
    root = tmp_path_factory.mktemp("five")
    alternating = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    return {
        "llama": (root / "llama", save_hf_model("llama", root / "llama", num_hidden_layers=5)),
        "gemma2": (
            root / "gemma2",
            save_hf_model("gemma2", root / "gemma2", num_hidden_layers=5, layer_types=alternating),
        ),
    }


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize(("family", "cache"), [("llama", "offloaded"), ("gemma2", "offloaded-hybrid")])
def test_five_layer_models_reuse_the_working_buffers_and_match_transformers(five_layers, family, cache, backend):
    folder, hf = five_layers[family]
    model = staticrt.load_model(folder)
    gen = staticrt.Generator(model, cache=cache, max_batch_size=3, max_cache_len=128, backend=backend)
    kv = gen.backend.cache
    assert [kv.layer_layout(i) for i in range(5)] == (
        ["offloaded"] * 5 if family == "llama" else ["sliding", "offloaded"] * 2 + ["sliding"]
    )
    prompts = [list(range(30, 60)), [4, 5], list(range(100, 120))]  # 30 tokens: past Gemma2's window of 16
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert gen.generate(prompts, max_new_tokens=NEW_TOKENS) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_offloaded_hybrid_refuses_a_model_without_sliding_layers():
    with pytest.raises(CacheError, match=r"^cache 'offloaded-hybrid' gives sliding-window layers a rotating buffer"):
        build_cache(PRESETS["tiny-llama"], CacheSpec("offloaded-hybrid", 1, 64), torch.float32, "meta")


# ---- CUDA ------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_offloaded_tokens_equal_the_static_cache(hf_checkpoints, family, backend):
    model = staticrt.load_model(hf_checkpoints[family][0], device="cuda")
    static = staticrt.Generator(model, cache="static", max_batch_size=3, max_cache_len=128, backend=backend)
    offloaded = staticrt.Generator(model, cache="offloaded", max_batch_size=3, max_cache_len=128, backend=backend)
    assert offloaded.backend.cache.pinned
    for prompts in ([PROMPTS[0]], PROMPTS):
        assert offloaded.generate(prompts, max_new_tokens=NEW_TOKENS) == static.generate(
            prompts, max_new_tokens=NEW_TOKENS
        )


@needs_cuda
def test_cuda_device_memory_for_sixteen_layers_is_two_layers_of_kv():
    tiny = PRESETS["tiny-llama"]
    config = dataclasses.replace(tiny, num_layers=16, layer_types=tiny.layer_types[:1] * 16)
    spec = CacheSpec("offloaded", 2, 4096)
    layer = 2 * (2 * config.num_kv_heads * 4096 * config.head_dim * 4)  # K and V of one layer, float32

    def allocated_by(kind: str) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        cache = build_cache(config, dataclasses.replace(spec, kind=kind), torch.float32, "cuda")
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        del cache
        return grown

    assert 2 * layer <= allocated_by("offloaded") <= 2 * layer + 4096  # + the lengths, rounded by the allocator
    assert 16 * layer <= allocated_by("static") <= 16 * layer + 4096


@needs_cuda
def test_cuda_graph_captures_the_offloaded_decode_step_and_replays_the_same_tokens(five_layers):
    model = staticrt.load_model(five_layers["llama"][0], device="cuda")
    gen = staticrt.Generator(model, cache="offloaded", max_batch_size=2, max_cache_len=128)
    prompts, steps = [list(range(30, 50)), [4, 5, 6]], 32
    expected = gen.generate(prompts, max_new_tokens=steps)

    backend, cache = gen.backend, gen.backend.cache
    lengths = np.array([len(p) for p in prompts])
    input_ids = np.zeros((2, 32), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = prompt
    cache.reset()
    first = backend.step(input_ids, np.zeros(2, dtype=np.int64), lengths, SamplingParams(), None)
    dev = torch.device("cuda")
    ids = torch.tensor(first, device=dev)[:, None]  # [B, 1] static inputs of the captured step
    write_index = torch.tensor(lengths, device=dev)
    ones = torch.ones(2, dtype=torch.int64, device=dev)
    params = (torch.ones(2, device=dev), torch.zeros(2, dtype=torch.int64, device=dev), torch.ones(2, device=dev))

    def decode() -> torch.Tensor:
        return run_step(model, cache, ids, write_index, ones, *params, None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # warm-up rewrites the same entries: same inputs
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = decode()
    tokens = [first.tolist()]
    for _ in range(steps - 1):
        graph.replay()
        next_ids = out.clone()  # copied out before the next replay overwrites it
        tokens.append(next_ids.tolist())
        ids.copy_(next_ids[:, None])
        write_index += 1
    assert [list(row) for row in zip(*tokens)] == expected
