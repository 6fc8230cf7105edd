"""`staticrt bench`: run the benchmark, show it as a table, write the JSON report."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench import run_bench, write_report
from ..bench.chat_turns import chat_turns
from ..bench.cold_start import PHASES, cold_start
from ..bench.machine import describe
from ..bench.speculative import speculative_bench
from .console import console, progress, show_table


def cmd_bench(args: argparse.Namespace) -> int:
    if args.cold_start is not None:
        return _cold_start(args)
    if args.chat_turns is not None:
        return _chat_turns(args)
    if args.speculative is not None or args.draft is not None:
        return _speculative(args)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "hf" in backends:
        try:
            import transformers  # noqa: F401
        except ImportError:
            console.print(
                "[yellow]transformers is not installed: skipping the hf backend (pip install 'staticrt[hf]')[/]"
            )
            backends.remove("hf")
    from ..loading.gguf_folders import local_checkpoint

    with progress("benchmarking") as update:
        report = run_bench(
            str(local_checkpoint(args.model)),  # every contender reads the folder a .gguf converts into
            backends,
            new_tokens=args.new_tokens,
            prompt_len=args.prompt_len,
            batch_size=args.batch_size,
            repeats=args.repeats,
            threads=args.threads,
            dtype=args.dtype,
            window=args.window,
            quantize=tuple(q.strip() for q in args.quantize.split(",") if q.strip()),
            gguf=tuple(g.strip() for g in (args.gguf or "").split(",") if g.strip()),
            offload=args.offload,
            kv_int8=args.kv_int8,
            device=args.device,
            on_stage=update,
        )
    if args.json:  # first: minutes of timing are not lost to a failure in what follows
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    _show(args, report)
    if args.plot:
        from ..bench.plot import plot_report

        plot_report(report, args.plot)
        console.print(f"drew {args.plot}")
    if not report["tokens_agree"]:
        console.print("[red]backends produced different tokens[/]")
    return 0 if report["tokens_agree"] else 1


def _show(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rows = [
        [
            name,
            r["prompt_len"],
            "-" if r["compile_s"] is None else r["compile_s"],
            r["prefill_ms"],
            r["decode_ms_per_token"],
            r["tokens_per_s"],
            r["kv_bytes_per_step"] / 1e6,
            _cache_mb(r),
            100 * r["streaming_fraction"],
            100 * r["streaming_fraction_with_kv"],
        ]
        for name, r in report["backends"].items()
    ]
    title = f"{args.model}, batch {args.batch_size}, {report['device']}, {describe(report['machine'])}"
    if args.window:
        title += f", sliding window {args.window}"
    columns = ["backend", "prompt", "compile s", "prefill ms", "ms/token", "tok/s", "K/V MB read"]
    columns += ["cache MB device/host", "% bound", "% bound +K/V"]
    show_table(title, columns, rows, args.format)
    console.print(
        "% bound: weight bytes a decode step reads over the step time, against the streaming rate "
        "sampled before and after each of that backend's timed runs; +K/V adds the cache the step reads",
        soft_wrap=True,
    )
    rates = ", ".join(f"{name} {r['matvec_bytes_per_s'] / 1e9:.1f}" for name, r in report["backends"].items())
    weights = ", ".join(f"{q} {b / 1e6:.1f}" for q, b in report["weight_bytes_per_step"].items())
    console.print(
        f"weights read per decode step (MB): {weights}; matrix-vector streaming rate (GB/s): {rates}",
        soft_wrap=True,
    )
    for name, r in report["backends"].items():
        if "kernel" in r:
            console.print(f"{name} multiplies its weights with {r['kernel']}", soft_wrap=True)
    moved = {name: r for name, r in report["backends"].items() if "host_transfer_ms" in r}
    if moved:
        steps = ", ".join(
            f"{name} {r['decode_ms_per_token']:.2f} ms = {r['step_over_host_transfer']:.2f}x "
            f"its {r['host_transfer_ms']:.2f} ms"
            for name, r in moved.items()
        )
        console.print(
            f"pinned host-to-device copy {report['host_copy_bytes_per_s'] / 1e9:.1f} GB/s; an offloaded step against "
            f"copying its cache from the host: {steps}",
            soft_wrap=True,
        )
    for key, value in report["ratios"].items():
        console.print(f"{key}: {value:.2f}x")


def _cache_mb(result: dict[str, Any]) -> str:
    if "cache_device_bytes" not in result:  # transformers' cache is not ours to weigh
        return "-"
    return f"{result['cache_device_bytes'] / 1e6:.1f}/{result['cache_host_bytes'] / 1e6:.1f}"


def _cold_start(args: argparse.Namespace) -> int:
    gguf = tuple(g.strip() for g in (args.gguf or "").split(",") if g.strip())
    with progress("cold starts") as update:
        report = cold_start(args.cold_start, gguf, args.threads, on_stage=update)
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    rows = [
        [label, *(v for phase in PHASES for v in (r[phase]["s"], r[phase]["peak_rss_mb"])), r["warm"]["tokens"][0]]
        for label, r in report["programs"].items()
    ]
    columns = ["program", "cold s", "cold peak MB", "warm s", "warm peak MB", "first token"]
    title = f"{args.cold_start}: a fresh process to its first token, {describe(report['machine'])}"
    show_table(title, columns, rows, args.format)
    for label, how in report["not_run"].items():
        console.print(f"[yellow]{label} not run: {how}[/]")
    console.print(
        f"before these, a one-time CPU-ISA probe of {report['isa_probe_s']:.1f} s that every inductor user pays once "
        "a machine; peak RSS is each process's own (the compiler's subprocesses are not counted)"
    )
    if not report["tokens_agree"]:
        console.print("[red]programs produced different tokens[/]")
    return 0 if report["tokens_agree"] else 1


def _chat_turns(args: argparse.Namespace) -> int:
    backend = args.backends.split(",")[0].strip()
    with progress("chat turns") as update:
        report = chat_turns(args.model, args.chat_turns, backend, args.threads, args.new_tokens, on_stage=update)
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    rows = [
        [
            row["turn"],
            row["reuse"]["prompt_tokens_kept"],
            row["reuse"]["first_token_warm_ms"],
            row["no_reuse"]["first_token_warm_ms"],
            row["first_token_no_reuse_over_reuse"],
        ]
        for row in report["turns"]
    ]
    columns = ["turn", "tokens kept", "first token ms (reuse)", "first token ms (none)", "ratio"]  # compile excluded
    title = f"staticrt chat {args.model} ({backend}), {describe(report['machine'])}"
    show_table(title, columns, rows, args.format)
    if not report["answers_agree"]:
        console.print("[red]the answers with and without prefix reuse differ[/]")
    return 0 if report["answers_agree"] else 1


def _speculative(args: argparse.Namespace) -> int:
    from ..generation.speculative import parse_draft
    from ..loading.gguf_folders import local_checkpoint

    draft = None if args.draft is None else parse_draft(args.draft, args.speculative)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    backend = next((b for b in backends if b != "hf"), "compiled")
    with progress("speculative decoding") as update:
        report = speculative_bench(
            str(local_checkpoint(args.model)),
            args.speculative,
            backend,
            args.threads,
            args.new_tokens,
            args.repeats,
            with_hf="hf" in backends,
            on_stage=update,
            draft=None if draft is None else (str(local_checkpoint(draft[0])), draft[1]),
        )
    if args.json:
        write_report(report, args.json)
        console.print(f"wrote {args.json}")
    columns = ["kind", "prompt", "tokens", "tok/s", "tok/s spec", "speedup", "accepted", "hf tok/s", "hf spec"]
    keys = ["kind", "prompt", "new_tokens", "plain_tok_s", "speculative_tok_s", "speedup"]
    rows = [
        [*(r[k] for k in keys), f"{r['accepted']}/{r['drafted']}", r.get("hf_tok_s"), r.get("hf_speculative_tok_s")]
        for r in report["prompts"]
    ]
    show_table(
        f"{args.model} ({backend}), {args.speculative or 'draft ' + args.draft}, {describe(report['machine'])}",
        columns,
        rows,
        args.format,
    )
    for kind, summary in report["summary"].items():
        console.print(f"{kind}: decode {summary['speedup_geomean']:.2f}x with speculation (geometric mean)")
    return 0
