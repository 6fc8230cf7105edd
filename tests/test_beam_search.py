"""Beam search in the rows of one fixed cache, against transformers' `generate(num_beams=N,
do_sample=False)` on the tiny checkpoints of every family and on the real SmolLM2 model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import FAMILIES
from hf_models import hf_greedy

import staticrt
from staticrt.errors import GenerationError

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], [1, 2]]
NEW_TOKENS = 16
# (num_beams, stop ids). Three stop ids make N=2 keep max(2, 1 + 3) * 2 = 8 candidates an item,
# as N=4 with one does: one pair of compiled graphs (prefill16_beam8, decode_beam8) serves both.
CASES = [(2, 3), (4, 1)]


def stop_ids(gen: staticrt.Generator, count: int) -> list[int]:
    """`count` distinct tokens the model's greedy run emits early, so that beams do stop on them."""
    greedy = gen.generate([PROMPTS[0]], NEW_TOKENS)[0]
    return list(dict.fromkeys(greedy[3:]))[:count]


def hf_beams(hf, prompt: list[int], num_beams: int, stops: list[int], **options) -> list[int]:
    """transformers' best beam for one unpadded prompt, cut after its first stop token (the rest is fill)."""
    out = hf_greedy(hf, prompt, NEW_TOKENS, num_beams=num_beams, eos_token_id=stops, **options)
    end = next((i for i, t in enumerate(out) if t in stops), len(out) - 1)
    return out[: end + 1]


@pytest.fixture(scope="module")
def beam_generators(hf_checkpoints):
    """(family, backend) -> a Generator of 8 rows (2 prompts x 4 beams) on the family's checkpoint."""
    made: dict = {}

    def get(family: str, backend: str) -> staticrt.Generator:
        if (family, backend) not in made:
            model = staticrt.load_model(hf_checkpoints[family][0], dtype=torch.float32)
            made[family, backend] = staticrt.Generator(model, max_batch_size=8, max_cache_len=64, backend=backend)
        return made[family, backend]

    return get


def spy_on_reorders(gen: staticrt.Generator, monkeypatch) -> list[np.ndarray]:
    """The `rows` of every in-place reorder the generation asks the backend for."""
    seen, reorder = [], gen.backend.reorder_rows
    monkeypatch.setattr(gen.backend, "reorder_rows", lambda rows: (seen.append(rows.copy()), reorder(rows)))
    return seen


# Compiled: Llama (whose code path Mistral and Qwen2 share) and Gemma2 (softcapping, sandwich norms,
# sliding layers); the four families' greedy compiled graphs are checked in test_oracle.py.
# LFM2 and Granite 4.0-H: their conv inputs and Mamba2 states reorder with the rows, as K/V does (issue 65).
BEAM_CASES = [(f, "eager") for f in (*FAMILIES, "lfm2", "granitemoehybrid")]
BEAM_CASES += [("llama", "compiled"), ("gemma2", "compiled")]


@pytest.mark.parametrize(("family", "backend"), BEAM_CASES)
def test_beam_tokens_equal_transformers_and_the_cache_is_reordered_in_place(
    hf_checkpoints, beam_generators, family, backend, monkeypatch
):
    hf = hf_checkpoints[family][1]
    gen = beam_generators(family, backend)
    addresses = {name: b.data_ptr() for name, b in gen.backend.cache.named_buffers()}
    reorders = spy_on_reorders(gen, monkeypatch)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for num_beams, count in CASES:
            stops = stop_ids(gen, count)
            expected = [hf_beams(hf, p, num_beams, stops) for p in PROMPTS]
            assert gen.generate([PROMPTS[0]], NEW_TOKENS, num_beams=num_beams, stop_token_ids=stops) == expected[:1]
            assert gen.generate(PROMPTS, NEW_TOKENS, num_beams=num_beams, stop_token_ids=stops) == expected
    assert {name: b.data_ptr() for name, b in gen.backend.cache.named_buffers()} == addresses
    # Beams did swap rows (else the reorder would be untested), and only within their own prompt.
    assert any((rows[:8] != np.arange(8)).any() for rows in reorders)
    assert all((rows // 4 == np.arange(8) // 4).all() for rows in reorders if len(rows) == 8)
    if backend == "compiled":
        assert {key for key in gen.backend._graphs if key[1] != "pick"} == {(16, "beam8", True), (1, "beam8", False)}


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, True), (0.5, "never"), (2.0, "never"), (-1.0, False)]
)
def test_length_penalty_and_early_stopping_as_transformers_define_them(
    hf_checkpoints, beam_generators, length_penalty, early_stopping
):
    hf = hf_checkpoints["qwen2"][1]
    gen = beam_generators("qwen2", "eager")
    stops = stop_ids(gen, 1)
    options = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    expected = [hf_beams(hf, p, 4, stops, **options) for p in PROMPTS]
    assert gen.generate(PROMPTS, NEW_TOKENS, num_beams=4, stop_token_ids=stops, **options) == expected


def test_bad_beam_requests_are_refused_before_anything_runs(beam_generators):
    gen = beam_generators("llama", "eager")
    refusals = {
        "3 prompt(s) x num_beams=4 need 12 cache rows, beyond max_batch_size=8; build the Generator with a "
        "larger max_batch_size (at least 12) or pass fewer prompts": dict(prompts=[[1]] * 3, num_beams=4),
        "num_beams is 0; it must be an int >= 1": dict(num_beams=0),
        "num_beams=2 with do_sample=True (beam sampling) is not supported; pass do_sample=False for beam "
        "search, or num_beams=1 to sample": dict(num_beams=2, do_sample=True),
        "beam search cannot stream: which beam wins is known only at the end; pass stream=None, or "
        "num_beams=1 to stream tokens as they come": dict(num_beams=2, stream=print),
        "early_stopping is 'soon'; it must be True, False or 'never'": dict(num_beams=2, early_stopping="soon"),
    }
    for message, options in refusals.items():
        prompts = options.pop("prompts", PROMPTS[:1])
        with pytest.raises(GenerationError) as raised:
            gen.generate(prompts, 4, **options)
        assert str(raised.value) == message


# SmolLM2's special tokens: <|endoftext|>, <|im_start|>, <|im_end|> (its end of turn). Stopping on all
# three with N=2 keeps 8 candidates, as N=4 stopping on <|im_end|> alone (one pair of graphs, compiled).
REAL_CASES = [(2, [0, 1, 2]), (4, [2])]


def test_real_model_beams_equal_transformers(smollm2, hf_smollm2, chat_prompt):
    """Eager: a compile of the 30-layer model's beam graphs costs the suite over two minutes on 2
    cores (the compiled beams are checked on the tiny models above)."""
    model = staticrt.load_model(smollm2)
    gen = staticrt.Generator(model, max_batch_size=4, max_cache_len=96, prefill_buckets=[32])
    for num_beams, stops in REAL_CASES:
        expected = hf_beams(hf_smollm2[0], chat_prompt, num_beams, stops)
        assert gen.generate([chat_prompt], NEW_TOKENS, num_beams=num_beams, stop_token_ids=stops) == [expected]
        assert expected[-1] == 2 and model.tokenizer.decode(expected) == "The capital of France is Paris."


def test_run_prints_the_best_beam(capsys):
    from staticrt.cli.main import main

    argv = ["run", "--model", "tiny-llama", "--prompt-ids", "1,2,3", "--prompt-ids", "9", "--max-new-tokens", "8"]
    assert main([*argv, "--num-beams", "3", "--length-penalty", "0.5", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    gen = staticrt.Generator(staticrt.load_model("tiny-llama"), max_batch_size=6, max_cache_len=11)
    assert tokens == gen.generate([[1, 2, 3], [9]], 8, num_beams=3, length_penalty=0.5)
    assert tokens != gen.generate([[1, 2, 3], [9]], 8)  # the beams chose other tokens than greedy
