"""OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty` (issue 66), added to each row's
logits inside the step graph (generation/logit_bias.py): greedy tokens equal transformers' with
its own `sequence_bias` (SequenceBiasLogitsProcessor) for the bias, and with vLLM's definition of
the penalties (written below as a transformers LogitsProcessor, vLLM's `apply_penalties`) on the
eager and compiled graphs and on an artifact's host choice; through the official `openai` client
the server's tokens are `generate`'s; every bad value is refused by name before anything runs."""

from __future__ import annotations

import httpx
import pytest
import torch
from hf_models import hf_greedy

import staticrt
from staticrt.caches import CacheSpec
from staticrt.errors import GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 30)), [1, 2, 3]]
NEW = 16
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=1.5)


class VllmPenalties:
    """vLLM's presence and frequency penalties over the tokens generated after `prompt_len`:
    logits[t] -= frequency * count(t) + presence * (count(t) > 0)."""

    def __init__(self, prompt_len: int, presence_penalty: float, frequency_penalty: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence_penalty, frequency_penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def banned(family_tokens: list[list[int]]) -> dict[int, float]:
    """A bias that bans the first two tokens each row chose unbiased, and lifts one other token."""
    return {t: -100.0 for row in family_tokens for t in row[:2]} | {7: 4.0}


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """family -> (logit_bias, transformers' tokens with it, transformers' tokens with PENALTIES)."""
    from transformers import LogitsProcessorList

    made = {}

    def get(family: str):
        if family not in made:
            hf = hf_checkpoints[family][1]
            bias = banned([hf_greedy(hf, p, NEW) for p in PROMPTS])
            sequence_bias = {(t,): b for t, b in bias.items()}
            biased = [hf_greedy(hf, p, NEW, sequence_bias=sequence_bias) for p in PROMPTS]
            processors = [LogitsProcessorList([VllmPenalties(len(p), **PENALTIES)]) for p in PROMPTS]
            penalized = [hf_greedy(hf, p, NEW, logits_processor=lp) for p, lp in zip(PROMPTS, processors, strict=True)]
            made[family] = bias, biased, penalized
        return made[family]

    return get


@pytest.mark.parametrize("backend", ["eager", "compiled", "cudagraph-host"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bias_and_penalties_give_transformers_tokens_in_the_step_graph(generators, references, family, backend):
    """The bias is an input of every step graph, zeros without one; in captured graphs too
    (cudagraph's host side replayed on the CPU), where Llama's linear cache runs greedy decode a
    step ahead unless a step is biased (its next bias follows the token it chooses)."""
    bias, biased, penalized = references(family)
    gen = generators(family, backend)
    plain = gen.generate(PROMPTS, NEW)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the graphs without a bias serve it
        assert gen.generate(PROMPTS, NEW, logit_bias=bias) == biased != plain
        assert gen.generate(PROMPTS, NEW, **PENALTIES) == penalized != plain
    assert gen.generate(PROMPTS, NEW) == plain  # nothing stays behind in the next generation


def test_an_artifacts_host_choice_adds_the_same_bias(hf_checkpoints, references, tmp_path):
    """The torch.export program ends at the logits and chooses on the host (host_sampling.py), as
    ONNX Runtime's runner does: the same rows' biases, the same tokens."""
    bias, biased, penalized = references("llama")
    model = staticrt.load_model(hf_checkpoints["llama"][0])
    folder = export_artifact(model, CacheSpec("static", 3, 128), [32], tmp_path / "pt2", ["pt2"])
    gen = load_artifact(folder, "pt2")
    assert gen.generate(PROMPTS, NEW, logit_bias=bias) == biased
    assert gen.generate(PROMPTS, NEW, **PENALTIES) == penalized


def test_bad_values_are_refused_by_name_before_anything_runs(generators):
    gen = generators("llama", "eager")
    vocab = gen.backend.vocab_size
    cases = [
        (dict(logit_bias={vocab: 1.0}), f"logit_bias names token id {vocab}, outside the vocabulary of {vocab} tokens"),
        (dict(logit_bias={5: 150}), "logit_bias[5] is 150.0; it must be in [-100, 100]"),
        (dict(logit_bias={"5": 1.0}), "logit_bias token id is '5' (str); it must be an int"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias is a list; pass a dict of token id -> bias"),
        (dict(presence_penalty=2.5), "presence_penalty is 2.5; it must be in [-2, 2]"),
        (
            dict(frequency_penalty=1.0, speculative="ngram"),
            "a grammar and presence_penalty and frequency_penalty change with",
        ),
        (dict(logit_bias={5: 1.0}, num_beams=2), "beam search takes no logit_bias, penalties or grammar yet"),
    ]
    held = [list(row) for row in gen.held]
    for options, message in cases:
        with pytest.raises(GenerationError) as err:
            gen.generate(PROMPTS, NEW, **options)
        assert str(err.value).startswith(message), options
    assert gen.held == held


def test_the_server_gives_generates_tokens_and_names_a_bad_field(hf_checkpoints, references):
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    openai = pytest.importorskip("openai", reason="the serving tests use the openai client: install the test extra")
    from serving import client, running

    from staticrt.serve import serve_backend

    bias, biased, penalized = references("llama")
    model = staticrt.load_model(hf_checkpoints["llama"][0])
    app, _ = serve_backend(staticrt.Generator(model, max_batch_size=4, max_cache_len=128).backend, name="tiny")
    wire = {str(t): b for t, b in bias.items()}  # JSON's keys are strings
    with running(app) as url:
        api = client(url)
        ask = dict(model="tiny", max_tokens=NEW, temperature=0)
        got = [
            api.completions.create(prompt=p, logit_bias=wire, **ask).choices[0].model_extra["token_ids"]
            for p in PROMPTS
        ]
        assert got == biased
        streams = [api.completions.create(prompt=p, stream=True, **PENALTIES, **ask) for p in PROMPTS]
        assert [[t for c in s for t in c.choices[0].model_extra["token_ids"]] for s in streams] == penalized
        for body, param, message in [
            (dict(logit_bias={"99999": 1}), "logit_bias", "logit_bias names token id 99999, outside the vocabulary"),
            (dict(logit_bias={"x": 1}), "logit_bias", "logit_bias has the key 'x'; its keys are token ids"),
            (dict(frequency_penalty=-3), "frequency_penalty", "frequency_penalty is -3; it must be in [-2, 2]"),
            (dict(presence_penalty="1"), "presence_penalty", "presence_penalty is '1'; it must be a number"),
        ]:
            reply = httpx.post(f"{url}/v1/completions", json={**ask, "prompt": [1, 2], **body})
            assert (reply.status_code, reply.json()["error"]["param"]) == (400, param)
            assert reply.json()["error"]["message"].startswith(message)
        with pytest.raises(openai.BadRequestError):
            api.completions.create(prompt=[1, 2], logit_bias={"5": 101}, **ask)
