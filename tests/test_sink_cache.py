"""The attention-sink cache against a plain-Python StreamingLLM: which positions each slot holds,
at which index of the cache RoPE places them, attention outputs against keys re-rotated at those
indices, transformers' tokens before any eviction, and long generation without recompiles."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES
from hf_models import hf_greedy

import staticrt
from staticrt.caches import CacheSpec, SinkCache
from staticrt.errors import ArtifactError, CacheError
from staticrt.rope import RopeStep, apply_rope, rope_tables

SLOTS = 12  # 4 sinks + 8 rotating slots: small enough that every test crosses the window many times


def streaming_llm(seen: int, slots: int = SLOTS, sinks: int = 4) -> list[int]:
    """StreamingLLM's cache after `seen` tokens, fed one at a time: the sinks, then the newest
    positions that fit, in order. A position's index in this list is where RoPE puts it."""
    recent = range(max(sinks, seen - (slots - sinks)), seen)
    return [p for p in range(min(sinks, seen))] + list(recent)


def sink_cache(batch: int = 2) -> SinkCache:
    model = staticrt.load_model("tiny-llama", dtype=torch.float32)
    return SinkCache(model.config, CacheSpec("sink", batch, SLOTS), torch.float32)


# Steps of (write_index, tokens a row, real tokens) for two rows: prompts longer than the whole
# cache, right padding, decode steps, chunks that cross the window.
STEPS = [((0, 0), 20, (20, 3)), ((20, 3), 1, (1, 1)), ((21, 4), 5, (5, 2)), ((26, 6), 1, (1, 1))] + [
    ((27 + i, 7 + i), 1, (1, 1)) for i in range(15)
]


def test_slots_hold_what_streaming_llm_keeps_and_rope_sees_its_cache_indices():
    cache = sink_cache()
    for write_index, width, real in STEPS:
        index, num_new = torch.tensor(write_index), torch.tensor(real)
        positions = index[:, None] + torch.arange(width)  # [B, T]
        mask = cache.mask("full_attention", True, positions)[:, 0]  # [B, T, L (+ T)]
        keys = cache.key_positions(True, positions)
        # The value written for position p is p + 1 (0 is an empty slot).
        new = (positions + 1).float()[:, None, :, None].expand(2, cache.config.num_kv_heads, width, 16)
        cache.update(new, new, 0, index, num_new)
        for row in range(2):
            for t in range(real[row]):
                q = write_index[row] + t
                held = streaming_llm(q + 1)
                assert sorted(keys[row, t][mask[row, t]].tolist()) == held  # what the query attends to
                shift = int(cache.evicted(positions)[row, t])
                # RoPE distance from the query to each key: StreamingLLM's, by cache index.
                ours = {p: q - shift - p if p < 4 else q - p for p in held}
                assert ours == {p: held.index(q) - held.index(p) for p in held}
            after = streaming_llm(write_index[row] + real[row])
            stored = cache.layer_buffers(0)[0][row, 0, :, 0].long() - 1
            assert sorted(p for p in stored.tolist() if p >= 0) == after
            assert all(s == p if p < 4 else s == 4 + (p - 4) % 8 for s, p in enumerate(stored.tolist()) if p >= 0)


def reference_attention(attn, xs: torch.Tensor, q: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """StreamingLLM's attention output for the query at position q, from pre-RoPE keys rotated at
    their index in the cache, in plain torch: `[C]`."""
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qs, ks, vs = attn.qkv_proj(xs[: q + 1])
    held = streaming_llm(q + 1)
    at = lambda where: rope_tables(torch.tensor([where]), inv_freq, torch.float32)  # noqa: E731
    keys = apply_rope(ks[held].view(1, len(held), kv_heads, dim).transpose(1, 2), *at(list(range(len(held)))))
    query = apply_rope(qs[q].view(1, 1, heads, dim).transpose(1, 2), *at([held.index(q)]))
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = vs[held].view(len(held), kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    probs = torch.softmax((query @ keys.transpose(-1, -2))[0, :, 0] * attn.scale, dim=-1)  # [H, K]
    return attn.o_proj((probs[:, None, :] @ values)[:, 0].reshape(-1))


@pytest.mark.parametrize("prompt", [1, 20])
def test_attention_equals_streaming_llm_with_keys_rotated_at_their_cache_index(prompt):
    """A prompt longer than the cache (read first, one chunk), then decode far past the window."""
    model = staticrt.load_model("tiny-llama", dtype=torch.float32)
    attn, cache = model.layers[0].self_attn, sink_cache(batch=1)
    xs = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        steps = [(0, prompt)] + [(p, 1) for p in range(prompt, 40)]
        for start, width in steps:
            meta = cache.begin_step(torch.tensor([start]), torch.tensor([width]), width)
            rope = RopeStep(*rope_tables(meta.positions, model.inv_freq, torch.float32), None)
            out = attn(xs[start : start + width], rope, cache.view(0, meta, xs))  # [T, C]
            for t in range(width):
                expected = reference_attention(attn, xs, start + t, model.inv_freq)
                torch.testing.assert_close(out[t], expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_before_any_eviction_it_is_a_static_cache_with_transformers_tokens(hf_checkpoints, family):
    folder, hf = hf_checkpoints[family]
    prompts = [[5, 17, 99, 3, 200, 45, 8], [1, 2]]
    expected = [hf_greedy(hf, p, 40) for p in prompts]
    gen = staticrt.Generator(staticrt.load_model(folder), cache="sink", max_batch_size=2, max_cache_len=64)
    assert gen.generate(prompts, 40) == expected


def test_compiled_runs_ten_thousand_tokens_past_the_window_without_recompiling():
    model = staticrt.load_model("tiny-llama")
    options = dict(cache="sink", max_batch_size=2, max_cache_len=32, prefill_buckets=[16])
    prompts = [[5, 17, 99, 3, 200, 45, 8], [1, 2]]
    eager = staticrt.Generator(model, **options).generate(prompts, 300)
    gen = staticrt.Generator(model, backend="compiled", **options)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert gen.generate(prompts, 300) == eager
        tokens = gen.generate(prompts, 10_040)
    assert [len(t) for t in tokens] == [10_040, 10_040] and tokens[0][:300] == eager[0]
    assert len(set(tokens[0][-1000:])) > 5  # still text-like at the end, not one repeated token
    assert set(gen.backend._graphs) == {(16, "pick", True), (1, "pick", False)}


def test_bad_sink_caches_are_refused(tmp_path):
    model = staticrt.load_model("tiny-llama")
    with pytest.raises(CacheError, match=r"^window=8 has no meaning for a sink cache, whose layers hold max_cache_len"):
        staticrt.Generator(model, cache="sink", max_cache_len=32, window=8)
    with pytest.raises(CacheError, match=r"^max_cache_len is 4; a sink cache keeps 4 sink positions"):
        staticrt.Generator(model, cache="sink", max_cache_len=4)
    from staticrt.cli.main import main
    from staticrt.exporters import export_artifact

    with pytest.raises(ArtifactError) as raised:
        export_artifact(model, CacheSpec("sink", 1, 32), [16], tmp_path / "artifact")
    assert str(raised.value) == (
        "cache 'sink' cannot be exported (the exporters do not write its sink scores yet); choose one of "
        "static, sliding, hybrid, auto, static-int8, sliding-int8, hybrid-int8"
    )
    assert not (tmp_path / "artifact").exists()
    assert main(["run", "--model", "tiny-llama", "--cache", "sink", "--max-cache-len", "8", "--prompt-ids", "1"]) == 0
