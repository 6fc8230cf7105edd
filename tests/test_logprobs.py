"""OpenAI's `logprobs` / `top_logprobs` (issue 66): each chosen token's log-probability and its
row's 20 most likely, the log-softmax of the model's own logits (generation/logprobs.py), computed
in the step graph on eager, compiled and cudagraph's captured graphs (replayed on the CPU), and on
the host for an artifact. The reference is transformers' `generate(output_logits=True)`: its raw
logits at each step, `log_softmax`ed here, within 1e-4 (fp32)."""

from __future__ import annotations

import pytest
import torch

import staticrt
from staticrt.caches import CacheSpec
from staticrt.errors import GenerationError
from staticrt.exporters import export_artifact
from staticrt.generation.generator import load_artifact
from staticrt.generation.logprobs import TOP_LOGPROBS

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 30)), [1, 2, 3]]
NEW = 8
TOL = 1e-4


def hf_logprobs(hf, prompt: list[int], new_tokens: int, **options) -> tuple[list[int], torch.Tensor]:
    """transformers' tokens for `prompt` alone and the log-softmax of its raw logits at each `[N, V]`."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **({"do_sample": False} | options),
    )
    logits = torch.cat(out.logits).float()  # [N, V]: one step a row
    return out.sequences[0, len(prompt) :].tolist(), torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    made = {}

    def get(family: str, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            made[key] = [hf_logprobs(hf_checkpoints[family][1], p, NEW, **options) for p in PROMPTS]
        return made[key]

    return get


def assert_matches(entries, tokens, reference, top: int) -> None:
    """Each entry's token is transformers', its log-probability transformers' at that token, and its
    `top` most likely are transformers' `top` largest, by value and at their ids."""
    ref_tokens, ref = reference
    assert tokens == ref_tokens
    assert [e.token for e in entries] == tokens
    for step, entry in enumerate(entries):
        row = ref[step]
        assert abs(entry.logprob - row[entry.token].item()) < TOL, (step, entry.logprob, row[entry.token].item())
        assert len(entry.top) == top
        values = torch.tensor([v for _, v in entry.top])
        assert torch.allclose(values, row.topk(top).values, atol=TOL), step
        assert torch.allclose(row[[i for i, _ in entry.top]], values, atol=TOL), step  # each value is its id's


# gemma2 (soft-capped logits, a hybrid cache) compiles no graph of its own here: its logits reach the
# same `token_logprobs` as llama's, and a compile costs ~12 s of the suite
@pytest.mark.parametrize(
    "family, backend",
    [
        ("llama", "eager"),
        ("llama", "compiled"),
        ("llama", "cudagraph-host"),
        ("gemma2", "eager"),
        ("gemma2", "cudagraph-host"),
    ],
)
def test_logprobs_equal_transformers_log_softmax_in_the_step_graph(generators, references, family, backend):
    """Greedy steps with log-probabilities run a graph of their own; a step without them keeps
    its graph and its tokens (the cudagraph backend's greedy decode still runs a step ahead)."""
    gen = generators(family, backend)
    plain = gen.generate(PROMPTS, NEW)
    tokens = gen.generate(PROMPTS, NEW, logprobs=5)
    assert tokens == plain
    for entries, row_tokens, reference in zip(gen.last_logprobs, tokens, references(family), strict=True):
        assert_matches(entries, row_tokens, reference, 5)
    assert gen.generate(PROMPTS, NEW) == plain and gen.last_logprobs is None


def test_sampled_tokens_keep_their_seed_and_report_the_models_logprobs(hf_checkpoints, generators):
    """A sampled, biased row's log-probabilities are the model's at the token it drew (before the
    bias and the temperature): the sampled tokens with logprobs are those without, and each entry's
    value is transformers' log-softmax there, teacher-forced."""
    gen = generators("llama", "compiled")
    options = dict(do_sample=True, temperature=0.7, top_k=40, seed=11, logit_bias={7: 3.0, 9: -2.0})
    plain = gen.generate(PROMPTS, NEW, **options)
    assert gen.generate(PROMPTS, NEW, logprobs=TOP_LOGPROBS, **options) == plain
    hf = hf_checkpoints["llama"][1]
    for prompt, tokens, entries in zip(PROMPTS, plain, gen.last_logprobs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, dim=-1)  # [NEW, V]: the distribution each token was drawn from
        assert_matches(entries, tokens, (tokens, ref), TOP_LOGPROBS)


def test_an_artifacts_host_choice_gives_the_same_logprobs(hf_checkpoints, references, tmp_path):
    """The torch.export program ends at the logits and chooses on the host (host_sampling.py), as
    ONNX Runtime's runner does: its log-probabilities are computed there, from the same logits."""
    model = staticrt.load_model(hf_checkpoints["llama"][0])
    folder = export_artifact(model, CacheSpec("static", 3, 128), [32], tmp_path / "pt2", ["pt2"])
    gen = load_artifact(folder, "pt2")
    tokens = gen.generate(PROMPTS, NEW, logprobs=3)
    for entries, row_tokens, reference in zip(gen.last_logprobs, tokens, references("llama"), strict=True):
        assert_matches(entries, row_tokens, reference, 3)


def test_bad_asks_are_refused_by_name_before_anything_runs(generators):
    gen = generators("llama", "eager")
    cases = [
        (dict(logprobs=21), "logprobs is 21; at most 20 top tokens a token: ask for fewer"),
        (dict(logprobs=-1), "logprobs is -1; it must be an int >= 0"),
        (dict(logprobs=2, speculative="ngram"), "logprobs are computed for one token a row a step"),
        (dict(logprobs=2, num_beams=2), "beam search returns no logprobs; pass num_beams=1 for them"),
    ]
    held = [list(row) for row in gen.held]
    for options, message in cases:
        with pytest.raises(GenerationError) as err:
            gen.generate(PROMPTS, NEW, **options)
        assert str(err.value).startswith(message), (options, str(err.value))
    assert gen.held == held


def test_the_server_answers_logprobs_whole_and_streamed_and_names_a_bad_field(hf_checkpoints, references):
    """Completions on token ids (no tokenizer: tokens written `token_id:<id>`), whole and streamed,
    beside a request that asked for none; a speculating server verifies no drafts for such a row."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(hf_checkpoints["llama"][0])
    backend = staticrt.Generator(model, max_batch_size=4, max_cache_len=128).backend
    app, _ = serve_backend(backend, name="tiny", speculative="ngram:3")
    ask = dict(model="tiny", max_tokens=NEW, temperature=0)
    with running(app) as url:
        api = client(url)
        for prompt, (ref_tokens, ref) in zip(PROMPTS, references("llama"), strict=True):
            whole = api.completions.create(prompt=prompt, logprobs=4, **ask).choices[0]
            streamed = [c.choices[0] for c in api.completions.create(prompt=prompt, logprobs=4, stream=True, **ask)]
            for logprobs in (whole.logprobs, *[c.logprobs for c in streamed if c.logprobs is not None]):
                assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
            tokens = [int(t.removeprefix("token_id:")) for c in streamed if c.logprobs for t in c.logprobs.tokens]
            assert tokens == ref_tokens == whole.model_extra["token_ids"]
            assert [int(t.removeprefix("token_id:")) for t in whole.logprobs.tokens] == ref_tokens
            values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
            assert torch.allclose(torch.tensor(values), torch.tensor(whole.logprobs.token_logprobs))
            for step, (token, value, top) in enumerate(
                zip(ref_tokens, whole.logprobs.token_logprobs, whole.logprobs.top_logprobs, strict=True)
            ):
                assert abs(value - ref[step, token].item()) < TOL
                assert sorted(top.values(), reverse=True) == pytest.approx(ref[step].topk(4).values.tolist(), abs=TOL)
            ends = [len(t) for t in whole.logprobs.tokens]
            assert whole.logprobs.text_offset == [sum(ends[:i]) for i in range(len(ends))]
            plain = api.completions.create(prompt=prompt, **ask).choices[0]
            assert plain.logprobs is None and plain.model_extra["token_ids"] == ref_tokens
        for body, param, message in [
            (dict(logprobs=21), "logprobs", "logprobs is 21; it must be an integer in [0, 20]"),
            (dict(logprobs=True), "logprobs", "logprobs is True; it must be an integer in [0, 20]"),
        ]:
            reply = httpx.post(f"{url}/v1/completions", json={**ask, "prompt": [1, 2], **body})
            assert (reply.status_code, reply.json()["error"]["param"]) == (400, param)
            assert reply.json()["error"]["message"].startswith(message)


def test_a_chat_on_smollm2_answers_each_tokens_text_bytes_and_logprobs(smollm2, hf_smollm2):
    """The real model through the official client: each token's text is transformers' decoding of
    it, its bytes that text's UTF-8, its log-probability and its 3 most likely transformers' log-
    softmax of the same positions (teacher-forced); the stream's entries are the whole answer's."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    hf, fast = hf_smollm2
    model = staticrt.load_model(smollm2)
    backend = staticrt.Generator(model, max_batch_size=2, max_cache_len=256).backend
    app, _ = serve_backend(backend, model.tokenizer, name="smollm2")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ask = dict(model="smollm2", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    with running(app) as url:
        api = client(url)
        whole = api.chat.completions.create(**ask).choices[0]
        chunks = [c.choices[0] for c in api.chat.completions.create(stream=True, **ask) if c.choices]
        refused = httpx.post(f"{url}/v1/chat/completions", json={**ask, "logprobs": None})
    streamed = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.logprobs.content]
    tokens = whole.model_extra["token_ids"]
    prompt = model.tokenizer.apply_chat_template(messages)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert [e.token for e in whole.logprobs.content] == [fast.decode([t]) for t in tokens]
    for step, (token, entry) in enumerate(zip(tokens, whole.logprobs.content, strict=True)):
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - ref[step, token].item()) < TOL
        top = ref[step].topk(3)
        assert [e.token for e in entry.top_logprobs] == [fast.decode([t]) for t in top.indices.tolist()]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOL)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "top_logprobs")
    assert refused.json()["error"]["message"] == "top_logprobs is 3; it needs logprobs: true beside it"
