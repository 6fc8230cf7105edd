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
    # greedy decode ran a step ahead (the last one still in hand) where no layer rotates
    assert (gen.backend.ahead is not None) == (not gen.backend.rotating_layouts)


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


def repeating_prompt(seed: int) -> list[int]:
    """Eight random tokens, twice over with a change: prompt lookup drafts from the first copy."""
    head = torch.randint(1, 256, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    return head + [7, 7] + head[:5]


def on_cuda(hf_checkpoints, family: str, cache: str, backend: str, model=None, **options) -> staticrt.Generator:
    model = model or staticrt.load_model(hf_checkpoints[family][0], device="cuda")
    return staticrt.Generator(model, cache=cache, max_cache_len=128, backend=backend, **options)


SPECULATION_CASES = [("llama", "static"), ("mistral-sw16", "sliding"), ("gemma2", "hybrid")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("family,cache", SPECULATION_CASES)
def test_cudagraph_verify_steps_give_the_eager_tokens_and_allocate_nothing_after_capture(hf_checkpoints, family, cache):
    """Drafts checked in captured verify graphs: prompt lookup (most drafts rejected by a random
    model) and the model as its own draft (every draft kept) leave plain eager decoding's tokens."""
    reference = on_cuda(hf_checkpoints, family, cache, "eager")
    gen = on_cuda(hf_checkpoints, family, cache, "cudagraph", reference.backend.model, prefill_buckets=(16, 64))
    own = staticrt.Speculation(
        "model", 3, drafter=on_cuda(hf_checkpoints, family, cache, "eager", reference.backend.model)
    )
    wants = [reference.generate([repeating_prompt(seed)], 40)[0] for seed in (1, 2)]
    assert gen.generate([repeating_prompt(1)], 40, speculative=own)[0] == wants[0]
    stats = gen.last_stats  # every draft kept (a row whose 16 rotating slots are full drafts one a step)
    assert stats.verify_steps > 0 and stats.accepted == stats.drafted >= stats.verify_steps
    for seed, want in zip((1, 2), wants):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
        assert gen.generate([repeating_prompt(seed)], 40, speculative="ngram:4")[0] == want
        assert gen.last_stats.verify_steps > 0 and gen.last_stats.drafted > 0
    torch.cuda.synchronize()  # the second prompt ran in the graphs the first one captured
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated
    assert {key[1] for key in gen.backend.captured} == {"greedy", "verify"}
    held = [buffer.clone() for buffer in gen.backend.cache.state_buffers()]  # what a later turn would continue
    assert gen.backend.report()["graph_gpu_ms"] > 0  # bench's timed replays of the decode graph
    assert all(torch.equal(a, b) for a, b in zip(held, gen.backend.cache.state_buffers(), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cudagraph_speculative_sampling_draws_the_eager_tokens_for_a_seed(hf_checkpoints, monkeypatch):
    """The sampling verify graph keeps and redraws what eager does from the same uniforms (the
    draft policy's clock left out: which steps verify decides which uniform draws what)."""
    from staticrt.generation.draft_policy import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "timed", lambda policy, seconds, tokens: policy.decode_s.append(seconds))
    model = staticrt.load_model(hf_checkpoints["llama"][0], device="cuda")
    options = dict(do_sample=True, temperature=0.3, top_k=40, top_p=0.95, seed=1234)
    runs = {}
    for backend in ("eager", "cudagraph"):
        gen = on_cuda(hf_checkpoints, "llama", "static", backend, model)
        own = staticrt.Speculation("model", 3, drafter=on_cuda(hf_checkpoints, "llama", "static", "eager", model))
        runs[backend] = gen.generate([repeating_prompt(1)], 40, speculative=own, **options)[0]
        assert 0 < gen.last_stats.accepted < gen.last_stats.drafted  # kept and redrawn
    assert runs["cudagraph"] == runs["eager"]
    assert "verify_sample" in {key[1] for key in gen.backend.captured}


# Where captured graphs replay: CUDA's own, and on the CPU their stand-in (`HostReplayBackend`),
# which runs the backend's host side as on a GPU and so catches its defects without one.
REPLAY_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


def replaying(hf_checkpoints, device: str, family: str, cache: str, model=None, **options) -> staticrt.Generator:
    """A Generator whose steps replay captured graphs on `device` (128 positions)."""
    model = model or staticrt.load_model(hf_checkpoints[family][0], device=device)
    if device == "cuda":
        return on_cuda(hf_checkpoints, family, cache, "cudagraph", model, **options)
    return staticrt.Generator(cudagraph.HostReplayBackend(model, cache=cache, max_cache_len=128, **options))


def eager_on(hf_checkpoints, device: str, family: str, cache: str, model=None, **options) -> staticrt.Generator:
    model = model or staticrt.load_model(hf_checkpoints[family][0], device=device)
    return staticrt.Generator(model, cache=cache, max_cache_len=128, backend="eager", **options)


@pytest.mark.parametrize("device", REPLAY_DEVICES)
@pytest.mark.parametrize("family,cache", SPECULATION_CASES)
def test_replayed_conversation_keeps_its_prefix_and_gives_a_whole_prefills_tokens(
    hf_checkpoints, device, family, cache
):
    """As `chat` runs it: each turn continues the row from what it holds (the continuing prefill
    graphs, `starts_fresh` False, captured on the second turn while the row is live), and answers
    what eager gives the whole conversation. On CUDA every case failed on the second turn: the
    cudagraph step never marked its rows live, so `prepare` captured the continuing graph without
    keeping the cache, and its dummy prefill overwrote the conversation."""
    reference = eager_on(hf_checkpoints, device, family, cache)
    model = reference.backend.model
    continuing = eager_on(hf_checkpoints, device, family, cache, model, prefill_buckets=(16, 64))
    gen = replaying(hf_checkpoints, device, family, cache, model, prefill_buckets=(16, 64))
    chooser = torch.Generator().manual_seed(3)
    conversation = torch.randint(1, 256, (12,), generator=chooser).tolist()
    for turn in range(3):
        whole = reference.generate([conversation], 16)[0]
        assert continuing.generate([conversation], 16, reuse_prefix=True)[0] == whole, f"eager, turn {turn}"
        out = gen.generate([conversation], 16, reuse_prefix=True)[0]
        assert out == whole, f"replayed, turn {turn}"
        assert turn == 0 or gen.last_stats.kept[0] > len(conversation) // 2
        # a linear cache's last step ran ahead and is still in hand when the next turn starts
        assert (gen.backend.ahead is not None) == (cache == "static")
        conversation += out + torch.randint(1, 256, (5,), generator=chooser).tolist()
    assert {key[2] for key in gen.backend.captured} == {True, False}  # fresh and continuing steps


@pytest.mark.parametrize("family,cache", SPECULATION_CASES)
def test_building_a_graph_mid_conversation_leaves_the_rows_as_they_were(hf_checkpoints, family, cache):
    """The capture contract's cache half, exactly: a graph first captured after rows hold a
    conversation (a continuing prefill, a verify step) runs for real in its warm-up and first
    replay, and must leave every cache buffer bitwise as it was."""
    gen = replaying(hf_checkpoints, "cpu", family, cache, prefill_buckets=(16, 64))
    gen.generate([repeating_prompt(1)], 20)
    held = [buffer.clone() for buffer in gen.backend.cache.state_buffers()]
    assert gen.backend.unbuilt((16, 64), False, continuing=True, fresh=False) == {
        (16, "greedy", False),
        (64, "greedy", False),
    }
    gen.backend.prepare((16, 64), False, continuing=True, fresh=False)
    gen.backend.prepare((4,), False, continuing=True, fresh=False, verify=True)
    assert {key for key in gen.backend.captured if not key[2]} >= {(16, "greedy", False), (4, "verify", False)}
    assert all(torch.equal(a, b) for a, b in zip(held, gen.backend.cache.state_buffers(), strict=True))


@pytest.mark.parametrize("device", REPLAY_DEVICES)
def test_a_server_on_replayed_rows_answers_the_eager_tokens_and_continues_a_conversation(hf_checkpoints, device):
    """Three requests at once in a 3-row server of replayed graphs that speculates: each greedy
    answer is a lone eager generate's, the sampled one gets all it asked for, and drafts were
    verified. Then the first conversation's next turn keeps its row's prefix and answers what
    eager gives the whole conversation."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import concurrent.futures

    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    reference = eager_on(hf_checkpoints, device, "mistral-sw16", "sliding")
    model = reference.backend.model
    asks = [(repeating_prompt(1), 0.0), (repeating_prompt(3) * 2, 0.0), (repeating_prompt(2), 1.0)]
    rows = replaying(hf_checkpoints, device, "mistral-sw16", "sliding", model, max_batch_size=3)
    prefiller = replaying(hf_checkpoints, device, "mistral-sw16", "sliding", model)
    app, _ = serve_backend(rows.backend, name="tiny", prefiller=prefiller.backend, speculative="ngram:4")
    with running(app) as url:
        api = client(url)

        def ask(args: tuple[list[int], float]) -> list[int]:
            reply = api.completions.create(model="tiny", prompt=args[0], max_tokens=40, temperature=args[1], seed=7)
            return reply.choices[0].model_extra["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, asks))
        next_turn = asks[0][0] + got[0] + [9, 4, 61, 2]
        continued = ask((next_turn, 0.0))
        metrics = httpx.get(f"{url}/metrics").text
    assert got[:2] == [reference.generate([ids], 40)[0] for ids, _ in asks[:2]]
    assert len(got[2]) == 40
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("staticrt_")}
    assert counts["staticrt_draft_tokens_total"] > 0
    assert continued == reference.generate([next_turn], 40)[0]
    assert counts["staticrt_prefix_hits_total"] >= 1 and counts["staticrt_prefix_reused_tokens_total"] > len(asks[0][0])
