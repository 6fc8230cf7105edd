"""A minute of mixed load on one server (issue 68's short form): clients that read whole answers,
read streams to their end, cancel streams mid-way, send and leave without reading, arrive in
bursts past the queue, send prompts near the end of the context and send garbage, greedy and
sampled. No answer is a 5xx, every stream read to its end ends with a finish reason, and at the
end every row and the queue are free, and the server holds no more threads (but for the event
loop's bounded executor) or file descriptors than after its first requests."""

from __future__ import annotations

import os
import random
import re
import threading

import pytest

import staticrt

pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")

from serving import running  # noqa: E402

from staticrt.bench.server_process import metric  # noqa: E402
from staticrt.bench.soak import plot_soak, run_soak  # noqa: E402
from staticrt.bench.soak_load import SoakLoad  # noqa: E402
from staticrt.serve import serve_backend  # noqa: E402

MODEL, ROWS, QUEUE, CONTEXT = "tiny-llama", 4, 4, 128
SOAK_S, CLIENTS, SAMPLE_S = 60.0, 8, 10.0


# the event loop's default executor (asyncio.to_thread: the server parses bodies there) grows on
# demand to this many threads, its bound, named uvloop_N or asyncio_N
EXECUTOR = min(32, (os.cpu_count() or 1) + 4)


def _threads() -> tuple[int, int]:
    """This process's threads: (outside the loop's executor, in it)."""
    pool = sum(bool(re.fullmatch(r"(uvloop|asyncio)_\d+", t.name)) for t in threading.enumerate())
    return threading.active_count() - pool, pool


def test_a_minute_of_mixed_load_leaves_no_5xx_no_busy_row_and_no_growth(tmp_path):
    pytest.importorskip("matplotlib", reason="the soak's plot needs matplotlib: install the test extra")
    gen = staticrt.Generator(staticrt.load_model(MODEL), max_batch_size=ROWS, max_cache_len=CONTEXT)
    app, _ = serve_backend(gen.backend, name=MODEL, max_queue=QUEUE)
    with running(app) as url:
        load = SoakLoad(url, MODEL, 256, ROWS, QUEUE, CONTEXT)
        load.burst(random.Random(0))  # the server as it is once it has served
        threads, fds = _threads(), len(os.listdir("/proc/self/fd"))
        report = run_soak(load, os.getpid(), CLIENTS, SOAK_S, SAMPLE_S)
        statuses = load.statuses
        assert not [key for key in statuses if key[1] >= 500], statuses
        assert statuses[("whole", 200)] and statuses[("stream", 200)] and statuses[("burst", 429)], statuses
        assert {status for (kind, status) in statuses if kind == "garbage"} == {400}, statuses
        assert statuses[("cancel", 200)] and metric(url, 'staticrt_requests_finished_total{outcome="cancelled"}')
        now = (_threads(), len(os.listdir("/proc/self/fd")))
        assert now[0][0] <= threads[0] and now[0][1] <= EXECUTOR and now[1] <= fds + 8, (now, threads, fds)
    # the report: a sample every SAMPLE_S and one after the settling, latencies timed, the verdict
    samples, verdict = report["samples"], report["summary"]
    assert len(samples) >= SOAK_S / SAMPLE_S + 1 and samples[-1]["t_s"] >= SOAK_S
    assert all(s["itl"]["p50_ms"] is not None for s in samples[1:-1])
    assert sum(sum(s["answers"].values()) for s in samples) == sum(statuses.values())
    assert (verdict["server_errors"], verdict["rows_busy_at_end"], verdict["queue_at_end"]) == (0, 0, 0)
    plot_soak(report, str(tmp_path / "soak.png"))
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_bench_serve_soak_writes_its_timeline_and_verdict(tmp_path):
    """`staticrt bench-serve --workload soak` on a server process of its own: the JSON holds a
    sample a tenth of the duration (5 s at least) with the process's own numbers, and the plot."""
    import json

    from staticrt.cli.main import main

    pytest.importorskip("matplotlib", reason="the soak's plot needs matplotlib: install the test extra")
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    command = ["bench-serve", "--model", MODEL, "--backend", "eager", "--workload", "soak", "--duration", "12"]
    assert main([*command, "--concurrency", "4", "--max-batch-size", "2", "--json", str(out), "--plot", str(plot)]) == 0
    report = json.loads(out.read_text())
    soak = report["results"]["staticrt"]
    assert report["settings"]["sample_s"] == 5.0 and len(soak["samples"]) >= 3
    assert all(s["rss_mb"] > 50 and s["fds"] > 3 and s["threads"] >= 1 for s in soak["samples"])
    # the host pool (serve's default --cache-ram) takes the rows requests left: its bytes are in the timeline
    assert soak["samples"][-1]["pool_mb"] > 0 and soak["summary"]["rss_less_pool_end_over_warm"] > 0
    assert soak["summary"]["server_errors"] == 0 and soak["summary"]["rows_busy_at_end"] == 0
    # the long prompts are as long as the server admits, not longer: its model has a tokenizer, so
    # only the garbage and the bursts past the queue are refused
    refused = [k for k in soak["statuses"] if k.split()[0] in ("whole", "stream", "cancel", "leave")]
    assert [k for k in refused if k.split()[1] not in ("200", "429")] == [], soak["statuses"]
    assert plot.stat().st_size > 10_000


def test_a_refused_client_backs_off_as_the_openai_client_does(monkeypatch):
    """A client answered 429 waits 0.5 s, then 1, 2, 4, 8 (jittered down by at most a quarter)
    before it sends again, and stops at its deadline; the statuses count every answer."""
    import time

    import staticrt.bench.soak_load as soak_load

    sent: list[float] = []
    monkeypatch.setattr(soak_load, "KINDS", ("whole",))
    monkeypatch.setattr(SoakLoad, "whole", lambda self, rng: sent.append(time.monotonic()) or 429)
    load = SoakLoad("http://127.0.0.1:9", MODEL, 256, ROWS, QUEUE, CONTEXT)
    load.client(0, time.monotonic() + 4.0)
    gaps = [later - earlier for earlier, later in zip(sent, sent[1:])]
    assert len(sent) == 4 and all(0.75 * 2**i / 2 <= gap <= 2**i / 2 + 0.2 for i, gap in enumerate(gaps)), gaps
    assert load.statuses == {("whole", 429): 4}


def test_the_replica_soak_reads_each_kills_recovery_from_the_answers_timeline(monkeypatch):
    """bench/soak_replicas.py's verdict on a timeline: 20 answers a second, a kill at 30 s that
    halves them for 12 s: the minute before gives 200 a 10-second window, and the first window
    after the kill that holds 160 of them (80%) is [38, 48) s, 40 at the half rate and 120 at the
    whole: it ends 18 s after the kill."""
    import numpy as np

    from staticrt.bench import soak_replicas

    counts = {"staticrt_replica_lost_streams_total": 1, "staticrt_replica_retries_total": 3}
    monkeypatch.setattr(soak_replicas, "metric", lambda url, name: counts[name])
    times = [*np.arange(0, 30, 0.05), *np.arange(30, 42, 0.1), *np.arange(42, 90, 0.05)]
    kills = [{"t_s": 30.0, "replica": "r (pid 1)", "holding": 2, "streaming": 1}]
    verdict = soak_replicas.kill_summary(kills, times, "http://x")
    assert verdict["kills"][0]["rate_before"] == pytest.approx(200, abs=1)
    assert verdict["kills"][0]["recovery_s"] == 18.0 and verdict["slowest_recovery_s"] == 18.0
    assert (verdict["streaming_at_kills"], verdict["lost_streams_ingress"], verdict["retried"]) == (1, 1, 3)
