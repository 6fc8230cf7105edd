"""`staticrt bench-serve --workload chat`: conversations that share a system prompt, each client
sending its turns one after another (serve_load.py), on `staticrt serve` with prefix reuse and
without (`--no-prefix-reuse`), and on llama.cpp's server (llama-cpp-python's `llama_cpp.server`,
which keeps its one context's prefix between requests, served one at a time) when the model is a
GGUF file: time to first token and throughput, and their ratios with reuse and without."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import GenerationError
from .serve_bench import (
    ServeBenchRequest,
    Stage,
    checkpoint_folder,
    speculative_ratios,
    staticrt_command,
)
from .serve_load import chat_workload
from .server_process import measure_server


def llamacpp_command(gguf: str, request: ServeBenchRequest) -> list[str]:
    """llama.cpp's server through llama-cpp-python: one context of `max_cache_len` tokens, requests
    served one at a time, each reusing the prefix its context holds from the one before."""
    command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "bench"]
    # its default cuts a streaming answer short when the next request arrives: let each finish
    command += ["--n_ctx", str(request.max_cache_len), "--host", "127.0.0.1", "--interrupt_requests", "False"]
    return command + (
        ["--n_threads", str(request.threads), "--n_threads_batch", str(request.threads)] if request.threads else []
    )


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
    if request.model.endswith(".gguf"):
        contenders["llama_cpp"] = (llamacpp_command(request.model, request), "bench", "/v1/models")
    results: dict[str, Any] = {}
    for name, (command, model, health) in contenders.items():
        if name == "llama_cpp" and importlib.util.find_spec("llama_cpp") is None:
            results[name] = {"error": "llama-cpp-python is not installed: pip install 'staticrt[llamacpp]'"}
            continue
        on_stage(f"{name}: {request.concurrency} conversations of {request.turns} turns ({turns} requests)")
        try:
            results[name] = measure_server(command, model, request, load, health)
        except GenerationError as err:
            if name.startswith("staticrt"):
                raise
            results[name] = {"error": str(err)}
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
