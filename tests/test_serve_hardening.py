"""The server against hostile and careless clients (issue 40): no request crashes it, stalls the
other rows, slips past a limit, runs after it was refused, or is answered with a traceback; and a
fuzz test of the whole HTTP API that ends with every row free and a normal answer."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import staticrt

pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")

from serving import running  # noqa: E402

from staticrt.bench.serve_bench import checkpoint_folder  # noqa: E402
from staticrt.cli.main import main  # noqa: E402
from staticrt.errors import ConfigError  # noqa: E402
from staticrt.serve import serve_backend  # noqa: E402
from staticrt.serve.app import create_app  # noqa: E402
from staticrt.text.generation_config import GenerationDefaults  # noqa: E402
from staticrt.text.stop_strings import StopStrings  # noqa: E402

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tiny-llama with a word-level tokenizer (t0 .. t511) and a chat template."""
    path = checkpoint_folder("tiny-llama", tmp_path_factory.mktemp("hardening"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return staticrt.load_model(folder)


def backend(model, rows: int = 2, seconds: float = 0.0):
    """An eager backend of `rows` rows, each step taking at least `seconds`."""
    backend = staticrt.Generator(model, max_batch_size=rows, max_cache_len=96, backend="eager").backend
    step = backend.step

    def slow(*args):
        time.sleep(seconds)
        return step(*args)

    backend.step = slow
    return backend


def server(model, rows: int = 2, seconds: float = 0.0, **options):
    return serve_backend(backend(model, rows, seconds), model.tokenizer, name=MODEL, **options)


def post(url: str, body: dict, path: str = "completions", **kw) -> httpx.Response:
    """`body` as JSON with its non-ASCII escaped, as clients send it: a lone surrogate becomes "\\ud800"."""
    raw = json.dumps(body).encode()
    return httpx.post(f"{url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=30, **kw)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def greedy(url: str) -> list[int]:
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0)
    reply = post(url, body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_out_of_range_sampling_never_reaches_the_stepping_thread(model):
    """top_k 2**63 (from a request, or from generation_config.json) overflowed the step's int64
    outside its error handling and killed the stepping thread; it means every token, as in generate."""
    app, _ = server(model, defaults=GenerationDefaults(top_k=2**63))
    with running(app) as url:
        expected = greedy(url)
        for body in (dict(temperature=1.0), dict(temperature=1.0, top_k=2**63), dict(temperature=1.0, top_k=10**30)):
            reply = post(url, dict(model=MODEL, prompt=[1, 2], max_tokens=4, seed=3, **body))
            assert reply.status_code == 200, reply.text
            assert len(reply.json()["choices"][0]["token_ids"]) == 4
        assert greedy(url) == expected
        assert metric(url, "staticrt_busy_rows") == 0.0


def test_a_request_that_cannot_be_seated_fails_alone_and_the_server_goes_on(model, monkeypatch):
    """An error while seating a request (choosing its row, restoring what it keeps), outside any
    step, ended the stepping thread: every later request waited forever. It fails that request
    alone, and leaves no row taken by it."""
    from staticrt.serve.rows import RowMemory

    best, seat, failures = RowMemory.best, RowMemory.seat, []

    def failing(original):
        def call(memory, *args):
            if failures:
                raise RuntimeError(failures.pop())
            return original(memory, *args)

        return call

    app, _ = server(model)
    with running(app) as url:
        expected = greedy(url)
        for method in ("best", "seat"):
            for name, original in (("best", best), ("seat", seat)):
                monkeypatch.setattr(RowMemory, name, failing(original) if name == method else original)
            failures.append(f"{method} broke")
            reply = post(url, dict(model=MODEL, prompt=[9, 9, 9], max_tokens=4, temperature=0))
            assert reply.status_code == 500
            assert reply.json()["error"]["message"] == f"seating the request failed: RuntimeError('{method} broke')"
            assert greedy(url) == expected
            assert metric(url, "staticrt_busy_rows") == 0.0


def test_stop_strings_are_bounded(model):
    app, _ = server(model)
    with running(app) as url:
        cases = [
            (["a", "b", "c", "d", "e"], "stop holds 5 strings; at most 4: send fewer"),
            ("x" * 1025, "a stop string has 1025 characters; each needs 1 to 1024: shorten it"),
            (["ok", ""], "a stop string has 0 characters; each needs 1 to 1024: drop it"),
            (7, "stop is int; send a string or a list of up to 4 strings"),
        ]
        for stop, message in cases:
            reply = post(url, dict(model=MODEL, prompt="t1 t2", stop=stop))
            assert reply.status_code == 400, stop
            assert (reply.json()["error"]["param"], reply.json()["error"]["message"]) == ("stop", message)
        assert post(url, dict(model=MODEL, prompt="t1 t2", stop="x" * 1024, max_tokens=3)).status_code == 200


def _naive(text: str, stops: list[str]) -> tuple[int | None, int]:
    """What the stop check must find, by definition: the first start of any stop string, and the
    longest proper prefix of a stop string that the text ends with."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    held = max((n for s in stops for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)
    return (min(found) if found else None), held


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    stops=st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4),
    pieces=st.lists(st.text("abc", max_size=5), max_size=12),
)
def test_stop_strings_found_as_the_text_grows_are_those_of_the_whole_text(stops, pieces):
    matcher, text = StopStrings(stops), ""
    for piece in pieces:
        cut = matcher.feed(piece)
        text += piece
        first, held = _naive(text, stops)
        if cut is not None:
            assert cut == first
            return
        assert first is None and matcher.held == held


def test_a_chunked_body_is_refused_as_it_passes_the_limit(model):
    """With Transfer-Encoding: chunked there is no content-length: the server counted the body only
    once it had all of it. Here the body never ends, so only a count as bytes arrive answers."""
    app, _ = server(model)
    with running(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"x" * 65536
            for _ in range(17):  # 1.06 MiB, past the 1 MiB limit; no final 0-length chunk
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head[:100]
        assert greedy(url)


def test_an_empty_api_key_is_refused_by_name(model, monkeypatch, capsys):
    scheduler = server(model)[1]
    with pytest.raises(ConfigError, match="the API key is empty, which would leave the server open"):
        create_app(scheduler, None, api_key="")
    serve = ["serve", "--model", "tiny-llama", "--port", "1"]
    assert main([*serve, "--api-key", ""]) == 2
    monkeypatch.setenv("STATICRT_API_KEY", "")
    assert main(serve) == 2
    said = capsys.readouterr()
    err = said.out + said.err
    assert "--api-key is empty, which would leave the server open to anyone" in err
    assert "STATICRT_API_KEY is empty, which would leave the server open to anyone" in err


def test_a_refused_request_never_runs_and_ignored_features_are_refused_by_name(model):
    app, _ = server(model)
    cases = [
        (dict(stream=True, stream_options=["include_usage"]), "stream_options"),
        (dict(stream="yes"), "stream"),
        (dict(logprobs=21), "logprobs"),  # past the 20 a step returns
        (dict(logit_bias={"5": 101}), "logit_bias"),  # out of [-100, 100]
        (dict(echo=True), "echo"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(min_p=0.1), "min_p"),
        (dict(best_of=3), "best_of"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(prompt="t1 \ud800 t2"), "prompt"),
    ]
    with running(app) as url:
        for extra, param in cases:
            reply = post(url, {"model": MODEL, "prompt": "t1 t2", "max_tokens": 5, **extra})
            assert reply.status_code == 400, (extra, reply.text)
            assert reply.json()["error"]["param"] == param
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "t1 \udc80"}])
        assert post(url, chat, "chat/completions").json()["error"]["param"] == "messages"
        assert metric(url, "staticrt_generated_tokens_total") == 0.0  # nothing ran for a refused request
        harmless = dict(logprobs=None, logit_bias={}, echo=False, presence_penalty=0, best_of=1, stop_token_ids=[])
        assert post(url, {"model": MODEL, "prompt": "t1 t2", "max_tokens": 2, **harmless}).status_code == 200


def test_a_chat_template_that_raises_is_a_400_naming_it(model, folder, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "chat_template.jinja").write_text("{{ (messages | length) // 0 }}")
    app, _ = serve_backend(backend(model), staticrt.load_model(broken).tokenizer, name=MODEL)
    with running(app) as url:
        reply = post(url, dict(model=MODEL, messages=[{"role": "user", "content": "t1"}]), "chat/completions")
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "messages"
        assert "failed on the conversation (ZeroDivisionError: integer division or modulo by zero)" in reply.text


def test_the_queue_counts_only_requests_beyond_the_free_rows(model):
    """--max-queue 0 refused every request of an idle server, saying every row was busy."""
    app, scheduler = server(model, rows=1, seconds=0.02, max_queue=0)
    with running(app) as url:
        assert greedy(url)  # an idle server with no queue seats it
        body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=40, temperature=0, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()
            next(lines)  # in the one row
            refused = post(url, body)
            assert refused.status_code == 429
            assert "all 1 rows are busy and 0 requests wait (--max-queue 0)" in refused.json()["error"]["message"]


def test_a_request_cancelled_while_queued_is_counted(model):
    app, scheduler = server(model, rows=1, seconds=0.02)
    body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=30, temperature=0, stream=True)
    with running(app) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()
            next(lines)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30):
                deadline = time.monotonic() + 10
                while not scheduler.waiting and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert len(scheduler.waiting) == 1
            list(lines)  # the first runs to its end; the queued one left before it had a row
        deadline = time.monotonic() + 10
        while metric(url, 'staticrt_requests_finished_total{outcome="cancelled"}') < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(url, 'staticrt_requests_finished_total{outcome="cancelled"}') == 1.0
        assert metric(url, 'staticrt_requests_finished_total{outcome="length"}') == 1.0


def test_a_drain_that_runs_out_answers_503_and_ends_streams_with_an_error_and_done(model):
    """The README promises 503 for requests still open when --drain-timeout runs out: a whole answer
    got a bare 500 and a stream was cut without an error event or [DONE]."""
    app, scheduler = server(model, rows=2, seconds=0.05)
    body = dict(model=MODEL, prompt=[1, 2, 3], max_tokens=80, temperature=0)
    with running(app) as url:
        whole: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: whole.append(post(url, body)))
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            waiter.start()
            while scheduler.busy_rows < 2:
                time.sleep(0.01)
            scheduler.stop(drain_s=0.2)
            events = [line for line in (first, *lines) if line]
        waiter.join(30)
        refused = post(url, body)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == "the server stopped before this request finished"
    assert whole[0].status_code == 503
    assert whole[0].json()["error"]["message"] == "the server stopped before this request finished"
    assert refused.status_code == 503


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = {
    "model": st.just(MODEL) | JSON,
    "prompt": st.text("t0123 ", max_size=30) | st.lists(st.integers(-5, 600), max_size=20) | JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}))
    | JSON,
    "max_tokens": st.integers(-2, 200) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-1, 2) | JSON,
    "top_k": st.sampled_from([0, 1, 511, 512, 2**31, 2**63 - 1, 2**63, 2**64]) | st.integers(-5, 2**64) | JSON,
    "seed": st.sampled_from([0, 2**32, 2**63, 2**64]) | st.integers(-5, 2**64) | JSON,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=6) | JSON,
    "stop_token_ids": st.lists(st.integers(-5, 600), max_size=3) | JSON,
    "stream": st.just(True) | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "n": st.integers(0, 3) | JSON,
}
# a valid request with one to three of its fields replaced or added, so that most examples get past
# the first check and reach what runs after it (sampling is on: the default temperature is 1)
VALID = {"model": MODEL, "prompt": "t1 t2", "messages": [{"role": "user", "content": "t3"}], "max_tokens": 4}
BODIES = (
    st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True)
    .flatmap(lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names}))
    .map(lambda fields: {**VALID, **fields})
)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_any_body_is_refused_by_name_or_checked_into_range(model, body, chat):
    """What reaches the stepping thread: plain numbers in range, or nothing (a 400 naming a field)."""
    from staticrt.serve.job import check_request
    from staticrt.serve.protocol import BadRequest, Limits, chat_prompt, check_fields, completion_prompt
    from staticrt.serve.protocol import completion_request as checked_request

    rows = backend(model)
    limits = Limits(MODEL, rows.max_sequence_len, rows.vocab_size, rows.eos_token_ids, GenerationDefaults())
    try:
        check_fields(body)
        tokenizer = model.tokenizer
        prompt = chat_prompt(body, tokenizer)[0] if chat else completion_prompt(body, tokenizer, limits.vocab_size)
        request = check_request(rows, tokenizer, checked_request(body, prompt, limits, chat))
    except BadRequest as err:
        assert err.param is None or err.param in body or err.param in ("max_tokens", "prompt", "messages")
        return
    except staticrt.GenerationError:
        return
    sampling = request.sampling
    assert all(type(v) in (int, float, bool) for v in (sampling.temperature, sampling.top_k, sampling.top_p))
    assert 0 <= sampling.top_k < rows.vocab_size and 0 < sampling.top_p <= 1 and 0 < sampling.temperature <= 2
    assert all(0 <= t < rows.vocab_size for t in (*request.prompt, *request.stop_token_ids))
    assert 1 <= request.max_tokens <= rows.max_sequence_len - len(request.prompt)
    assert len(request.stop) <= 4 and all(1 <= len(s) <= 1024 for s in request.stop)


class Errors(logging.Handler):
    """The records at ERROR and above, whoever logs them: uvicorn's loggers do not propagate to the
    root logger, where caplog listens, so its "Exception in ASGI application" would go unseen."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzzed(model):
    app, scheduler = server(model, rows=2)
    errors = Errors()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "staticrt")]
    with running(app) as url:
        for logger in loggers:
            logger.addHandler(errors)
        try:
            yield url, scheduler, errors
        finally:
            for logger in loggers:
                logger.removeHandler(errors)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans(), chunked=st.booleans(), leave_after=st.none() | st.integers(0, 3))
def test_any_body_gets_an_answer_and_never_a_500(fuzzed, body, chat, chunked, leave_after):
    url, scheduler, errors = fuzzed
    raw = json.dumps(body).encode()
    content = iter([raw[: len(raw) // 2], raw[len(raw) // 2 :]]) if chunked else raw
    path = f"{url}/v1/{'chat/completions' if chat else 'completions'}"
    with httpx.stream("POST", path, content=content, timeout=30) as reply:
        assert reply.status_code in (200, 400, 429), reply.read()
        lines = reply.iter_lines()
        for i, _ in enumerate(lines):  # a client that leaves at a random point, or reads to the end
            if leave_after is not None and i >= leave_after:
                break
    assert [r.getMessage() for r in errors.records] == []


def test_after_the_fuzz_every_row_is_free_and_a_normal_request_is_answered(fuzzed):
    url, scheduler, errors = fuzzed
    deadline = time.monotonic() + 20
    while (scheduler.busy_rows or scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (scheduler.busy_rows, len(scheduler.waiting)) == (0, 0)
    assert greedy(url)


@contextlib.contextmanager
def served(command: list[str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """`command` (a `staticrt serve` with `--port PORT` to fill) on a free loopback port, once
    `/health` answers; yields the process and its URL, killed on leaving."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([*command, "--port", str(port)], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield server, url
    finally:
        server.kill()
        server.wait()


def test_sigterm_with_requests_past_the_drain_timeout_ends_them_with_503_and_exits(tmp_path):
    """The same through `staticrt serve` and a real SIGTERM, where uvicorn used to cancel what was
    still open at --drain-timeout: a stream cut without an error event or [DONE]. bench-llama's
    2,000 tokens take many seconds on any CPU, so the 1 s drain always runs out mid-stream."""
    command = [sys.executable, "-m", "staticrt.cli", "serve", "--model", "bench-llama"]
    command += ["--max-cache-len", "2048", "--prefill-buckets", "16", "--drain-timeout", "1"]
    with served(command) as (server, url):
        body = dict(model="bench-llama", prompt=[1, 2, 3], max_tokens=2000, temperature=0, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            server.send_signal(signal.SIGTERM)
            events = [line for line in (first, *lines) if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["message"] == "the server stopped before this request finished"
        assert server.wait(30) == -signal.SIGTERM
        assert "Traceback" not in server.stderr.read()


def test_an_idle_server_stops_on_a_sigterm_the_os_hands_to_another_thread():
    """The OS hands a process's signal to any thread that does not block it (uvicorn's, OpenMP's);
    Python runs the handler in the main thread, where `serve` steps, and an idle one slept on its
    condition until a request came: the signal stopped nothing (bench-serve waited 60 s, then
    killed it). Here a thread of the server's own sends SIGTERM to itself once told, so the
    main thread is never the one the OS picks."""
    to_itself = (
        "import signal, sys, threading; from staticrt.cli.main import main; "
        "threading.Thread(target=lambda: (sys.stdin.readline(), "
        "signal.pthread_kill(threading.get_ident(), signal.SIGTERM)), daemon=True).start(); "
        "sys.exit(main(sys.argv[1:]))"
    )
    with served([sys.executable, "-c", to_itself, "serve", "--model", "tiny-llama", "--threads", "1"]) as (server, url):
        assert httpx.get(f"{url}/health").json()["busy_rows"] == 0
        server.stdin.write("now\n")
        server.stdin.flush()
        assert server.wait(20) == -signal.SIGTERM
        assert "stopping: no new requests" in server.stderr.read()


def test_a_server_that_dies_starting_leaves_its_whole_log_named_in_the_error(tmp_path, monkeypatch):
    """bench-serve's server on a GPU died in the compiler: the 2000-character tail held inductor's
    frames alone, and the line naming the graph it compiled was lost with the temporary log."""
    import re
    import sys

    from staticrt.bench.server_process import server_process
    from staticrt.errors import GenerationError

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dies = [sys.executable, "-c", "print('compiling the prefill64_greedy step graph'); print('x' * 3000); exit(3)"]
    with pytest.raises(GenerationError, match=r"exited with 3 \(its whole log: (\S+)\):\n") as raised:
        with server_process(dies, 1, timeout_s=30):
            pass
    kept = re.search(r"its whole log: (\S+)\)", str(raised.value)).group(1)
    assert kept.startswith(str(tmp_path))
    assert open(kept).read().startswith("compiling the prefill64_greedy step graph\n")
