"""A server held under mixed load for a duration, sampled as it goes (issue 68's soak): clients that
read whole answers, read streams to their end, cancel streams mid-way, send and leave without
reading, arrive in bursts past the queue, send prompts near the end of the context and send
garbage, greedy and sampled. Every `interval_s` it records the server process's RSS, descriptors
and threads, its busy rows and queue (/metrics), the streams' time to first token and inter-token
latency, and the answers' statuses; the report says whether anything grew, slowed or failed.
`bench-serve --workload soak` runs it on a server process (with `--replicas`, on Ray, replicas killed
as it goes: soak_replicas.py); tests/test_soak.py on one in-process. The clients are soak_load.py's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .server_process import metric
from .soak_load import SoakLoad


def process_sample(pid: int) -> dict[str, float]:
    """The process's resident memory (MB), open descriptors and threads, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(status["Threads"])}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": float(np.percentile(values, 50)) * 1e3, "p99_ms": float(np.percentile(values, 99)) * 1e3}


def server_probe(url: str, pid: int) -> dict[str, float]:
    """A plain server's sample: its process's numbers, its busy rows, queue and host pool (/metrics)."""
    return {
        **process_sample(pid),
        "pool_mb": metric(url, "staticrt_prefix_pool_bytes") / 2**20,  # grows to --cache-ram by design
        "busy_rows": metric(url, "staticrt_busy_rows"),
        "queue": metric(url, "staticrt_queue_length"),
    }


def _answer(status: int) -> str:
    """An answer's column in a sample: 502 is a stream ended by an error event (a replica lost)."""
    if status == 0:
        return "none"
    if status == 502:
        return "lost"
    return "5xx" if status >= 500 else "429" if status == 429 else f"{status // 100}xx"


def run_soak(
    load: SoakLoad,
    pid: int,
    clients: int,
    duration_s: float,
    interval_s: float,
    probe: Callable[[], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """`clients` clients for `duration_s` seconds, a sample every `interval_s`; then the server is
    given 30 s to free its rows. `probe` reads the server's numbers (`server_probe` of `pid` by
    default). The report's `samples` are the timeline, `summary` the verdict."""
    probe = probe or (lambda: server_probe(load.url, pid))
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    taken: Counter = Counter()

    def sample() -> None:
        with load.lock:
            ttft, itl, load.ttft_s, load.itl_s = load.ttft_s, load.itl_s, [], []
            new = Counter(load.statuses) - taken
        taken.update(new)
        answers: Counter = Counter()
        for (_, status), n in new.items():
            answers[_answer(status)] += n
        samples.append(
            {"t_s": round(time.monotonic() - start, 1), **probe(), "ttft": _percentiles(ttft),
             "itl": _percentiles(itl), "answers": dict(answers)}
        )  # fmt: skip

    sample()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(load.client, seed, start + duration_s) for seed in range(clients)]
        next_at = start + interval_s
        while not all(f.done() for f in futures):
            time.sleep(min(0.5, max(0.0, next_at - time.monotonic())))
            if time.monotonic() >= next_at:
                sample()
                next_at += interval_s
        for future in futures:
            future.result()
    load.close()  # its idle connections too: the server's descriptors are counted next
    settle = time.monotonic() + 30
    while (now := probe())["busy_rows"] or now["queue"]:
        if time.monotonic() > settle:
            break
        time.sleep(0.2)
    sample()
    statuses = {f"{kind} {status}": n for (kind, status), n in sorted(load.statuses.items())}
    return {"samples": samples, "statuses": statuses, "no_answer": dict(load.failures), "summary": summary(samples)}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 68's verdict, scaled to the duration: RSS at the end against a sixth of the way in
    (minute 5 of 60 is about that, once warm), also less the host pool, which fills to --cache-ram
    with the rows requests leave (the server's own memory must stay flat beside it); p99
    inter-token latency in the last sixth against the first; server errors, rows at the end,
    descriptors and threads against the warm sample."""
    sixth = max(1, len(samples) // 6)
    first, last = samples[1 : 1 + sixth] or samples[:1], samples[-1 - sixth : -1] or samples[-1:]
    warm = samples[min(sixth, len(samples) - 1)]
    p99 = lambda window: max((s["itl"]["p99_ms"] or 0.0) for s in window) or None  # noqa: E731
    end = samples[-1]
    return {
        "rss_end_over_warm": end["rss_mb"] / warm["rss_mb"],
        "rss_less_pool_end_over_warm": (end["rss_mb"] - end["pool_mb"]) / (warm["rss_mb"] - warm["pool_mb"]),
        "itl_p99_last_over_first": (p99(last) / p99(first)) if p99(last) and p99(first) else None,
        "server_errors": sum(s["answers"].get("5xx", 0) for s in samples),
        "lost_streams": sum(s["answers"].get("lost", 0) for s in samples),  # ended by an error event
        "unanswered": sum(s["answers"].get("none", 0) for s in samples),  # no answer within 120 s
        "rows_busy_at_end": end["busy_rows"],
        "queue_at_end": end["queue"],
        "fd_growth": end["fds"] - warm["fds"],
        "thread_growth": end["threads"] - warm["threads"],  # from the warm sample: pools grow to their bounds first
    }


def plot_soak(report: dict[str, Any], path: str) -> None:
    """The timeline as four panels: memory, descriptors and threads, latency, answers; a red line
    at each replica killed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    axes[0].plot(minutes, [s["rss_mb"] for s in samples], label="RSS")
    axes[0].plot(minutes, [s["pool_mb"] for s in samples], label="host pool (--cache-ram)")
    axes[0].set_ylabel("MB")
    axes[0].legend()
    axes[1].plot(minutes, [s["fds"] for s in samples], label="descriptors")
    axes[1].plot(minutes, [s["threads"] for s in samples], label="threads")
    axes[1].legend()
    for key, style in (("ttft", "-"), ("itl", "--")):
        for p in ("p50_ms", "p99_ms"):
            axes[2].plot(minutes, [s[key][p] for s in samples], style, label=f"{key.upper()} {p[:3]}")
    axes[2].set_ylabel("ms")
    axes[2].set_yscale("log")
    axes[2].legend(fontsize=7)
    for answer in ("2xx", "4xx", "429", "5xx", "lost", "none"):
        axes[3].plot(minutes, [s["answers"].get(answer, 0) for s in samples], label=answer)
    axes[3].set_ylabel("answers / sample")
    axes[3].set_xlabel("minutes")
    axes[3].legend()
    for kill in report.get("replicas", {}).get("kills", []):  # the soak with replicas killed
        for axis in axes:
            axis.axvline(kill["t_s"] / 60, color="red", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_soak_bench(request: Any, on_stage: Any = lambda _: None) -> dict[str, Any]:
    """`bench-serve --workload soak`: staticrt serve on `request.model` (a process of its own,
    `request.max_batch_size` rows and as many queued), held by `request.concurrency` clients for
    `request.duration_s` seconds; a sample a minute (a tenth of the duration when shorter)."""
    import tempfile

    from ..generation.buckets import chunk_end
    from .machine import machine
    from .serve_bench import checkpoint_folder, staticrt_command
    from .server_process import server_process
    from .soak_replicas import ReplicaKiller, kill_summary, ray_probe

    interval = max(5.0, min(60.0, request.duration_s / 10))
    with tempfile.TemporaryDirectory(prefix="staticrt-soak-") as work:
        on_stage(f"writing {request.model} as a checkpoint folder")
        folder = checkpoint_folder(request.model, Path(work))
        from ..text.tokenizer import load_tokenizer

        vocab = load_tokenizer(folder).backend.get_vocab_size()
        rows = request.max_batch_size
        command = [*staticrt_command(folder, request), "--max-queue", str(rows)]  # the last wins
        command += ["--speculative", request.speculative] if request.speculative else []
        command += ["--replicas", str(request.replicas)] if request.replicas else []
        on_stage(f"staticrt serve ({request.backend}; starting, compiling)")
        with server_process(command, request.threads) as (url, pid):
            context, answer = request.max_cache_len, 8  # a long prompt's answer is under 8 tokens
            fits = [n for n in range(1, context) if chunk_end(request.prefill_buckets, n) <= context - answer]
            load = SoakLoad(url, "bench", vocab, rows, rows, context, longest=max(fits))
            on_stage(f"{request.concurrency} clients for {request.duration_s:g} s, a sample every {interval:g} s")
            probe = (lambda: ray_probe(url, pid)) if request.replicas else None
            start = time.monotonic()
            killer = None
            if request.kill_every_s:  # the CLI allows it only with replicas
                killer = ReplicaKiller(url, request.kill_every_s, start, start + request.duration_s)
                killer.start()
            try:
                soak = run_soak(load, pid, request.concurrency, request.duration_s, interval, probe)
            finally:
                if killer is not None:
                    killer.stop()
            if killer is not None:
                soak["replicas"] = kill_summary(killer.kills, [t - start for t in load.answered_at], url)
    settings = {**request.__dict__, "max_cache_len": request.max_cache_len, "sample_s": interval}
    return {"settings": settings, "machine": machine(), "results": {"staticrt": soak}}
