"""Fewer busy rows than rows: a row decoding alone decodes in the batch-1 prefiller (planning.py's
`_lone`), its cache row copied between the prefiller and the server's rows only when the other side
is about to read it (serve/prefiller_row.py); busy rows within the first n decode in a twin of n
rows over the same cache storage (`narrow_backends`). The tokens stay a lone generate's."""

from __future__ import annotations

import threading
import time

import pytest

import staticrt

SYSTEM = list(range(100, 112))


class Recorder:
    """Wraps backends' `step` and `adopt_row`: which backend stepped (and how wide), and each copy;
    `delay_s` slows the decode steps of those named in `slow`."""

    def __init__(self, backends: dict, delay_s: float = 0.0, slow: tuple[str, ...] = ("prefiller",)):
        self.events: list[str] = []
        self.lock = threading.Lock()
        for name, backend in backends.items():
            self._wrap(backend, name, delay_s if name in slow else 0.0)

    def _wrap(self, backend, name: str, delay_s: float) -> None:
        step, adopt = backend.step, backend.adopt_row

        def stepped(input_ids, *args, **kwargs):
            with self.lock:
                self.events.append(f"{name}:{input_ids.shape[1]}")
            time.sleep(delay_s if input_ids.shape[1] == 1 else 0.0)
            return step(input_ids, *args, **kwargs)

        def adopted(row, source, source_row):
            with self.lock:
                self.events.append(f"copy into {name}")
            return adopt(row, source, source_row)

        backend.step, backend.adopt_row = stepped, adopted

    def take(self) -> list[str]:
        with self.lock:
            events, self.events = self.events, []
        return events


def test_one_client_decodes_in_the_prefiller_and_a_second_one_hands_the_row_back(hf_checkpoints):
    """Two rows. One client, two turns of a conversation: every step runs in the prefiller (its
    prompts, then its decode steps) and nothing is copied, the second turn keeping the first's
    row. Then a third turn streams while a second client asks: the row is copied back before the
    second client's prompt takes the prefiller, both decode in the rows' backend, and once the
    second client is done the first decodes alone again, its row copied into the prefiller.
    Every answer is a lone generate's."""
    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(hf_checkpoints["llama"][0])
    build = lambda rows: staticrt.Generator(model, max_batch_size=rows, max_cache_len=128)  # noqa: E731
    lone = build(1)
    rows, prefiller = build(2).backend, build(1).backend
    app, _ = serve_backend(rows, name="tiny", prefiller=prefiller)
    # decode steps slow enough for the second client to meet them
    record = Recorder({"rows": rows, "prefiller": prefiller}, delay_s=0.02)
    with running(app) as url:
        api = client(url)

        def ask(prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
            reply = api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
            return reply.choices[0].model_extra["token_ids"], reply.usage.prompt_tokens_details.cached_tokens

        first = SYSTEM + [5, 6, 7]
        answer, cached = ask(first, 6)
        assert (answer, cached) == (lone.generate([first], 6)[0], 0)
        second = first + answer + [8, 9]
        answer, cached = ask(second, 6)
        assert (answer, cached) == (lone.generate([second], 6)[0], len(first) + 5)
        assert record.take() == ["prefiller:16", *["prefiller:1"] * 5] * 2  # no step of the rows, no copy

        third = second + answer + [10, 11, 12]
        stream = api.completions.create(model="tiny", prompt=third, max_tokens=40, temperature=0, stream=True)
        chunks = iter(stream)
        streamed = next(chunks).choices[0].model_extra["token_ids"]  # it decodes alone now
        other = [9] * 10
        assert ask(other, 3)[0] == lone.generate([other], 3)[0]
        streamed += [t for chunk in chunks if chunk.choices for t in chunk.choices[0].model_extra["token_ids"]]
        assert streamed == lone.generate([third], 40)[0]
    events = record.take()
    handed = events.index("copy into rows")  # the first client's row, before the other prompt's prefill
    assert events[0] == "prefiller:16" and set(events[1:handed]) == {"prefiller:1"}  # its rest, then alone
    # the other prompt in the prefiller, copied into its row before the rows' decode steps
    assert events[handed + 1 : handed + 4] == ["prefiller:16", "copy into rows", "rows:1"]
    back = events.index("copy into prefiller", handed)  # the second client done: alone again
    assert events[back - 1] == "rows:1" and set(events[back + 1 :]) == {"prefiller:1"}


def test_busy_rows_within_the_first_two_decode_in_a_twin_of_two_rows(hf_checkpoints):
    """Four rows, and a twin over the first two (the same storage). Two clients at once are seated
    in rows 0 and 1 and decode there, two rows wide; three at once decode four wide; two again take
    rows 0 and 1 rather than row 3, the least recently used. Every answer is a lone generate's."""
    import concurrent.futures

    pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")
    from serving import client, running

    from staticrt.serve import serve_backend

    model = staticrt.load_model(hf_checkpoints["llama"][0])
    build = lambda rows: staticrt.Generator(model, max_batch_size=rows, max_cache_len=64)  # noqa: E731
    lone = build(1)
    rows = build(4).backend
    app, scheduler = serve_backend(rows, name="tiny", prefiller=build(1).backend)
    (twin,) = scheduler.narrow
    assert twin.batch_size == 2 and twin.cache.key_0.data_ptr() == rows.cache.key_0.data_ptr()
    names = {"rows": rows, "twin": twin, "prefiller": scheduler.prefiller}
    record = Recorder(names, delay_s=0.01, slow=tuple(names))  # every decode step: the clients overlap
    prompts = iter([[k + 1] * (3 + k) for k in range(7)])  # no two share a first token: no row keeps a prefix
    with running(app) as url:
        api = client(url)

        def ask(prompt: list[int]) -> list[int]:
            reply = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            return reply.choices[0].model_extra["token_ids"]

        for clients in (2, 3, 2):
            asked = [next(prompts) for _ in range(clients)]
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                assert list(pool.map(ask, asked)) == [lone.generate([p], 12)[0] for p in asked]
            decoded = {event for event in record.take() if event.endswith(":1") and not event.startswith("prefiller")}
            assert decoded == ({"twin:1"} if clients == 2 else {"twin:1", "rows:1"}), clients


@pytest.mark.filterwarnings("ignore::staticrt.caches.OffloadWarning")  # offloaded on a CPU
@pytest.mark.parametrize(
    ("name", "cache"),
    [
        ("gemma2", "hybrid"),
        ("gemma2", "sink"),
        ("mistral-sw16", "sliding-int8"),
        ("lfm2", "static"),  # conv states
        ("granitemoehybrid", "static"),  # Mamba2 states
        ("llama", "offloaded"),
    ],
)
def test_a_twin_views_the_first_rows_of_every_buffer_and_gives_a_narrower_caches_tokens(hf_checkpoints, name, cache):
    """A twin of 2 over a 4-row cache: each of its buffers the first 2 rows of the cache's own
    (the same storage), and its tokens a 2-row cache's. An offloaded cache has none: its write
    targets are the whole batch's."""
    model = staticrt.load_model(hf_checkpoints[name][0])
    wide = staticrt.Generator(model, cache=cache, max_batch_size=4, max_cache_len=64).backend
    twin = wide.narrowed(2)
    if cache == "offloaded":
        assert twin is None
        return
    theirs = dict(wide.cache.named_buffers())
    for part, buf in twin.cache.named_buffers():
        assert buf.shape[0] == 2 and buf.data_ptr() == theirs[part].data_ptr(), part
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    narrow = staticrt.Generator(model, cache=cache, max_batch_size=2, max_cache_len=64)
    assert staticrt.Generator(twin).generate(prompts, 20) == narrow.generate(prompts, 20)
