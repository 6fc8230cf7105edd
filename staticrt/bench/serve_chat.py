"""`staticrt bench-serve --workload chat`: conversations that share a system prompt, each client
sending its turns one after another (serve_load.py), on `staticrt serve` with prefix reuse and
without (`--no-prefix-reuse`), and on llama.cpp's own `llama-server` (llama_server.py: a slot a row,
continuous batching, each slot's prompt kept) when the model is a GGUF file: time to first token and
throughput, and their ratios with reuse and without."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .llama_server import llama_server_result
from .serve_bench import (
    ServeBenchRequest,
    Stage,
    checkpoint_folder,
    speculative_ratios,
    staticrt_command,
)
from .serve_load import chat_workload
from .server_process import measure_server


def run_chat_bench(request: ServeBenchRequest, on_stage: Stage = lambda _: None) -> dict[str, Any]:
    """The chat workload on staticrt serve with prefix reuse and without, and on llama.cpp's
    server where the model is a GGUF file; TTFT and throughput ratios of reuse against none."""
    from ..text.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="staticrt-bench-serve-") as work:
        on_stage(f"writing {request.model} as a checkpoint folder")
        folder = checkpoint_folder(request.model, Path(work))
        tokenizer = load_tokenizer(folder)
        return _chat_bench(request, folder, tokenizer, tokenizer.backend.get_vocab_size(), on_stage)


def _chat_bench(
    request: ServeBenchRequest, folder: Path, tokenizer: Any, vocab: int, on_stage: Stage
) -> dict[str, Any]:
    from .machine import machine

    load = chat_workload(
        tokenizer,
        vocab,
        request.concurrency,
        request.turns,
        request.system_len,
        request.prompt_range,
        request.output_range,
        request.seed,
    )
    turns = request.concurrency * request.turns
    command = staticrt_command(folder, request)
    contenders = {
        "staticrt": (command, "bench", "/health"),
        "staticrt_no_reuse": ([*command, "--no-prefix-reuse"], "bench", "/health"),
    }
    if request.speculative:
        contenders["staticrt_speculative"] = ([*command, "--speculative", request.speculative], "bench", "/health")
    results: dict[str, Any] = {}
    for name, (command, model, health) in contenders.items():
        on_stage(f"{name}: {request.concurrency} conversations of {request.turns} turns ({turns} requests)")
        results[name] = measure_server(command, model, request, load, health)
    if request.model.endswith(".gguf"):
        results["llama_server"] = llama_server_result(request, load, on_stage)
    on, off = results["staticrt"], results["staticrt_no_reuse"]
    ratios = {
        "ttft_p50_no_reuse_over_reuse": off["ttft"]["p50_ms"] / on["ttft"]["p50_ms"] if on["ttft"]["p50_ms"] else None,
        "throughput_reuse_over_no_reuse": on["output_tokens_per_s"] / off["output_tokens_per_s"]
        if off["output_tokens_per_s"]
        else None,
    }
    settings = {**request.__dict__, "max_cache_len": request.max_cache_len}
    report = {"settings": settings, "machine": machine(), "results": results, "reuse_ratios": ratios}
    return {**report, **speculative_ratios(results)}
