"""The Static cache, element by element: where writes land, what the mask exposes, in place."""

from __future__ import annotations

import torch

from staticrt.caches import CacheSpec, StaticCache
from staticrt.config import ModelConfig


def one_head_config(**kw) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=8, hidden_size=1, intermediate_size=1, num_layers=2,
                       num_heads=1, num_kv_heads=1, head_dim=1, **kw)


def positions_as_values(batch: int, start: list[int], steps: int) -> torch.Tensor:
    """K/V of shape [B, 1, T, 1] whose values are the positions they are written at."""
    pos = torch.tensor(start)[:, None] + torch.arange(steps)
    return pos[:, None, :, None].float()


def test_rows_write_at_their_own_index_in_place():
    cache = StaticCache(one_head_config(), CacheSpec("static", 2, 6), torch.float32)
    key_buf, value_buf = cache.layer_buffers(0)
    address = key_buf.data_ptr()
    write_index = torch.tensor([0, 2])
    kv = positions_as_values(2, [0, 2], 3)
    cache.begin_step(write_index, torch.tensor([3, 3]))
    keys, values = cache.update(kv, -kv, 0, write_index)
    assert keys is key_buf and keys.data_ptr() == address
    assert keys[:, 0, :, 0].tolist() == [[0, 1, 2, 0, 0, 0], [0, 0, 2, 3, 4, 0]]
    assert values[:, 0, :, 0].tolist() == [[0, -1, -2, 0, 0, 0], [0, 0, -2, -3, -4, 0]]
    assert cache.layer_buffers(1)[0].abs().sum() == 0  # other layers untouched
    assert cache.get_seq_length().tolist() == [3, 5]
    assert cache.get_max_cache_shape() == 6


def test_mask_is_causal_over_slots_and_windowed_for_sliding_layers():
    cache = StaticCache(one_head_config(sliding_window=2, layer_types=("sliding_attention", "full_attention")),
                        CacheSpec("static", 1, 4), torch.float32)
    positions = torch.tensor([[1, 2, 3]])
    full = cache.attention_mask("full_attention", positions)
    assert full.shape == (1, 1, 3, 4)
    assert full[0, 0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    sliding = cache.attention_mask("sliding_attention", positions)
    assert sliding[0, 0].int().tolist() == [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_buffers_are_static_addresses_and_reset_keeps_them():
    cache = StaticCache(one_head_config(), CacheSpec("static", 1, 4), torch.float32)
    buffers = cache.state_buffers()
    assert all(getattr(b, "_dynamo_static_input_type", None) == "unguarded" for b in buffers)
    addresses = [b.data_ptr() for b in buffers]
    cache.update(torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1), 0, torch.tensor([1]))
    cache.reset()
    assert [b.data_ptr() for b in cache.state_buffers()] == addresses
    assert all(b.abs().sum() == 0 for b in cache.state_buffers())
    assert cache.slot_positions.tolist() == [0, 1, 2, 3]


def test_reorder_cache_permutes_rows():
    cache = StaticCache(one_head_config(), CacheSpec("static", 3, 2), torch.float32)
    kv = torch.tensor([10.0, 20.0, 30.0])[:, None, None, None].expand(3, 1, 2, 1)
    cache.begin_step(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 2]))
    cache.update(kv, kv, 1, torch.tensor([0, 0, 0]))
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.layer_buffers(1)[0][:, 0, 0, 0].tolist() == [30.0, 30.0, 10.0]
    assert cache.get_seq_length().tolist() == [2, 2, 1]
