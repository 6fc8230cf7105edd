"""Speculative decoding: drafted tokens checked in one verify step give plain greedy decoding's tokens.

Against transformers' greedy tokens on all four families and the static, sliding (the rows wrap
their window) and hybrid caches, eager and compiled (no recompile); on prompts whose drafts are
all accepted and all rejected; on the real SmolLM2 copying a paragraph, where most drafts hold.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import hf_greedy, save_hf_model

import staticrt
from staticrt.cli.main import main
from staticrt.errors import GenerationError
from staticrt.generation.draft_policy import DraftPolicy
from staticrt.generation.prefix import draft_room
from staticrt.generation.speculative import ngram_draft

# checkpoint -> (cache kind, max_cache_len): the sliding and hybrid layers hold a window of 16
CASES = {
    "llama": ("static", 128),
    "mistral": ("static", 128),
    "qwen2": ("static", 128),
    "gemma2": ("hybrid", 128),
    "mistral-sw16": ("sliding", 128),
    "lfm2": ("static", 128),  # a rejected draft's conv inputs: its 64-slot buffer continues from before them
}
NEW_TOKENS = 40


def prompt(seed: int = 1) -> list[int]:
    """Eight random tokens, twice over with a change: the second copy drafts from the first."""
    head = torch.randint(1, 256, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    return head + [7, 7] + head[:5]


def generator(hf_checkpoints, name: str, backend: str = "eager", **options) -> staticrt.Generator:
    cache, max_cache_len = CASES[name]
    model = staticrt.load_model(hf_checkpoints[name][0])
    return staticrt.Generator(model, cache=cache, max_cache_len=max_cache_len, backend=backend, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_speculation_gives_transformers_greedy_tokens(hf_checkpoints, name):
    gen = generator(hf_checkpoints, name)
    want = hf_greedy(hf_checkpoints[name][1], prompt(), NEW_TOKENS)
    assert gen.generate([prompt()], NEW_TOKENS, speculative="ngram:4")[0] == want
    assert gen.last_stats.verify_steps > 0 and gen.last_stats.drafted > 0  # it did verify drafts


@pytest.mark.parametrize("name", ["gemma2", "mistral-sw16"])
def test_compiled_speculation_runs_one_verify_graph_without_recompiling(hf_checkpoints, name):
    gen = generator(hf_checkpoints, name, "compiled", prefill_buckets=(16,))
    want = hf_greedy(hf_checkpoints[name][1], prompt(), NEW_TOKENS)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert gen.generate([prompt()], NEW_TOKENS, speculative="ngram:3")[0] == want
        assert gen.last_stats.verify_steps > 0
        again = gen.generate([prompt(2)], NEW_TOKENS, speculative="ngram:3")[0]
    assert again == hf_greedy(hf_checkpoints[name][1], prompt(2), NEW_TOKENS)
    assert set(gen.backend._graphs) == {(16, "pick", True), (1, "pick", False), (4, "verify", False)}


def test_compiled_speculative_sampling_draws_eagers_tokens_for_a_seed(hf_checkpoints):
    """A sampling verify step runs in a graph of its own and draws eager's tokens for the seed:
    in 4 tokens (prefill, decode, at most two verify steps) the policy cannot pause, so the draws
    line up. Each prompt is a passage, the model's answer to it and the passage again: drafts copy
    the answer, which a temperature of 0.1 keeps often (a random tiny model's logits are flat)."""
    sampled = dict(do_sample=True, temperature=0.1, seed=7, speculative="ngram:3")
    eager = generator(hf_checkpoints, "mistral-sw16", prefill_buckets=(16,))
    texts = [p[:5] + eager.generate([p[:5]], 5)[0] + p[:5] for p in (prompt(1), prompt(2), prompt(3))]
    gen = generator(hf_checkpoints, "mistral-sw16", "compiled", prefill_buckets=(16,))
    tokens, verified = [], 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        for text in texts:
            tokens.append(gen.generate([text], 4, **sampled)[0])
            verified += gen.last_stats.verify_steps
    assert tokens == [eager.generate([text], 4, **sampled)[0] for text in texts]
    assert verified > 0 and set(gen.backend._graphs) == {
        (16, "pick", True),
        (1, "pick", False),
        (4, "verify_sample", False),
    }


def drafter(hf_checkpoints, name: str = "llama-linear-tied", **options) -> staticrt.Generator:
    """A Generator over a draft model: another tiny checkpoint with the same 256-token vocabulary."""
    return staticrt.Generator(staticrt.load_model(hf_checkpoints[name][0]), max_cache_len=128, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_a_draft_models_drafts_leave_transformers_greedy_tokens(hf_checkpoints, name, tmp_path):
    """Another model drafts (llama-linear-tied; where the model's cache rotates, a rotating one of
    the model's shape with other weights): it rarely agrees, and every token is still the model's
    own greedy one. Two rows of different lengths: where one has wrapped its window and may draft
    one token (`draft_room`), the other still drafts four."""
    gen = generator(hf_checkpoints, name, max_batch_size=2)
    if CASES[name][0] == "sliding":
        save_hf_model(name, tmp_path, seed=1)
        draft = staticrt.Generator(staticrt.load_model(tmp_path), cache="sliding", max_cache_len=128, max_batch_size=2)
    else:
        draft = drafter(hf_checkpoints, max_batch_size=2)
    prompts = [prompt(), prompt(2)[:4]]
    want = [hf_greedy(hf_checkpoints[name][1], p, NEW_TOKENS) for p in prompts]
    assert gen.generate(prompts, NEW_TOKENS, speculative=draft) == want
    assert gen.last_stats.verify_steps > 0 and gen.last_stats.drafted > 0


def test_the_model_as_its_own_draft_has_every_draft_accepted_compiled_without_recompiling(hf_checkpoints):
    """The draft model is the model (a second Generator over the same checkpoint): every draft is
    accepted; both compile their graphs once, before decoding, and keep them for the next prompt
    (which keeps its drafter's rows: the draft Generator reuses each row's prefix)."""
    gen = generator(hf_checkpoints, "llama", "compiled", prefill_buckets=(16,))
    draft = drafter(hf_checkpoints, "llama", backend="compiled", prefill_buckets=(16,))
    spec = staticrt.Speculation("model", 3, drafter=draft)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (1, 2):
            out = gen.generate([prompt(seed)], NEW_TOKENS, speculative=spec)[0]
            assert out == hf_greedy(hf_checkpoints["llama"][1], prompt(seed), NEW_TOKENS)
            stats = gen.last_stats
            assert stats.verify_steps > 0 and stats.accepted == stats.drafted == 3 * stats.verify_steps
    assert set(gen.backend._graphs) == {(16, "pick", True), (1, "pick", False), (4, "verify", False)}
    assert set(draft.backend._graphs) == {(16, "pick", True), (16, "pick", False), (1, "pick", False)}


def test_a_draft_models_draft_length_grows_by_two_on_a_clean_step_and_shrinks_by_one_on_a_miss():
    """transformers' "heuristic" schedule, k = 4: kept all (stays 4), missed (3), missed (2), kept all
    (4), missed twice (3, 2), and never below 1. Prompt lookup's stays 4 whatever happens."""
    from staticrt.generation.speculative import Speculation
    from staticrt.generation.speculator import Speculator

    def lengths(drafter) -> list[int]:
        spec = Speculation("model" if drafter else "ngram", 4, drafter=drafter)
        speculator = Speculator(spec, backend=None, held=[[]], n_rows=1, do_sample=False)
        seen = []
        for kept in (True, False, False, True, False, False, False, False):
            draft = np.array([5, 6])
            chosen = np.array([[5, 6, 9, 0, 0]]) if kept else np.array([[5, 8, 9, 0, 0]])
            speculator.verify([draft], np.array([1]), np.array([0]), lambda ids, num_new, chosen=chosen: chosen)
            seen.append(speculator.length)
        return seen

    assert lengths(object()) == [4, 3, 2, 4, 3, 2, 1, 1]
    assert lengths(None) == [4] * 8


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda hf: drafter(hf, max_batch_size=1),
            "the draft Generator holds 1 rows, the generation 2; build it with max_batch_size=2 or more",
        ),
        (
            lambda hf: staticrt.Generator(
                staticrt.load_model(hf["llama-linear-tied"][0]), max_cache_len=64, max_batch_size=2
            ),
            "the draft Generator holds 64 positions a row, the model 128; build the draft Generator with a "
            "max_cache_len of 128 or more",
        ),
        (
            lambda hf: staticrt.Speculation("model", 4),
            "speculative draft 'model' with drafter NoneType; give Speculation('ngram', K) or "
            "Speculation('model', K, drafter=a Generator over the draft model)",
        ),
    ],
)
def test_a_draft_model_that_cannot_mirror_the_rows_is_refused_by_name(hf_checkpoints, make, message):
    gen = generator(hf_checkpoints, "llama", max_batch_size=2)
    with pytest.raises(GenerationError) as err:
        gen.generate([prompt(), prompt(2)], 4, speculative=make(hf_checkpoints))
    assert str(err.value) == message


def test_a_draft_model_of_another_vocabulary_is_refused_by_name(hf_checkpoints, tmp_path):
    save_hf_model("llama", tmp_path, vocab_size=300)
    other = staticrt.Generator(staticrt.load_model(tmp_path), max_cache_len=128)
    with pytest.raises(GenerationError) as err:
        generator(hf_checkpoints, "llama").generate([prompt()], 4, speculative=other)
    assert str(err.value) == (
        "the draft model's vocabulary has 300 tokens, the model's 256; a draft model must share the model's tokenizer"
    )


def test_run_drafts_with_a_model_given_as_draft(hf_checkpoints, capsys):
    ids = ",".join(map(str, prompt()))
    folder, draft = hf_checkpoints["llama"][0], hf_checkpoints["llama-linear-tied"][0]
    assert (
        main(
            ["run", "--model", str(folder), "--prompt-ids", ids, "--max-new-tokens", "24"]
            + ["--draft", f"{draft}:2", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"][0] == hf_greedy(hf_checkpoints["llama"][1], prompt(), 24)
    assert out["verify_steps"] > 0 and out["drafted"] <= 2 * out["verify_steps"]


@pytest.mark.parametrize("command", ["run", "bench"])
def test_prompt_lookup_and_a_draft_model_at_once_are_refused_by_name(hf_checkpoints, command, capsys):
    folder = str(hf_checkpoints["llama"][0])
    args = ["--prompt-ids", "1,2,3"] if command == "run" else []
    assert main([command, "--model", folder, *args, "--speculative", "ngram", "--draft", folder]) != 0
    assert "give --speculative ngram[:K] (prompt lookup) or --draft MODEL[:K], not both" in capsys.readouterr().err


def test_a_rows_tokens_do_not_depend_on_its_neighbours_drafts(hf_checkpoints):
    gen = generator(hf_checkpoints, "llama", max_batch_size=3)
    prompts = [prompt(1), prompt(2)[:9], prompt(3)]
    alone = [gen.generate([p], 20)[0] for p in prompts]
    assert gen.generate(prompts, 20, speculative="ngram") == alone


def test_a_text_that_repeats_itself_drafts_tokens_that_are_all_accepted(hf_checkpoints, monkeypatch):
    """With a window of 16 and two layers, a token sees the 31 before it: after a 40-token passage
    X that came before with the answer A, the model answers A again, which the drafts copy. The
    policy's clock is left out (its own test below feeds it times): on a loaded machine a tiny
    model's verify step can measure slower a token than its decode step, and the policy pauses."""
    monkeypatch.setattr(DraftPolicy, "timed", lambda policy, seconds, tokens: policy.decode_s.append(seconds))
    gen = staticrt.Generator(staticrt.load_model(hf_checkpoints["mistral-sw16"][0]), max_cache_len=160)
    passage = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    answer = gen.generate([passage], 40)[0]
    text = passage + answer + passage
    out = gen.generate([text], 24, speculative="ngram:4")[0]
    stats = gen.last_stats
    assert out == answer[:24] == hf_greedy(hf_checkpoints["mistral-sw16"][1], text, 24)
    assert stats.drafted == stats.accepted > 0 and stats.decode_tokens == 23
    assert len(stats.decode_s) == 1 + 5  # the one timed decode step, then 5 tokens a verify step


def test_drafts_the_model_never_chooses_leave_the_tokens_and_the_held_ids_exact(hf_checkpoints):
    gen = generator(hf_checkpoints, "mistral")
    text = prompt(4) + prompt(4)
    out = gen.generate([text], 24, speculative="ngram:4", reuse_prefix=True)[0]
    stats = gen.last_stats
    assert out == hf_greedy(hf_checkpoints["mistral"][1], text, 24)
    assert stats.verify_steps > 0 and stats.accepted == 0
    # held: what the row's cache holds, as fed; -1 marks positions a rejected draft wrote last
    valid = text + out[:-1]
    assert gen.held[0][: len(valid)] == valid and set(gen.held[0][len(valid) :]) <= {-1}


def test_verify_sample_keeps_a_draft_as_often_as_the_model_gives_it_and_every_token_follows_the_model():
    """`verify_sample` at one position, 40,000 draws a case: the token's frequencies fit the
    position's sampling distribution p (softmax of logits / temperature within the top-k,
    renormalised; computed here apart from `sampling.py`), whatever the draft: a likely one, an
    unlikely one, one outside the top-k and one inside it, none; and a greedy row (top-k 1) takes
    the argmax."""
    from scipy.stats import chisquare

    from staticrt.generation.sampling import verify_sample

    logits = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0, -3.0])
    cases = [  # (draft, temperature, top_k)
        (0, 1.0, 0),  # the likeliest token, p = 0.49
        (3, 1.0, 0),  # an unlikely one, p = 0.07
        (4, 0.7, 3),  # outside the top-3: never kept
        (2, 1.0, 3),  # inside it: kept as often as the top-3 renormalised gives it (p = 0.12)
        (-1, 1.0, 4),  # no draft: a plain draw
        (1, 1.0, 1),  # a greedy row: drafts other than the argmax are redrawn as the argmax
    ]
    n, vocab = 40_000, len(logits)
    uniform = torch.rand((len(cases) * n, 1, 2), generator=torch.Generator().manual_seed(0))
    column = lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(n)  # noqa: E731
    tokens = verify_sample(
        logits.expand(len(cases) * n, 1, vocab),
        column([d for d, _, _ in cases], torch.int64)[:, None],
        column([t for _, t, _ in cases], torch.float32),
        column([k for _, _, k in cases], torch.int64),
        torch.ones(len(cases) * n),
        uniform,
    ).reshape(len(cases), n)
    for (draft, temperature, top_k), drawn in zip(cases, tokens, strict=True):
        p = torch.softmax(logits.double() / temperature, dim=-1)
        if top_k:
            p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
            p = p / p.sum()
        counts = torch.bincount(drawn, minlength=vocab).double()
        support = p > 0
        assert counts[~support].sum() == 0, (draft, counts)
        if support.sum() > 1:
            fit = chisquare(counts[support].numpy(), (p[support] / p[support].sum() * n).numpy())
            assert fit.pvalue > 1e-4, (draft, temperature, top_k, counts.tolist(), (p * n).tolist())
    assert tokens[-1].eq(0).all()  # the greedy row's argmax


def test_speculative_sampling_draws_what_plain_sampling_draws_in_distribution(hf_checkpoints):
    """mistral-sw16 after a passage it answered before, temperature 0.1 (a random tiny model's
    logits are flat): 480 rows sampled plainly and 480 with prompt lookup, other seeds. Tokens 1-2
    come from the prefill and a decode step in both; 3 and 4 from verify steps that keep and
    reject drafts. A chi-squared test of homogeneity on (token 3, token 4) finds the two the same."""
    from scipy.stats import chi2_contingency

    gen = staticrt.Generator(
        staticrt.load_model(hf_checkpoints["mistral-sw16"][0]), max_cache_len=160, max_batch_size=32
    )
    passage = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    text = passage + gen.generate([passage], 40)[0] + passage
    drawn: dict[str, list[tuple[int, int]]] = {"plain": [], "ngram": []}
    drafted = accepted = 0
    for call in range(15):
        for arm, speculative, seed in (("plain", None, 0), ("ngram", "ngram:4", 10_000)):
            out = gen.generate(
                [text] * 32, 4, do_sample=True, temperature=0.1, seed=seed + 32 * call, speculative=speculative
            )
            drawn[arm] += [(row[2], row[3]) for row in out]
            if speculative:
                drafted, accepted = drafted + gen.last_stats.drafted, accepted + gen.last_stats.accepted
    assert 0 < accepted < drafted  # verify steps kept drafts and rejected some
    pairs = sorted(set(drawn["plain"]) | set(drawn["ngram"]))
    table = np.array([[drawn[arm].count(pair) for pair in pairs] for arm in drawn])
    common = table.sum(axis=0) >= 10  # pairs seen at least 10 times; the rest pooled
    table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    assert table.shape[1] >= 4, table  # the test has categories to compare
    assert chi2_contingency(table).pvalue > 1e-3, table


def test_prompt_lookup_takes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = np.array([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3])
    assert ngram_draft(tokens, 3, 3).tolist() == [4, 5, 6]  # "2 3" last followed by 4 5 6
    assert ngram_draft(tokens, 3, 1).tolist() == [4, 5, 6]
    assert ngram_draft(np.array([5, 6, 7]), 3, 3).tolist() == []
    assert ngram_draft(np.array([8, 8]), 3, 3).tolist() == [8]


def test_a_rotating_row_drafts_only_what_it_can_take_back():
    window16 = ((16, 16),)  # a sliding layer of 16 slots, window 16
    assert draft_room(3, 4, window16) == 4  # far from wrapping: any draft
    assert draft_room(12, 4, window16) == 3  # position 15 is the last before it wraps
    assert draft_room(40, 4, window16) == 1  # wrapped: only the first draft can be overwritten exactly
    assert draft_room(40, 4, ((18, 16),)) == 3  # two spare slots: three
    assert draft_room(40, 4, ((16, None),)) == 0  # a sink layer sees every slot: nothing once wrapped
    assert draft_room(40, 4, ()) == 4


def test_drafting_pauses_where_it_does_not_pay_and_tries_again():
    policy = DraftPolicy()
    policy.timed(0.010, None)  # a decode step: 10 ms a token
    policy.timed(0.015, [1])
    policy.timed(0.015, [1])  # verify steps yielding one token each: 15 ms a token
    assert policy.wait == policy.pause == 4
    policy.timed(0.015, [4])
    policy.timed(0.015, [4])  # 3.75 ms a token: drafting pays again
    assert policy.pause == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"speculative": "ngram:0"},
            "speculative k is 0; it must lie in [1, 32] (a verify step is k + 1 wide)",
        ),
        (
            {"speculative": "draft"},
            "speculative is 'draft'; give 'ngram' or 'ngram:K' (prompt lookup, K drafted tokens a step, default 4)",
        ),
        (
            {"speculative": "ngram", "num_beams": 2},
            "beam search does not speculate; pass num_beams=1 or speculative=None",
        ),
    ],
)
def test_a_speculation_it_cannot_run_is_refused_by_name(hf_checkpoints, options, message):
    gen = generator(hf_checkpoints, "llama", max_batch_size=2)
    with pytest.raises(GenerationError) as err:
        gen.generate([prompt()], 4, **options)
    assert str(err.value) == message


def test_run_speculates_on_the_real_model_copying_a_paragraph(smollm2, hf_smollm2, capsys):
    """SmolLM2 asked to repeat a paragraph: most drafts hold, and the tokens are transformers'."""
    paragraph = (
        "The river rises in the northern hills, runs south through three market towns and meets the sea at a "
        "wide estuary where herons feed at low tide."
    )
    question = f"Repeat this sentence exactly: {paragraph}"
    model = staticrt.load_model(smollm2)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    args = ["run", "--model", str(smollm2), "--chat", question, "--max-new-tokens", "40"]
    assert main([*args, "--speculative", "ngram:4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"][0] == hf_greedy(hf_smollm2[0], ids, 40, eos_token_id=list(model.config.eos_token_ids))
    assert out["accepted"] > out["drafted"] / 2 and out["tokens_per_step"] > 2


def test_a_server_speculates_in_its_rows_beside_sampled_rows_and_stops_inside_a_verify_step(hf_checkpoints):
    """Three rows on the window-16 model (rows wrap): two greedy requests whose drafts are verified
    side by side with a sampled one (the sampling verify graph, greedy rows as top_k 1) get
    transformers' tokens; the sampled one gets all it asked for. Then a text that repeats a passage (as
    in the test above, every draft accepted; one a step, since the row has wrapped its 16 slots)
    with a stop id at the answer's 13th token, the first of a verify step's two: the answer ends
    there, and the step's other token reaches neither the finished request nor the token count."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import concurrent.futures

    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(hf_checkpoints["mistral-sw16"][0])
    build = lambda rows: staticrt.Generator(model, cache="sliding", max_batch_size=rows, max_cache_len=160)  # noqa: E731
    wants = [hf_greedy(hf_checkpoints["mistral-sw16"][1], prompt(s), NEW_TOKENS) for s in (1, 3)]
    passage = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    answer = build(1).generate([passage], 40)[0]
    stop = answer[12]  # steps give tokens 0 (prefill), 1 (decode), then 2-3, 4-5, ... (verify)
    assert stop not in answer[:12]
    asks = [(prompt(1), 0.0, []), (prompt(3), 0.0, []), (prompt(2), 1.0, []), (passage + answer + passage, 0.0, [stop])]

    def served(speculative: str | None) -> tuple[list[tuple[list[int], str]], str]:
        app, _ = serve_backend(build(3).backend, name="tiny", prefiller=build(1).backend, speculative=speculative)
        with running(app) as url:
            api = client(url)

            def ask(args: tuple[list[int], float, list[int]]) -> tuple[list[int], str]:
                ids, temperature, stops = args
                reply = api.completions.create(
                    model="tiny",
                    prompt=ids,
                    max_tokens=NEW_TOKENS,
                    temperature=temperature,
                    seed=7,
                    extra_body={"stop_token_ids": stops},
                )
                return reply.choices[0].model_extra["token_ids"], reply.choices[0].finish_reason

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(ask, asks[:3]))
            got.append(ask(asks[3]))
            return got, httpx.get(f"{url}/metrics").text

    (first, second, sampled, stopped), metrics = served("ngram:4")
    assert [first[0], second[0]] == wants
    assert stopped == (answer[:13], "stop")
    assert len(sampled[0]) == NEW_TOKENS and sampled[0] != served(None)[0][2][0]  # its row verified
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] != "#"}
    assert counts["staticrt_draft_tokens_total"] > 0
    # no token past the stop reached the finished request, nor counted as generated
    answers = (first, second, sampled, stopped)
    assert counts["staticrt_generated_tokens_total"] == sum(len(tokens) for tokens, _ in answers)
    assert counts['staticrt_requests_finished_total{outcome="stop"}'] == 1


def test_a_served_sampled_request_draws_what_generate_draws_with_speculation_for_its_seed(hf_checkpoints, monkeypatch):
    """A sampled request alone on a speculating server verifies its drafts by speculative
    sampling's rule, drawing its uniforms from its seed as `generate` does: the same tokens as
    `generate(do_sample=True, seed=7, speculative="ngram:4")`, which the chi-squared test above
    holds to the model's distribution, and other tokens than without speculation. The drafting
    clock is left out (every step may verify), so that both take the same steps."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    from staticrt.serve import serve_backend

    monkeypatch.setattr(DraftPolicy, "timed", lambda policy, seconds, tokens: policy.decode_s.append(seconds))
    gen = generator(hf_checkpoints, "llama")
    passage = torch.randint(1, 256, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = passage + gen.generate([passage], 24)[0] + passage  # drafts well: it repeats itself
    options = {"do_sample": True, "seed": 7, "temperature": 0.7}
    want = gen.generate([ids], NEW_TOKENS, speculative="ngram:4", **options)[0]
    assert gen.last_stats.verify_steps > 0 and want != gen.generate([ids], NEW_TOKENS, **options)[0]
    rows, prefiller = generator(hf_checkpoints, "llama", max_batch_size=2), generator(hf_checkpoints, "llama")
    app, _ = serve_backend(rows.backend, prefiller=prefiller.backend, speculative="ngram:4")
    with running(app) as url:
        reply = client(url).completions.create(
            model="model", prompt=ids, max_tokens=NEW_TOKENS, temperature=0.7, seed=7
        )
    assert reply.choices[0].model_extra["token_ids"] == want


def test_an_artifact_backend_is_refused_by_name_before_it_serves_or_generates():
    from types import SimpleNamespace

    from staticrt.generation.speculative import check_verifies

    with pytest.raises(GenerationError) as raised:
        check_verifies(SimpleNamespace(name="exported-aoti"))  # a torch artifact's backend: no verify_step
    assert str(raised.value) == (
        "the exported-aoti backend has no verify step for speculative decoding; use a torch model backend "
        "(eager, compiled, cudagraph) or an onnx artifact, or no speculation (drop --speculative; speculative=None)"
    )


def test_a_server_drafts_with_a_model_in_its_rows_and_refuses_one_that_cannot_mirror_them(hf_checkpoints, caplog):
    """Three rows and a draft model's Generator of three rows (prefill buckets of 16, so a 40-token
    prompt reaches it in chunks when its row first drafts): three greedy requests at once, two of
    them sharing a row in turn, get transformers' tokens, with the model as its own draft (every
    draft accepted) and with another model (llama-linear-tied, which rarely agrees). A drafter of
    one row is refused by name before anything is built."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    import concurrent.futures

    import httpx
    from serving import client, running

    from staticrt.serve import serve_backend

    hf = hf_checkpoints["llama"][1]
    long = torch.randint(1, 256, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    asks = [prompt(1), long + prompt(2), prompt(3), prompt(4)]
    wants = [hf_greedy(hf, ids, NEW_TOKENS) for ids in asks]

    def served(name: str) -> tuple[list[list[int]], dict[str, float]]:
        draft = drafter(hf_checkpoints, name, max_batch_size=3, prefill_buckets=(16,))
        spec = staticrt.Speculation("model", 3, drafter=draft)
        gen = generator(hf_checkpoints, "llama", max_batch_size=3)
        app, _ = serve_backend(
            gen.backend, name="tiny", prefiller=generator(hf_checkpoints, "llama").backend, speculative=spec
        )
        with running(app) as url:
            api = client(url)

            def ask(ids: list[int]) -> list[int]:
                reply = api.completions.create(model="tiny", prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
                return reply.choices[0].model_extra["token_ids"]

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(ask, asks))
            metrics = httpx.get(f"{url}/metrics").text
        return got, {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] != "#"}

    got, counts = served("llama")
    assert got == wants
    assert counts["staticrt_draft_tokens_total"] > 0
    assert counts["staticrt_draft_accepted_tokens_total"] == counts["staticrt_draft_tokens_total"]
    got, counts = served("llama-linear-tied")
    assert got == wants and counts["staticrt_draft_tokens_total"] > 0
    assert "the draft model failed" not in caplog.text  # no step lost its drafts to an error
    with pytest.raises(GenerationError) as raised:
        spec = staticrt.Speculation("model", 4, drafter=drafter(hf_checkpoints))
        serve_backend(generator(hf_checkpoints, "llama", max_batch_size=3).backend, speculative=spec)
    assert str(raised.value) == (
        "the draft Generator holds 1 rows, the generation 3; build it with max_batch_size=3 or more"
    )


def test_a_draft_models_row_near_its_caches_end_drafts_nothing_and_the_others_still_draft(hf_checkpoints):
    """A drafter of 32 positions and one prefill bucket of 16, which its prefill writes whole after
    what a row keeps. A row of 25 tokens reaches it in two calls (16, then 9 after them: 32 written)
    and drafts 3. Grown by two tokens its row keeps 25, and 25 + 16 would pass the end (the drafter's
    loop would then prefill every row whole, past its bucket: an error): that row drafts nothing,
    and the row of 6 tokens still drafts 3."""
    model = staticrt.load_model(hf_checkpoints["llama"][0])
    draft = staticrt.Generator(model, max_batch_size=2, max_cache_len=32, prefill_buckets=(16,))
    spec = staticrt.Speculation("model", 3, drafter=draft)
    ids = torch.randint(1, 256, (27,), generator=torch.Generator().manual_seed(4)).tolist()
    drafted = []
    for grown in (0, 2):
        contexts = [np.array(ids[: 25 + grown]), np.array(ids[:6] + ids[25 : 25 + grown])]
        drafted.append([len(d) for d in spec.propose(contexts, [3, 3], catch_up=True)])
    assert drafted == [[3, 3], [0, 3]]


def test_a_server_row_counts_what_rejected_drafts_and_an_earlier_request_left_in_its_slots():
    """A rotating layer of 16 slots (window 16): a row that holds 21 ids keeps them for a prompt
    that continues them after one rejected draft (written at position 21, where the prompt goes
    on), not after two (the second wrote position 23, a slot the prompt's window reads). A row cut back to
    10 ids by a new request keeps nothing while the old request's entries lie in its slots, and
    keeps its own again once it has written every slot since."""
    from types import SimpleNamespace

    from staticrt.serve.rows import RowMemory

    backend = SimpleNamespace(
        batch_size=1, row_positions=True, rotating_layouts=((16, 16),), max_sequence_len=None, buckets=(16,)
    )
    memory = RowMemory(backend, reuse=True)
    ids = list(range(1, 21))
    memory.fed(0, np.array(ids))
    memory.fed(0, np.array([50]), rejected=1)
    assert memory.kept(ids + [50, 51], 0) == 21
    memory.fed(0, np.array([51]), rejected=2)  # drafts at 22 and 23 rejected
    assert memory.kept(ids + [50, 51, 52], 0) == 0
    memory.seat(0, 10, order=1)  # a new request keeps the first 10 and writes 3 of its own
    memory.fed(0, np.array([60, 61, 62]))
    assert memory.kept(ids[:10] + [60, 61, 62, 63], 0) == 0
    memory.fed(0, np.arange(70, 83))  # 16 positions since it was seated: every slot its own
    held = ids[:10] + [60, 61, 62, *range(70, 83)]
    assert memory.kept(held + [99], 0) == len(held)
