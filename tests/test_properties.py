"""Property-based tests (hypothesis) for what matters most: the cache's semantics, slot by slot,
against a plain-Python model, and request validation against arbitrary Python values.

The default profile ("ci", conftest.py) is derandomised and small (seconds); set
STATICRT_HYPOTHESIS=long for a search of thousands of examples.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import staticrt
from staticrt.caches import CacheSpec, build_cache
from staticrt.cli.main import main
from staticrt.config import ModelConfig
from staticrt.errors import StaticrtError

SLIDING, FULL = "sliding_attention", "full_attention"
LAYERS = {"static": (SLIDING, FULL), "sliding": (SLIDING, SLIDING), "hybrid": (SLIDING, FULL)}
MAX_CACHE_LEN = 12


class ListModel:
    """What a cache must hold, as plain lists: per row and layer, the position each slot holds
    (None: never written by a real token). A linear layer keeps position p in slot p, a rotating
    one of `slots` slots in slot p mod slots; padding is never a real token."""

    def __init__(self, batch: int, lengths: tuple[int, ...], rotating: tuple[bool, ...]) -> None:
        self.rotating, self.lengths = rotating, lengths
        self.slots = [[[None] * n for n in lengths] for _ in range(batch)]

    def write(self, row: int, positions: range) -> None:
        for layer, n in enumerate(self.lengths):
            for p in positions:
                self.slots[row][layer][p % n if self.rotating[layer] else p] = p


def visible_positions(position: int, attention: str, window: int) -> list[int]:
    """What a query at `position` must see: every earlier position, or the last `window` of them."""
    first = position - window + 1 if attention == SLIDING else 0
    return list(range(max(first, 0), position + 1))


@given(
    data=st.data(),
    kind=st.sampled_from(sorted(LAYERS)),
    batch=st.integers(1, 3),
    window=st.integers(1, 5),
)
def test_every_query_sees_exactly_its_positions_and_every_slot_holds_its_position(data, kind, batch, window):
    config = ModelConfig("llama", 8, 1, 1, 2, 1, 1, 1, sliding_window=window, layer_types=LAYERS[kind])
    cache = build_cache(config, CacheSpec(kind, batch, MAX_CACHE_LEN), torch.float32)
    model = ListModel(batch, cache.layer_lengths, cache.rotating)
    lengths = [0] * batch
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        seq_len = data.draw(st.sampled_from([1, 1, 2, 3, 5, 7]), label="T")
        if cache.max_sequence_len is not None and max(lengths) + seq_len > cache.max_sequence_len:
            break
        num_new = [data.draw(st.integers(1, seq_len), label="num_new") for _ in range(batch)]
        write_index = torch.tensor(lengths)
        positions = write_index[:, None] + torch.arange(seq_len)  # [B, T]
        cache.begin_step(write_index, torch.tensor(num_new), seq_len)
        entries = positions[:, None, :, None].float()  # [B, 1, T, 1]: each entry holds its position
        for layer, attention in enumerate(config.layer_types):
            rotating = cache.rotating[layer]
            mask = cache.mask(attention, rotating, positions)[:, 0]  # [B, T, K]
            keys = cache.key_positions(rotating, positions)  # [B, T, K]
            before = cache.layer_buffers(layer)[0].clone()
            cache.update(entries, -entries, layer, write_index, torch.tensor(num_new))
            after = cache.layer_buffers(layer)[0]
            read = after if cache.writes_first(rotating, seq_len) else torch.cat([before, entries], dim=2)
            for r in range(batch):
                for q in range(num_new[r]):
                    seen = keys[r, q][mask[r, q]].tolist()
                    assert sorted(seen) == visible_positions(lengths[r] + q, attention, window), (layer, r, q)
                    # what is read at each visible key is what was written for its position
                    assert read[r, 0, mask[r, q], 0].tolist() == [float(p) for p in seen], (layer, r, q)
        for r in range(batch):
            model.write(r, range(lengths[r], lengths[r] + num_new[r]))
            lengths[r] += num_new[r]
        assert cache.get_seq_length().tolist() == lengths
    for layer in range(len(config.layer_types)):
        held = cache.layer_buffers(layer)[0][:, 0, :, 0].tolist()
        for r in range(batch):
            expected = model.slots[r][layer]
            assert [h for h, e in zip(held[r], expected) if e is not None] == [e for e in expected if e is not None]


# Request validation: any Python value for any argument either runs (the tokens of a fresh
# Generator) or raises StaticrtError, and a refusal leaves the cache as it was.

ODD = st.sampled_from([None, True, False, 0, -1, 1, 2, 2.5, float("nan"), "3", b"1", 2**63, np.int64(3), [], ()])


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` five times in six, else an odd value: most examples run, each argument is often odd."""
    return st.integers(0, 5).flatmap(lambda n: ODD if n == 0 else valid)


TOKEN = mostly(st.integers(0, 511))
PROMPT = mostly(st.one_of(st.lists(TOKEN, min_size=1, max_size=6), st.just(np.array([1, 2, 3]))))
ARGUMENTS = {
    "prompts": mostly(st.lists(PROMPT, min_size=1, max_size=2)),
    "max_new_tokens": mostly(st.integers(1, 6)),
    "do_sample": mostly(st.booleans()),
    "temperature": mostly(st.floats(0.1, 3)),
    "top_k": mostly(st.integers(0, 600)),
    "top_p": mostly(st.floats(0.05, 1)),
    "seed": mostly(st.integers(0, 2**64)),
    "stop_token_ids": mostly(st.lists(TOKEN, max_size=3)),
    "stream": mostly(st.just(lambda row, token: None)),
}


@pytest.fixture(scope="module")
def tiny():
    return staticrt.load_model("tiny-llama")


@given(arguments=st.fixed_dictionaries({}, optional=ARGUMENTS))
def test_any_generate_arguments_run_as_a_fresh_generator_or_are_refused_untouched(tiny, arguments):
    shared = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64)
    shared.generate([[4, 5, 6], [7]], max_new_tokens=3)
    before = [b.clone() for b in shared.backend.cache.state_buffers()]
    kwargs = dict(arguments)
    prompts = kwargs.pop("prompts", [[1, 2, 3]])
    try:
        tokens = shared.generate(prompts, **kwargs)
    except StaticrtError:
        event("refused")
        assert all(torch.equal(a, b) for a, b in zip(before, shared.backend.cache.state_buffers()))
        return
    event("ran")
    if kwargs.get("do_sample") and kwargs.get("seed") is None:
        return  # unseeded sampling has no one answer
    fresh = staticrt.Generator(tiny, max_batch_size=2, max_cache_len=64)
    assert tokens == fresh.generate(prompts, **kwargs)


FLAG_VALUES = st.sampled_from(["1", "2", "0", "-1", "3.5", "abc", "", "1,2", "1 2", "1e3", "nan", "９", "2,,3"])
FLAGS = ["--prompt-ids", "--max-new-tokens", "--top-k", "--top-p", "--temperature", "--seed", "--stop-ids", "--cache"]


# capsys is read after every call, so each example sees only its own output.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=st.dictionaries(st.sampled_from(FLAGS), FLAG_VALUES), sample=st.booleans())
def test_any_run_flags_run_as_the_python_api_or_exit_2(flags, sample, capsys):
    argv = ["run", "--model", "tiny-llama", "--json", *(f"{k}={v}" for k, v in flags.items())]
    argv += ["--do-sample"] if sample else []
    if "--prompt-ids" not in flags:
        argv.append("--prompt-ids=1,2,3")
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code
    out = capsys.readouterr()
    event(f"exit {code}")
    assert code in (0, 2), out.err
    assert "Traceback" not in out.err
    if code == 0 and (not sample or "--seed" in flags):  # unseeded sampling has no one answer
        ran = json.loads(out.out)
        prompt = [int(t) for t in flags.get("--prompt-ids", "1,2,3").split(",")]
        stops = [int(t) for t in flags["--stop-ids"].split(",")] if "--stop-ids" in flags else None
        new_tokens = int(flags.get("--max-new-tokens", 32))
        gen = staticrt.Generator(staticrt.load_model("tiny-llama"), max_cache_len=len(prompt) + new_tokens)
        expected = gen.generate(
            [prompt],
            max_new_tokens=new_tokens,
            do_sample=sample,
            temperature=float(flags.get("--temperature", 1.0)),
            top_k=int(flags.get("--top-k", 0)),
            top_p=float(flags.get("--top-p", 1.0)),
            seed=int(flags["--seed"]) if "--seed" in flags else None,
            stop_token_ids=stops,
        )
        assert ran["tokens"] == expected
