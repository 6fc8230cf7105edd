"""Sliding-window and hybrid caches against transformers, far past the window.

Mistral (every layer windowed, rotating buffers only, max_cache_len smaller than the sequence)
and Gemma2 (alternating sliding and global layers) with `sliding_window` 16, prompts of 40 tokens
(prefilled in one 64-wide bucket: a chunk four windows long) and 200 new tokens, at batch 1 and at
batch 3 with a prompt shorter than the window among longer ones. The compiled backend runs with
dynamo set to fail on any recompile while rows cross the window and run 15 windows past it.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_greedy

import staticrt

NEW_TOKENS = 200
WINDOW = 16
LENGTHS = (40, 5, 23)  # longer than the window, shorter, longer
CASES = {  # checkpoint -> (cache kind, max_cache_len)
    "mistral-sw16": ("sliding", 64),  # rotating buffers never run out: 240 positions in a 64 bucket cap
    "gemma2": ("hybrid", 256),  # global layers must hold all 240 positions
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """checkpoint -> transformers' eager greedy tokens for each prompt, one unpadded row at a time."""
    return {name: [hf_greedy(hf_checkpoints[name][1], p, NEW_TOKENS) for p in prompts()] for name in CASES}


def generator(hf_checkpoints, name: str, batch: int, backend: str) -> staticrt.Generator:
    model = staticrt.load_model(hf_checkpoints[name][0])
    assert model.config.sliding_window == WINDOW
    cache, max_cache_len = CASES[name]
    gen = staticrt.Generator(model, cache=cache, max_batch_size=batch, max_cache_len=max_cache_len, backend=backend)
    assert gen.backend.cache.kind == cache
    return gen


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_eager_matches_transformers_far_past_the_window(hf_checkpoints, references, name, batch):
    gen = generator(hf_checkpoints, name, batch, "eager")
    assert gen.generate(prompts()[:batch], max_new_tokens=NEW_TOKENS) == references[name][:batch]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_transformers_past_the_window_without_recompiling(hf_checkpoints, references, name, batch):
    gen = generator(hf_checkpoints, name, batch, "compiled")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = gen.generate(prompts()[:batch], max_new_tokens=NEW_TOKENS)
    assert set(gen.backend._graphs) == {(64, "pick", True), (1, "pick", False)}  # one prefill graph, one decode
    assert out == references[name][:batch]
    # the last decode step wrote position 238 of the 40-token row: 14 windows past the first
    assert gen.backend.cache.get_seq_length()[0].item() == LENGTHS[0] + NEW_TOKENS - 1
