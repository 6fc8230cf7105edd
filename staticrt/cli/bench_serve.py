"""`staticrt bench-serve`: run the serving benchmark, show it as a table, write the JSON report."""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ..bench import write_report
from ..bench.machine import describe
from ..bench.serve_bench import ServeBenchRequest, run_serve_bench
from ..bench.serve_chat import run_chat_bench
from ..bench.soak import plot_soak, run_soak_bench
from ..errors import ConfigError
from .console import console, progress, show_table
from .session import model_device


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.kill_every is not None and (args.workload != "soak" or not args.replicas):
        raise ConfigError("--kill-every kills replicas during a soak: give it with --workload soak --replicas N")
    transformers = not args.no_transformers and importlib.util.find_spec("transformers") is not None
    if not args.no_transformers and not transformers:
        console.print("[yellow]transformers is not installed: skipping transformers serve[/]")
    request = ServeBenchRequest(
        model=args.model,
        backend=args.backend,
        max_batch_size=args.max_batch_size,
        concurrency=args.concurrency,
        requests=args.requests,
        prompt_range=args.prompt_len,
        output_range=args.output_len,
        prefill_buckets=tuple(sorted(args.prefill_buckets)),
        threads=args.threads,
        duration_s=float(args.duration),
        seed=args.seed,
        transformers=transformers,
        stream_interval=args.stream_interval,
        device=model_device(args.device, args.backend),
        workload=args.workload,
        turns=args.turns,
        system_len=args.system_len,
        speculative=args.speculative,
        structured=args.structured,
        replicas=args.replicas,
        kill_every_s=args.kill_every,
        quantize=args.quantize,
    )
    if request.workload == "soak":
        return _soak(request, args)
    with progress("bench-serve") as update:
        report = (run_chat_bench if request.workload == "chat" else run_serve_bench)(request, on_stage=update)
    _show(request, report, args.format)
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    return 0 if not any(r.get("failed") or "error" in r for r in report["results"].values()) else 1


def _soak(request: ServeBenchRequest, args: argparse.Namespace) -> int:
    """The soak's timeline as a table, its JSON and plot; exit 1 on a server error or a row left busy."""
    with progress("bench-serve soak") as update:
        report = run_soak_bench(request, on_stage=update)
    soak = report["results"]["staticrt"]
    rows = [
        [s["t_s"] / 60, s["rss_mb"], s["fds"], s["threads"], s["busy_rows"], s["queue"],
         _ms(s["ttft"], "p99_ms"), _ms(s["itl"], "p50_ms"), _ms(s["itl"], "p99_ms"), s["answers"].get("5xx", 0)]
        for s in soak["samples"]
    ]  # fmt: skip
    columns = ["minute", "RSS MB", "fds", "threads", "busy", "queue", "TTFT p99", "ITL p50", "ITL p99", "5xx"]
    title = f"soak: {request.model} ({request.backend}), {request.max_batch_size} rows, {request.concurrency} clients"
    show_table(f"{title}, {describe(report['machine'])}", columns, rows, args.format)
    verdict = soak["summary"]
    console.print(", ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in verdict.items() if v is not None))
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_soak(soak, str(args.plot))
        console.print(f"wrote {args.plot}")
    if "replicas" in soak:
        kills = soak["replicas"]
        console.print(
            f"{len(kills['kills'])} replicas killed, streaming {kills['streaming_at_kills']}; streams lost "
            f"{verdict['lost_streams']}, requests sent again {kills['retried']:g}, slowest recovery "
            f"{kills['slowest_recovery_s']} s"
        )
    lost = verdict["lost_streams"] if "replicas" not in soak else 0  # only a killed replica may lose a stream
    return 0 if verdict["server_errors"] == verdict["unanswered"] == verdict["rows_busy_at_end"] == lost == 0 else 1


def _ms(stats: dict[str, Any] | None, key: str) -> Any:
    value = (stats or {}).get(key)
    return "-" if value is None else float(value)


def _show(request: ServeBenchRequest, report: dict[str, Any], fmt: str) -> None:
    rows = []
    for name, r in report["results"].items():
        if "error" in r:
            console.print(f"[red]{name}: {r['error']}[/]", soft_wrap=True)
            continue
        done = f"{r['requests'] - r.get('failed', 0)}/{r['requests']}"
        latencies = [_ms(r.get(key), p) for key in ("ttft", "itl", "tpot") for p in ("p50_ms", "p99_ms")]
        cached = [r.get("cached_prompt_tokens", "-")] if request.workload == "chat" else []
        rows.append([name, done, r["output_tokens"], r["output_tokens_per_s"], *latencies, *cached])
    title = (
        f"{request.model} ({request.backend}), {request.max_batch_size} rows, {request.concurrency} clients, "
        f"{describe(report['machine'])}, {request.stream_interval} token(s) a chunk"
    )
    columns = ["contender", "done", "tokens", "tok/s"]
    columns += [f"{key} {p} ms" for key in ("TTFT", "ITL", "TPOT") for p in ("p50", "p99")]
    if request.workload == "chat":
        title += f"; chat: a system prompt of {request.system_len} tokens, {request.turns} turns a client"
        columns.append("prompt tokens kept")
    show_table(title, columns, rows, fmt)
    for name, r in report["results"].items():
        for error in r.get("errors", []):
            console.print(f"[red]{name}: {error}[/]", soft_wrap=True)
    for key, value in report.get("throughput_ratios", {}).items():
        console.print(f"throughput {key}: {value:.2f}x")
    for key, value in {**report.get("reuse_ratios", {}), **report.get("speculative_ratios", {})}.items():
        console.print(f"{key.replace('_', ' ')}: {value:.2f}x" if value is not None else f"{key}: -")
    structured = report.get("structured")
    if structured:
        console.print(
            f"on a JSON schema: throughput {structured['throughput_json_over_plain']:.2f}x the plain server's; "
            f"llguidance's mask {structured['mask_us_per_token_per_row']:.1f} µs a token a row "
            f"({structured['mask_tokens_timed']} tokens timed)"
        )
    ray = report.get("ray_ratios")
    if ray:
        console.print(
            f"Ray: throughput {ray['throughput_ray_over_plain']:.2f}x the plain server's, "
            f"TTFT p50 {ray['ttft_p50_ms_added_by_ray']:+.1f} ms"
        )
