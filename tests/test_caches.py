"""Caches element by element (one head, head_dim 1, values = the positions they hold): where
writes land, which positions a query sees, what stays in place."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import staticrt
from staticrt.caches import CacheSpec, HybridCache, SlidingWindowCache, StaticCache, build_cache, masks
from staticrt.config import ModelConfig
from staticrt.errors import CacheError

SLIDING, FULL = "sliding_attention", "full_attention"


def one_head_config(**kw) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=8,
        hidden_size=1,
        intermediate_size=1,
        num_layers=2,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        **kw,
    )


def write(cache, layer: int, start: list[int], steps: int, num_new: list[int] | None = None) -> None:
    """One step of `steps` entries per row at `start`, as the model runs it: lengths, then the
    write. Values are the positions written (padding included), keys positive, values negative."""
    write_index = torch.tensor(start)
    num_new = torch.tensor(num_new if num_new is not None else [steps] * len(start))
    pos = (write_index[:, None] + torch.arange(steps))[:, None, :, None].float()  # [B, 1, T, 1]
    cache.begin_step(write_index, num_new, steps)
    cache.update(pos, -pos, layer, write_index, num_new)


def held(cache, layer: int) -> list[list[int]]:
    return cache.layer_buffers(layer)[0][:, 0, :, 0].int().tolist()


def seen(cache, layer: int, positions: list[int], query: int) -> list[int]:
    """The positions that the query at `positions[query]` (row 0) may attend to in a step over
    `positions`, read off the mask."""
    pos = torch.tensor([positions])
    rotating = cache.rotating[layer]
    mask = cache.mask(cache.config.layer_types[layer], rotating, pos)[0, 0, query]  # [L] or [L + T]
    keys = cache.key_positions(rotating, pos)
    return sorted(keys[0, query][mask].tolist())


def sliding_cache(window: int = 4, batch: int = 1) -> SlidingWindowCache:
    config = one_head_config(sliding_window=window, layer_types=(SLIDING, SLIDING))
    return SlidingWindowCache(config, CacheSpec("sliding", batch, 8), torch.float32)


def test_rotating_buffer_holds_the_last_window_positions_decoded_one_by_one():
    cache = sliding_cache()
    write(cache, 0, [0], 4)
    write(cache, 0, [4], 1)
    assert seen(cache, 0, [5], 0) == [2, 3, 4, 5]  # the step for position 5 sees exactly 2..5
    write(cache, 0, [5], 1)
    assert held(cache, 0) == [[4, 5, 2, 3]]
    assert cache.layer_buffers(0)[1][0, 0, :, 0].tolist() == [-4, -5, -2, -3]
    assert masks.held_positions(torch.tensor([6]), 4, rotating=True).tolist() == [[4, 5, 2, 3]]
    assert cache.get_seq_length().tolist() == [6]
    assert cache.get_max_cache_shape(0) == 4


def test_chunk_longer_than_the_window_attends_before_it_overwrites():
    cache = sliding_cache()
    positions = list(range(6))
    assert seen(cache, 0, positions, 0) == [0]  # nothing held yet: empty slots stay hidden
    assert seen(cache, 0, positions, 1) == [0, 1]
    assert seen(cache, 0, positions, 5) == [2, 3, 4, 5]
    write(cache, 0, [0], 6)
    assert held(cache, 0) == [[4, 5, 2, 3]]
    # the next chunk sees held positions 3..5 and its own first entry, not the overwritten 0..2
    assert seen(cache, 0, [6, 7], 0) == [3, 4, 5, 6]


def test_rows_at_different_positions_keep_padding_out_of_the_buffer():
    cache = sliding_cache(batch=2)
    write(cache, 0, [0, 0], 3, num_new=[1, 3])  # row 1 holds 0..2; row 0 just position 0
    # One 6-wide step: row 0 adds 1..6 (past the window), row 1 adds 3..4 and four padded entries.
    write(cache, 0, [1, 3], 6, num_new=[6, 2])
    assert held(cache, 0) == [[4, 5, 6, 3], [4, 1, 2, 3]]
    assert cache.get_seq_length().tolist() == [7, 5]
    assert masks.held_positions(torch.tensor([7, 5]), 4, rotating=True).tolist() == [[4, 5, 6, 3], [4, 1, 2, 3]]


def test_decode_writes_one_slot_in_place_and_reset_keeps_addresses():
    cache = sliding_cache()
    write(cache, 0, [0], 4)
    before = [b.clone() for b in cache.state_buffers()]
    addresses = [b.data_ptr() for b in cache.state_buffers()]
    write(cache, 0, [4], 1)
    key = cache.layer_buffers(0)[0]
    changed = (key != before[0]).nonzero()[:, 2].tolist()
    assert changed == [0]  # slot 4 mod 4 and nothing else
    assert all(getattr(b, "_dynamo_static_input_type", None) == "unguarded" for b in cache.state_buffers())
    cache.reset()
    assert [b.data_ptr() for b in cache.state_buffers()] == addresses
    assert all(b.abs().sum() == 0 for b in cache.state_buffers())


def test_static_rows_write_at_their_own_index_in_place():
    cache = StaticCache(one_head_config(), CacheSpec("static", 2, 6), torch.float32)
    address = cache.layer_buffers(0)[0].data_ptr()
    write(cache, 0, [0, 2], 3)
    assert held(cache, 0) == [[0, 1, 2, 0, 0, 0], [0, 0, 2, 3, 4, 0]]
    assert cache.layer_buffers(0)[1][:, 0, :, 0].tolist() == [[0, -1, -2, 0, 0, 0], [0, 0, -2, -3, -4, 0]]
    assert cache.layer_buffers(0)[0].data_ptr() == address
    assert cache.layer_buffers(1)[0].abs().sum() == 0  # other layers untouched
    assert cache.get_seq_length().tolist() == [3, 5]
    assert cache.get_max_cache_shape() == 6


def test_static_mask_is_causal_and_windowed_for_sliding_layers():
    cache = StaticCache(
        one_head_config(sliding_window=2, layer_types=(SLIDING, FULL)), CacheSpec("static", 1, 6), torch.float32
    )
    write(cache, 0, [0], 2)
    assert [seen(cache, 1, [2, 3, 4], q) for q in range(3)] == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert [seen(cache, 0, [2, 3, 4], q) for q in range(3)] == [[1, 2], [2, 3], [3, 4]]
    assert cache.mask(FULL, False, torch.tensor([[2, 3, 4]])).shape == (1, 1, 3, 6)


def test_static_cache_of_four_refuses_position_four():
    cache = StaticCache(one_head_config(), CacheSpec("static", 1, 4), torch.float32)
    cache.check_step([3], 1)
    with pytest.raises(
        CacheError,
        match=re.escape(
            "row 0 writes positions 4..4, but this static cache holds positions 0..3 (max_cache_len=4); "
            "build it with a larger max_cache_len"
        ),
    ):
        cache.check_step([4], 1)


def test_backend_refuses_a_step_past_the_static_cache_before_running_it():
    gen = staticrt.Generator(staticrt.load_model("tiny-llama"), max_batch_size=1, max_cache_len=4)
    gen.generate([[1, 2]], max_new_tokens=2)
    before = [b.clone() for b in gen.backend.cache.state_buffers()]
    with pytest.raises(CacheError, match=re.escape("row 0 writes positions 4..4, but this static cache")):
        gen.backend.step(np.array([[1]]), np.array([4]), np.array([1]), staticrt.SamplingParams(), None)
    assert all(torch.equal(a, b) for a, b in zip(before, gen.backend.cache.state_buffers()))


def test_hybrid_window_two_rotates_sliding_layers_and_keeps_every_position_in_global_ones():
    cache = HybridCache(
        one_head_config(sliding_window=2, layer_types=(SLIDING, FULL)), CacheSpec("hybrid", 1, 6), torch.float32
    )
    assert [cache.layer_layout(i) for i in range(2)] == ["sliding", "static"]
    assert [tuple(cache.layer_buffers(i)[0].shape) for i in range(2)] == [(1, 1, 2, 1), (1, 1, 6, 1)]
    write(cache, 0, [0], 3)
    write(cache, 1, [0], 3)
    for pos in (3, 4):
        write(cache, 0, [pos], 1)
        write(cache, 1, [pos], 1)
    assert held(cache, 0) == [[4, 3]]
    assert held(cache, 1) == [[0, 1, 2, 3, 4, 0]]
    assert seen(cache, 0, [5], 0) == [4, 5]
    assert seen(cache, 1, [5], 0) == [0, 1, 2, 3, 4, 5]
    assert cache.max_sequence_len == 6 and sliding_cache().max_sequence_len is None


def test_reorder_cache_permutes_rows():
    cache = StaticCache(one_head_config(), CacheSpec("static", 3, 2), torch.float32)
    kv = torch.tensor([10.0, 20.0, 30.0])[:, None, None, None].expand(3, 1, 2, 1)
    num_new = torch.tensor([1, 2, 2])
    cache.begin_step(torch.tensor([0, 0, 0]), num_new, 2)
    cache.update(kv, kv, 1, torch.tensor([0, 0, 0]), num_new)
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.layer_buffers(1)[0][:, 0, 0, 0].tolist() == [30.0, 30.0, 10.0]
    assert cache.get_seq_length().tolist() == [2, 2, 1]


@pytest.mark.parametrize(
    ("preset", "max_cache_len", "kind"),
    [
        ("tiny-llama", 128, "static"),
        ("tiny-mistral", 128, "sliding"),
        ("tiny-gemma2", 128, "hybrid"),
        ("tiny-gemma2", 32, "static"),
    ],  # a window of 64 is no saving on 32 positions
)
def test_auto_takes_what_the_config_implies(preset, max_cache_len, kind):
    config = staticrt.load_model(preset).config
    assert build_cache(config, CacheSpec("auto", 1, max_cache_len), torch.float32, "meta").kind == kind


def test_qwen2_max_window_layers_decides_which_layers_rotate():
    from staticrt.loading.hf_config import config_from_hf

    hf = {
        "model_type": "qwen2",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "use_sliding_window": True,
        "sliding_window": 4,
        "max_window_layers": 2,
    }
    cache = build_cache(config_from_hf(hf), CacheSpec("auto", 1, 16), torch.float32, "meta")
    assert cache.kind == "hybrid"
    assert [cache.layer_layout(i) for i in range(4)] == ["static", "static", "sliding", "sliding"]
    assert cache.layer_lengths == (16, 16, 4, 4)


@pytest.mark.parametrize(
    ("preset", "kwargs", "message"),
    [
        (
            "tiny-mistral",
            {"cache": "sliding", "max_cache_len": 32},
            "window is 64, larger than max_cache_len 32; a rotating buffer would hold more than the whole sequence; "
            "use cache='static' (it covers the window) or raise max_cache_len to at least 64",
        ),
        (
            "tiny-mistral",
            {"cache": "sliding", "window": 0},
            "window is 0; a sliding cache needs at least 1 slot a layer",
        ),
        (
            "tiny-mistral",
            {"cache": "sliding", "window": 32},
            "window is 32, smaller than the model's sliding_window 64; the cache would drop positions the model "
            "attends to; use window >= 64 or leave it unset",
        ),
        (
            "tiny-gemma2",
            {"cache": "sliding"},
            "cache 'sliding' keeps only the last 64 positions, but layers [1] of this gemma2 model attend to every "
            "position; use cache='hybrid' (or 'auto')",
        ),
        (
            "tiny-llama",
            {"cache": "hybrid"},
            "cache 'hybrid' gives sliding-window layers a rotating buffer, but no layer of this llama model attends "
            "through a sliding window; use cache='static'",
        ),
        (
            "tiny-llama",
            {"cache": "sliding"},
            "cache 'sliding' gives sliding-window layers a rotating buffer, but no layer of this llama model "
            "attends through a sliding window; use cache='static'",
        ),
        (
            "tiny-llama",
            {"cache": "static", "window": 8},
            "window=8 has no effect on a static cache, whose layers all hold max_cache_len positions; drop the "
            "window or use cache='sliding' or 'hybrid'",
        ),
    ],
)
def test_cache_requests_the_model_cannot_use(preset, kwargs, message):
    model = staticrt.load_model(preset)
    with pytest.raises(CacheError, match=re.escape(message)):
        staticrt.Generator(model, **{"max_cache_len": 128, **kwargs})
