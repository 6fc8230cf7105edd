"""Prefix reuse: a row continues from the tokens its cache holds and prefills only the rest.

A conversation's turns, each the whole conversation so far, give transformers' greedy tokens for
that whole conversation while prefilling only the new turn, on all four families, LFM2's conv
layers and Granite 4.0-H's Mamba2 layers, the static, sliding (prompts shorter and longer than the
window) and hybrid caches, eager, compiled (no recompile) and ONNX. A property test over random
shared prefixes holds reuse against a whole prefill where rotating buffers have wrapped, which is
where continuing can go wrong.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch
from hf_models import hf_greedy
from hypothesis import given
from hypothesis import strategies as st

import staticrt
from staticrt.cli.main import main
from staticrt.generation.prefix import kept_prefix

NEW_TOKENS = 10
# checkpoint -> (cache kind, max_cache_len): the sliding and hybrid layers hold a window of 16
CASES = {
    "llama": ("static", 128),
    "mistral": ("static", 128),
    "qwen2": ("static", 128),
    "gemma2": ("hybrid", 128),
    "mistral-sw16": ("sliding", 64),
    "lfm2": ("static", 128),  # conv layers: their inputs' buffer of 64 slots continues as a rotating layer does
    "granitemoehybrid": ("static", 128),  # Mamba2 layers: a state continues from where it stopped
    "falcon_h1": ("static", 128),  # a Mamba2 beside each attention: two cache layers a layer
}


def turns(seed: int = 3) -> list[list[int]]:
    """A system prompt of 9 tokens, then user turns of 4, 6 and 20 tokens (a sliding row wraps)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (9, 4, 6, 20)]


def converse(gen: staticrt.Generator, reuse: bool = True) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each turn's whole conversation (the answers so far included), the answers, and the prompt
    tokens the row kept each turn."""
    system, *users = turns()
    conversation, prompts, answers, kept = list(system), [], [], []
    for user in users:
        conversation += user
        prompts.append(list(conversation))
        answer = gen.generate([conversation], NEW_TOKENS, reuse_prefix=reuse)[0]
        answers.append(answer)
        kept.append(gen.last_stats.kept[0])
        conversation += answer
    return prompts, answers, kept


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """checkpoint -> transformers' greedy answer to each turn's whole conversation."""
    out = {}
    for name in CASES:
        hf = hf_checkpoints[name][1]
        system, *users = turns()
        conversation, answers = list(system), []
        for user in users:
            conversation += user
            answers.append(hf_greedy(hf, conversation, NEW_TOKENS))
            conversation += answers[-1]
        out[name] = answers
    return out


def generator(hf_checkpoints, name: str, backend: str, **options) -> staticrt.Generator:
    cache, max_cache_len = CASES[name]
    model = staticrt.load_model(hf_checkpoints[name][0])
    return staticrt.Generator(model, cache=cache, max_cache_len=max_cache_len, backend=backend, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_each_turn_prefills_only_what_it_adds_and_gives_transformers_tokens(hf_checkpoints, references, name):
    prompts, answers, kept = converse(generator(hf_checkpoints, name, "eager"))
    assert answers == references[name]
    # a turn keeps the previous conversation and the answer's tokens but the last (never fed)
    assert kept == [0] + [len(prompts[t - 1]) + NEW_TOKENS - 1 for t in range(1, len(prompts))]


@pytest.mark.parametrize("name", ["gemma2", "mistral-sw16"])  # a static row: the compiled server test below
def test_compiled_turns_reuse_their_row_without_recompiling(hf_checkpoints, references, name):
    gen = generator(hf_checkpoints, name, "compiled", prefill_buckets=(16, 32))
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, answers, kept = converse(gen)
    assert answers == references[name] and all(kept[1:])
    # the first turn's fresh prefill (16), the later turns' continuing ones (16 and 32), and decode
    assert set(gen.backend._graphs) == {
        (16, "pick", True),
        (16, "pick", False),
        (32, "pick", False),
        (1, "pick", False),
    }


@pytest.fixture(scope="module")
def onnx_artifacts(hf_checkpoints, tmp_path_factory):
    """The static llama and the sliding mistral as batch-1 ONNX artifacts."""
    out = {}
    for name in ("llama", "mistral-sw16"):
        cache, max_cache_len = CASES[name]
        folder = tmp_path_factory.mktemp("onnx") / name
        argv = ["export", "--model", str(hf_checkpoints[name][0]), "--format", "onnx", "--out", str(folder)]
        assert main([*argv, "--cache", cache, "--max-cache-len", str(max_cache_len)]) == 0
        out[name] = folder
    return out


@pytest.mark.parametrize("name", ["llama", "mistral-sw16"])
def test_an_onnx_row_continues_its_conversation(hf_checkpoints, onnx_artifacts, references, name):
    """ONNX Runtime writes one column of every row; a batch-1 row's columns are its positions, so
    it continues from a kept prefix by moving back to where the prefix ends: after the turns, a
    prompt that branches off after the first turn keeps that turn (static) or nothing (a wrapped
    sliding row), and both give transformers' tokens."""
    gen = staticrt.load_artifact(onnx_artifacts[name], backend="onnx")
    prompts, answers, kept = converse(gen)
    assert answers == references[name] and all(kept[1:])
    branch = prompts[0] + [11, 12, 13]
    assert gen.generate([branch], NEW_TOKENS, reuse_prefix=True)[0] == hf_greedy(
        hf_checkpoints[name][1], branch, NEW_TOKENS
    )
    assert gen.last_stats.kept == [len(prompts[0]) if name == "llama" else 0]


@pytest.fixture(scope="module")
def sliding_model(hf_checkpoints):
    return staticrt.load_model(hf_checkpoints["mistral-sw16"][0])


@given(
    first=st.lists(st.integers(1, 255), min_size=1, max_size=40),
    shared=st.integers(0, 60),
    suffix=st.lists(st.integers(1, 255), min_size=0, max_size=16),
    slots=st.sampled_from([16, 19]),
)
def test_reuse_equals_a_whole_prefill_for_any_shared_prefix(sliding_model, first, shared, suffix, slots):
    """A row holds a prompt and its answer; the next prompt shares any prefix of that with it.
    Rotating buffers of 16 slots (the window) or 19 (three to spare): kept or not as prefix.py
    says, the answer equals a whole prefill's in a fresh cache, which is what exact means."""
    options = dict(cache="sliding", window=slots, max_cache_len=64, prefill_buckets=(16, 64))
    gen = staticrt.Generator(sliding_model, **options)
    answer = gen.generate([first], 6)[0]
    held = first + answer[:-1]
    prompt = (first + answer)[:shared] + suffix or [7]
    expected = staticrt.Generator(sliding_model, **options).generate([prompt], 6)[0]
    assert gen.generate([prompt], 6, reuse_prefix=True)[0] == expected
    assert gen.last_stats.kept == [kept_prefix(held, prompt, ((slots, 16),))]


def test_what_a_rotating_row_can_keep():
    """The arithmetic of prefix.py's worked example: 4 slots, a window of 4, 6 positions held."""
    held, prompt = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]
    assert kept_prefix(held, prompt, ()) == 6  # linear layers keep any prefix
    assert kept_prefix(held, prompt, ((4, 4),)) == 6  # from the end: exact
    assert kept_prefix(held, [1, 2, 3, 4, 5, 9], ((4, 4),)) == 0  # from 5 a scribbled slot is seen
    assert kept_prefix(held, [1, 2, 3, 4, 5, 9], ((5, 4),)) == 5  # one spare slot backs off one
    assert kept_prefix(held, [1, 2, 3, 9], ((7, 4),)) == 3  # never wrapped: any prefix
    assert kept_prefix(held, [1, 2, 3, 4, 5, 6], ()) == 5  # the whole prompt held: back off one
    assert kept_prefix(held, held + [8], ((4, None),)) == 0  # a sink layer that wrapped: nothing


def test_a_row_cut_back_to_a_kept_prefix_remembers_the_tail_its_slots_still_hold(hf_checkpoints):
    """Rotating layers of 20 slots, window 16 (4 positions of slack). A row holding 31 ids is
    continued from 28 by a prompt of 29 tokens that asks for one token (it feeds one): the row holds
    29 ids, and its slots still hold the old positions 29 and 30, which it marks -1. A prompt that
    parts from it at 25 keeps nothing (30 - 25 > 4), where it would keep 25 were the tail forgotten
    (29 - 25 <= 4); its tokens are transformers'."""
    model = staticrt.load_model(hf_checkpoints["mistral-sw16"][0])
    gen = staticrt.Generator(model, cache="sliding", window=20, max_cache_len=128)
    a = torch.randint(1, 256, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    gen.generate([a], 2, reuse_prefix=True)  # holds a and its first answer token: 31 ids
    b = a[:28] + [7]
    gen.generate([b], 1, reuse_prefix=True)
    assert gen.last_stats.kept == [28] and gen.held[0] == b + [-1, -1]
    c = a[:25] + [9, 9, 9]
    assert a[25] != 9
    out = gen.generate([c], 4, reuse_prefix=True)[0]
    assert gen.last_stats.kept == [0]
    assert out == hf_greedy(hf_checkpoints["mistral-sw16"][1], c, 4)


SYSTEM = list(range(100, 112))  # a "system prompt" of 12 tokens that two requests share


def test_a_server_seats_a_request_in_the_row_holding_its_prefix(hf_checkpoints):
    """Two rows. A (the system prompt and a question) and B (unrelated) take a row each; C shares
    the system prompt with A and is seated in A's row, keeps those 12 tokens (OpenAI's
    `cached_tokens`) and prefills the rest; D, the same as C, keeps all of C's prompt but the
    last token. Then two clients at once whose prompts share the system prompt and then differ:
    neither sees the other's tokens. Every answer is a lone generate's. (Eager: the compiled
    server's graphs are the next test's.)"""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(hf_checkpoints["llama"][0])
    build = lambda rows: staticrt.Generator(model, max_batch_size=rows, max_cache_len=64)  # noqa: E731
    lone = build(1)
    prompts = {"A": SYSTEM + [5, 6, 7, 8], "B": [9] * 10, "C": SYSTEM + [20, 21, 22, 23, 24]}
    prompts["D"] = prompts["C"]
    app, _ = serve_backend(build(2).backend, name="tiny", prefiller=build(1).backend)
    with running(app) as url:
        api = client(url)

        def ask(prompt: list[int]) -> tuple[list[int], int]:
            reply = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            return reply.choices[0].model_extra["token_ids"], reply.usage.prompt_tokens_details.cached_tokens

        got = {name: ask(prompt) for name, prompt in prompts.items()}
        pair = [SYSTEM + [30, 31], SYSTEM + [40, 41, 42]]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(ask, pair))
        metrics = httpx.get(f"{url}/metrics").text
    for name, prompt in prompts.items():
        assert got[name][0] == lone.generate([prompt], 6)[0], name
    assert {name: cached for name, (_, cached) in got.items()} == {"A": 0, "B": 0, "C": 12, "D": 16}
    assert [tokens for tokens, _ in together] == [lone.generate([p], 6)[0] for p in pair]
    cached = [c for _, c in [*got.values(), *together]]  # the pair's: 12 for whichever took A's row
    assert f"staticrt_prefix_hits_total {sum(c > 0 for c in cached)}.0" in metrics
    assert f"staticrt_prefix_reused_tokens_total {sum(cached)}.0" in metrics
    prompt_tokens = sum(map(len, [*prompts.values(), *pair]))
    assert f"staticrt_prefilled_tokens_total {prompt_tokens - sum(cached)}.0" in metrics


@pytest.mark.filterwarnings("ignore::staticrt.caches.OffloadWarning")  # offloaded on a CPU: the same tokens
@pytest.mark.parametrize(
    ("name", "cache"),
    [
        ("llama", "static"),
        ("gemma2", "hybrid"),
        ("mistral-sw16", "sliding"),
        ("llama", "static-int8"),
        ("llama", "offloaded"),
        ("lfm2", "static"),
        ("granitemoehybrid", "static"),
        ("falcon_h1", "static"),
    ],
)
def test_more_conversations_than_rows_each_keep_their_prefix_in_the_host_pool(hf_checkpoints, name, cache):
    """Two rows, three conversations A, B, C after the system prompt, two turns each, one request
    at a time. Turn 1: B and C are seated in the row holding the system prompt, whose conversation
    goes to the host pool first. Turn 2: no row holds a conversation, the pool does: each is
    restored into the least recently used row and keeps all it fed (its prompt and answer but the
    answer's last token). Every answer is a lone generate's, on static, hybrid and sliding caches
    (window 16: restored slots wrapped, and a wrapped row cannot back off to the system prompt, so
    there turn 1 keeps nothing), an int8 one (its scales restored with it) and an offloaded one
    (host storage and device working buffers), and the Mamba2 states of Granite 4.0-H and Falcon-H1
    (which continue from where they stopped alone: turn 1 keeps nothing). With a pool too small for a row, turn 2
    keeps no more than turn 1."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    from staticrt.serve import serve_backend

    max_cache_len = CASES[name][1]
    model = staticrt.load_model(hf_checkpoints[name][0])
    build = lambda rows: staticrt.Generator(model, max_batch_size=rows, max_cache_len=max_cache_len, cache=cache)  # noqa: E731
    lone = build(1)
    firsts = {c: SYSTEM + [i + 1] * (2 + i) for i, c in enumerate("ABC")}

    def converse(cache_ram_mb: float) -> tuple[dict, dict, str]:
        app, _ = serve_backend(build(2).backend, name="tiny", prefiller=build(1).backend, cache_ram_mb=cache_ram_mb)
        answers, cached = {}, {}
        with running(app) as url:
            api = client(url)
            for turn in (1, 2):
                for c in "ABC":
                    prompt = firsts[c] if turn == 1 else firsts[c] + answers[c, 1] + [40 + turn, 41, 42]
                    reply = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
                    answers[c, turn] = reply.choices[0].model_extra["token_ids"]
                    assert answers[c, turn] == lone.generate([prompt], 6)[0], (c, turn)
                    cached[c, turn] = reply.usage.prompt_tokens_details.cached_tokens
            return answers, cached, httpx.get(f"{url}/metrics").text

    _, cached, metrics = converse(cache_ram_mb=16)
    recurrent = name in ("granitemoehybrid", "falcon_h1")  # a state cannot go back
    system = 0 if cache in ("hybrid", "sliding") or recurrent else 12
    turn_two = {c: len(firsts[c]) + 5 for c in "ABC"}
    assert cached == {**{(c, 1): system if c != "A" else 0 for c in "ABC"}, **{(c, 2): turn_two[c] for c in "ABC"}}
    assert "staticrt_prefix_pool_restores_total 3.0" in metrics
    _, cached, metrics = converse(cache_ram_mb=1e-6)
    assert {cached[c, 2] for c in "ABC"} == {system} and "staticrt_prefix_pool_restores_total 0.0" in metrics


def test_a_row_the_pool_already_holds_is_not_copied_again(hf_checkpoints, monkeypatch):
    """A client repeating a greedy request: each one overwrote a row holding what an entry already
    held, and the pool took another copy each time. The same ids are kept once, that entry made the
    newest; other ids are not. Where layers rotate, an entry is the same only with the same marks
    (what lies past its ids differs)."""
    from staticrt.serve.rows import RowMemory

    def memory_of(name: str, cache: str) -> tuple[RowMemory, list[int]]:
        model = staticrt.load_model(hf_checkpoints[name][0])
        backend = staticrt.Generator(model, max_batch_size=2, cache=cache, max_cache_len=64).backend
        copies: list[int] = []
        stash = backend.stash_row
        monkeypatch.setattr(backend, "stash_row", lambda row, n: copies.append(row) or stash(row, n))
        return RowMemory(backend, reuse=True, pool_bytes=2**20), copies

    memory, copies = memory_of("llama", "static")
    memory.held = [[7, 8], [1, 2, 3, 4]]
    memory.seat(0, 0, order=0)
    memory.seat(1, 0, order=1)
    for order in range(2, 50):  # the repeated request: its row holds the same ids again each time
        memory.held[order % 2] = [1, 2, 3, 4]
        memory.seat(order % 2, 2, order=order)
    assert [e.held for e in memory.pool] == [[7, 8], [1, 2, 3, 4]] and copies == [0, 1]
    memory.held[0] = [7, 8]
    memory.seat(0, 0, order=50)
    assert [e.held for e in memory.pool] == [[1, 2, 3, 4], [7, 8]] and copies == [0, 1]

    memory, copies = memory_of("mistral-sw16", "sliding")
    for order, beyond in enumerate((0, 0, 5)):  # the same ids; the third with a tail written past them
        memory.held[0], memory.beyond[0], memory.since[0] = [7, 8], beyond, 0
        memory.seat(0, 0, order=order)
    assert [(e.held, e.beyond) for e in memory.pool] == [([7, 8], 0), ([7, 8], 5)] and copies == [0, 0]


def test_a_saved_row_of_a_megabyte_and_up_is_a_mapping_of_its_own_freed_whole():
    """A pool entry's parts (rows.py) as views of one private anonymous mapping: exact copies of the
    row whatever their dtypes, put back exactly, and unmapped when the entry goes (the heap never
    holds them, so evicting them leaves it no holes); a row under a megabyte stays on the heap."""
    import gc

    from staticrt.caches import row_state

    def mapping_of(address: int) -> str | None:
        """The line of /proc/self/maps whose range holds `address`, if any."""
        with open("/proc/self/maps") as maps:
            for line in maps:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                if low <= address < high:
                    return line.strip()
        return None

    # SmolLM2's K/V rows (30 layers, 3 heads of 64, 556 positions) beside odd-sized parts of other dtypes
    buffers = {f"{k}_{i}": torch.randn(2, 3, 556, 64) for i in range(30) for k in ("key", "value")}
    buffers |= {
        "scale_0": torch.randn(2, 3, 556).half(),
        "codes_0": torch.randint(-128, 127, (2, 5, 7), dtype=torch.int8),
    }
    buffers |= {"lengths_0": torch.tensor([300, 17])}
    saved = row_state.save_row(buffers, 0, 300, 556)
    assert saved.nbytes == 60 * 3 * 300 * 64 * 4 + 3 * 300 * 2 + 5 * 7 + 8
    first, last = saved.parts[0].data_ptr(), saved.parts[-1].data_ptr()
    line = mapping_of(first)
    assert line is not None and line.split()[1] == "rw-p" and not line.endswith("]") and mapping_of(last) == line
    held = lambda buf, r: buf[r, :, :300] if buf.dim() >= 3 and buf.shape[2] == 556 else buf[r]  # noqa: E731
    for part, (name, buf) in zip(saved.parts, buffers.items(), strict=True):
        assert torch.equal(part, held(buf, 0)), name
    restored = {name: torch.zeros_like(buf) for name, buf in buffers.items()}
    row_state.load_row(restored, 1, saved)
    for name, buf in buffers.items():
        assert torch.equal(held(restored[name], 1), held(buf, 0)), name
    del saved, part
    gc.collect()
    assert mapping_of(first) is None and mapping_of(last) is None  # unmapped, not a free chunk kept
    small = row_state.save_row(buffers, 0, 4, 556)  # 184 KB
    assert small.nbytes < row_state.MAPPED_ROW_BYTES and mapping_of(small.parts[0].data_ptr()).endswith("[heap]")


def test_two_pool_entries_holding_the_same_ids_are_told_apart(hf_checkpoints):
    """Two rows of a sliding cache that held the same conversation with different marks both go to
    the pool; restoring the newer one takes that one out (a server's replicas saw it: identical
    requests in a burst), as itself."""
    from staticrt.serve.rows import RowMemory

    model = staticrt.load_model(hf_checkpoints["mistral-sw16"][0])
    backend = staticrt.Generator(model, max_batch_size=2, cache="sliding", max_cache_len=64).backend
    memory = RowMemory(backend, reuse=True, pool_bytes=2**20)
    memory.held = [[1, 2, 3, 4], [1, 2, 3, 4]]
    memory.beyond[1] = 6  # a tail written past its ids
    memory.seat(0, 0, order=0)
    memory.seat(1, 0, order=1)  # both overwritten: two entries, the same ids
    older, newer = memory.pool
    row, kept, saved = memory.best([1, 2, 3, 4, 5], [0, 1])
    assert (row, kept, saved) == (0, 4, newer)
    memory.seat(row, kept, 2, saved)
    assert memory.pool == [older] and memory.held[0] == [1, 2, 3, 4]


def test_a_failing_pool_costs_the_prefix_and_never_the_request(hf_checkpoints, caplog, monkeypatch):
    """A pool that cannot copy a row (here: out of memory) seats the request with nothing kept, its
    row forgotten, and says so; the scheduler's thread goes on (a failure there hung its rows)."""
    from staticrt.serve.rows import RowMemory

    backend = staticrt.Generator(staticrt.load_model(hf_checkpoints["llama"][0]), max_batch_size=2).backend
    memory = RowMemory(backend, reuse=True, pool_bytes=2**20)
    memory.held = [[1, 2, 3, 4], []]

    def no_room(row: int, length: int) -> None:
        raise MemoryError("no room")

    monkeypatch.setattr(backend, "stash_row", no_room)
    assert memory.seat(0, 2, order=0) == 0
    assert memory.held[0] == [] and memory.pool == []
    assert "the host pool failed (MemoryError: no room); the request prefills its whole prompt" in caplog.text


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_weights_and_an_int8_cache_reuse_a_row_exactly(hf_checkpoints, quantize):
    """int8/int4 weights and a static-int8 cache (K/V int8 with a scale a token): a conversation
    that keeps its row gives the answers of one that prefills every turn whole."""
    model = staticrt.load_model(hf_checkpoints["llama"][0], quantize=quantize)
    build = lambda: staticrt.Generator(model, cache="static-int8", max_cache_len=128)  # noqa: E731
    _, kept_answers, kept = converse(build())
    _, whole_answers, none = converse(build(), reuse=False)
    assert kept_answers == whole_answers and all(kept[1:]) and not any(none)


def test_a_rest_wider_than_the_widest_continuing_graph_goes_in_chunks(hf_checkpoints, monkeypatch):
    """With continuing graphs only 16 wide (REUSE_WIDTH 16), a request that keeps the 12-token
    system prompt prefills its 30 other tokens in two continuing chunks of 16 (no 32-wide
    continuing graph is ever built): a lone generate's tokens, and the compiled server never
    recompiles."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    import staticrt.serve

    monkeypatch.setattr(staticrt.serve, "REUSE_WIDTH", 16)
    model = staticrt.load_model(hf_checkpoints["llama"][0])
    build = lambda rows: staticrt.Generator(model, max_batch_size=rows, max_cache_len=64, backend="compiled")  # noqa: E731
    prefiller = build(1).backend
    app, _ = staticrt.serve.serve_backend(build(1).backend, name="tiny", prefiller=prefiller)
    long = SYSTEM + list(range(30, 60))
    with torch._dynamo.config.patch(error_on_recompile=True), running(app) as url:
        api = client(url)
        api.completions.create(model="tiny", prompt=SYSTEM + [5, 6], max_tokens=3, temperature=0)
        reply = api.completions.create(model="tiny", prompt=long, max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == 12
    assert reply.choices[0].model_extra["token_ids"] == build(1).generate([long], 6)[0]
    continuing = {key for key in prefiller._graphs if not key[2] and key[0] > 1}  # beside the lone row's decode
    assert continuing == {(16, "pick", False)}  # 16 only
