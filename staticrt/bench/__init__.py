"""Side-by-side decoding benchmarks: staticrt backends and transformers on the same weights, in one
process, one run, so ratios are not skewed by a noisy machine drifting between runs.

`run_bench` is plan (plan.py) -> warm-up (contenders.py, hf.py) -> timed rounds -> summary. Decode
is weight-streaming bound at small batch, so every result is also put against the machine's
streaming rate (probes.py), sampled around each backend's own timed runs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..artifacts.write import write_text_atomically
from ..dtypes import resolve_dtype
from ..errors import BenchError
from ..exporters.onnx_quantize import ACCURACY_LEVEL
from ..loading.checkpoint import checked_device, load_config, load_model
from ..models.decoder import Decoder
from ..models.quantize import QUANTIZED_DTYPES, kernel_name
from .contenders import Contender, staticrt_contender
from .gguf_write import check_writable, write_gguf
from .machine import machine
from .plan import GGUF_TYPES, GRAPH_QUANTIZED, QUANTO_CACHE, BenchRequest, Run, bench_prompts, plan_runs
from .probes import StreamProbe, copy_bytes_per_s, kv_bytes_per_step, weight_bytes_per_step

Stage = Callable[[str], None]
Timings = dict[str, list[tuple[float, float]]]  # label -> (prefill s, decode s a step) per timed round

__all__ = ["BenchError", "BenchRequest", "run_bench", "write_report"]


def run_bench(
    model_name: str, backends: Sequence[str], on_stage: Stage = lambda _: None, **options: Any
) -> dict[str, Any]:
    """Benchmark `backends` on one model in one process; returns the JSON-ready report.
    `options` are `BenchRequest`'s fields (new_tokens, prompt_len, window, offload, device, ...)."""
    request = BenchRequest(model_name, tuple(backends), **options)
    request.check()
    if request.threads:
        torch.set_num_threads(request.threads)
    target = checked_device(request.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device = str(target)
    dtype = resolve_dtype(request.dtype)
    vocab = load_config(model_name).vocab_size
    runs = plan_runs(request, bench_prompts(vocab, request.batch_size, request.prompt_len))
    models = load_variants(request, {run.weights for run in runs}, dtype, device)
    for run in runs:
        if run.gguf in GGUF_TYPES:  # refused before anything compiles
            check_writable(models[run.weights], run.gguf)
    probe = StreamProbe(dtype, target)
    copy_bps = copy_bytes_per_s(target) if target.type == "cuda" else None
    host_bps = copy_bytes_per_s(target, from_host=True) if target.type == "cuda" and request.offload else None
    contenders = warm_up(models, runs, request.new_tokens, on_stage)
    timings, bracket = timed_rounds(contenders, probe, request.repeats, on_stage)
    results = {
        run.label: result(
            request,
            models[run.weights],
            run,
            contenders[run.label],
            timings[run.label],
            [probe.samples[i] for i in sorted(bracket[run.label])],
            copy_bps,
            host_bps,
        )
        for run in runs
    }
    return {
        **{k: v for k, v in dataclasses.asdict(request).items() if k not in ("backends", "threads")},
        "device": device,
        "machine": machine(),
        "matvec_bytes_per_s": statistics.median(probe.samples),  # each backend's own is in its entry
        "copy_bytes_per_s": copy_bps,
        "host_copy_bytes_per_s": host_bps,
        "weight_bytes_per_step": {q: weight_bytes_per_step(m, request.batch_size) for q, m in models.items()},
        "backends": results,
        "ratios": ratios(results),
        "tokens_agree": tokens_agree(results, request.prompt_len),
    }


def tokens_agree(results: dict[str, Any], prompt_len: int) -> bool:
    """Whether every run of the same prompts and float weights chose the same tokens (the
    static-at-window runs differ; quantized weights change the logits, and their kernels round
    differently from their eager form, and an int8 cache changes them too, so their tokens are
    reported, not compared)."""
    compared = {
        json.dumps(r["tokens"])
        for r in results.values()
        if r["prompt_len"] == prompt_len
        and r["quantize"] == "none"
        and "gguf" not in r
        and r["cache"] not in ("static-int8", QUANTO_CACHE)
    }
    return len(compared) < 2


def load_variants(request: BenchRequest, variants: set[str], dtype: torch.dtype, device: str) -> dict[str, Decoder]:
    """The model once each quantize variant ("none": the float weights in `dtype`; quantized ones
    compute in bfloat16, or in float16 when that is `dtype`)."""
    models = {
        variant: load_model(
            request.model,
            dtype=dtype if variant == "none" or dtype in QUANTIZED_DTYPES else None,
            device=device,
            quantize=variant,
        )
        for variant in sorted(variants)
    }
    if request.window is not None:
        for model in models.values():
            with_sliding_window(model, request.window)
    return models


WINDOWED_FAMILIES = ("llama", "mistral")  # what `with_sliding_window` turns into a Mistral unchanged


def with_sliding_window(model: Decoder, window: int) -> Decoder:
    """The same weights as a Mistral-style model whose every layer attends through `window`
    positions: a window changes masks and caches, never a weight, so one model serves both. Only
    a Llama or Mistral is that model (transformers' contender is rebuilt as a Mistral): another
    family's norms, biases, rotary or recurrent layers would be dropped, so it is refused."""
    if model.config.family not in WINDOWED_FAMILIES:
        raise BenchError(
            f"--window runs the model as a Mistral with every layer sliding, which a {model.config.family!r} "
            f"model is not (its own layers and weights would change); use a {' or '.join(WINDOWED_FAMILIES)} "
            "model (bench-llama, smollm2), or leave --window out"
        )
    layers = ("sliding_attention",) * model.config.num_layers
    model.config = dataclasses.replace(model.config, family="mistral", sliding_window=window, layer_types=layers)
    return model


def warm_up(models: dict[str, Decoder], runs: list[Run], new_tokens: int, on_stage: Stage) -> dict[str, Contender]:
    """Every run's contender, built and run once (which compiles and captures); `models` holds
    the weights of each quantize variant."""
    from .hf import hf_contender
    from .llamacpp import llamacpp_contender

    contenders = {}
    for run in runs:
        on_stage(f"{run.label}: warm-up (compiles) on {len(run.prompts[0])} prompt + {new_tokens} new tokens")
        model = models[run.weights]
        if run.gguf in GGUF_TYPES:  # the model written as a GGUF; llama.cpp maps it, the file may go
            with tempfile.TemporaryDirectory(prefix="staticrt-gguf-") as folder:
                path = write_gguf(model, Path(folder) / f"model.{run.gguf}.gguf", run.gguf)
                contenders[run.label] = llamacpp_contender(path, run.prompts, new_tokens, source="bench model")
        elif run.gguf is not None:
            contenders[run.label] = llamacpp_contender(run.gguf, run.prompts, new_tokens)
        elif run.backend == "hf":
            contenders[run.label] = hf_contender(model, run.prompts, new_tokens, run.cache)
        else:
            contenders[run.label] = staticrt_contender(
                model, run.backend, run.prompts, new_tokens, run.cache, run.max_cache_len, run.quantize
            )
    return contenders


def timed_rounds(
    contenders: dict[str, Contender], probe: StreamProbe, repeats: int, on_stage: Stage
) -> tuple[Timings, dict[str, set[int]]]:
    """Rounds that take every contender in turn, so a drift of the machine's speed falls on all
    of them alike, with the streaming rate sampled between any two timed generations. Returns the
    timings and, per contender, the indices of the probe samples taken around its runs."""
    timings: Timings = {label: [] for label in contenders}
    bracket: dict[str, set[int]] = {label: set() for label in contenders}
    for round_ in range(repeats):
        on_stage(f"timed round {round_ + 1} of {repeats}: {', '.join(contenders)}")
        for label, contender in contenders.items():
            probe.sample()
            bracket[label].update((len(probe.samples) - 1, len(probe.samples)))
            timings[label].append(contender.run())
    probe.sample()
    return timings, bracket


def result(
    request: BenchRequest,
    model: Decoder,
    run: Run,
    contender: Contender,
    timings: list[tuple[float, float]],
    samples: list[float],
    copy_bps: float | None,
    host_bps: float | None = None,
) -> dict[str, Any]:
    """One run's entry: times, tokens, what the backend reports, and the fractions of the bound."""
    prefill_s = statistics.median(p for p, _ in timings)
    step_s = statistics.median(d for _, d in timings)
    res: dict[str, Any] = {
        "prefill_ms": 1000 * prefill_s,
        "decode_ms_per_token": 1000 * step_s,
        "tokens_per_s": request.batch_size / step_s,
        "first_run_s": contender.warmup_s,
        "compile_s": contender.compile_s,
        "tokens": contender.tokens,
        **contender.report(),
    }
    if "graph_gpu_ms" in res:
        res["host_overhead_us"] = 1e6 * step_s - 1e3 * res["graph_gpu_ms"]
    # llama.cpp reads its GGUF's tensors (the file, less its metadata)
    weight_bytes = res.get("gguf_bytes") or contender.weight_bytes or weight_bytes_per_step(model, request.batch_size)
    kv_dtype = torch.float16 if run.gguf else model.embed_tokens.weight.dtype  # llama.cpp's cache: f16
    kv_bytes = kv_bytes_per_step(model.config, request.batch_size, run.attended, kv_dtype, run.cache.endswith("-int8"))
    if run.cache == QUANTO_CACHE:  # it dequantizes all it holds every step
        kv_bytes = res["cache_device_bytes"]
    stream_bps = statistics.median(samples)
    if run.quantize != "none" or run.gguf:
        res["kernel"] = quantized_kernel(run, model)
    res.update(
        cache=run.cache,
        quantize=run.quantize,
        prompt_len=len(run.prompts[0]),
        weight_bytes_per_step=weight_bytes,
        kv_bytes_per_step=kv_bytes,
        matvec_bytes_per_s=stream_bps,
        matvec_samples=samples,
        streaming_fraction=weight_bytes / step_s / stream_bps,
        streaming_fraction_with_kv=(weight_bytes + kv_bytes) / step_s / stream_bps,
    )
    if copy_bps:  # the CUDA goal's measure: weight + K/V bytes a step reads against a device copy
        res["bandwidth_fraction"] = (weight_bytes + kv_bytes) / step_s / copy_bps
    if host_bps and res.get("cache_host_bytes"):  # the offload goal: a step against its host-to-device copy
        res["host_transfer_ms"] = 1000 * res["cache_host_bytes"] / host_bps
        res["step_over_host_transfer"] = 1000 * step_s / res["host_transfer_ms"]
    return res


def quantized_kernel(run: Run, model: Decoder) -> str:
    """What multiplies a quantized run's weights: llama.cpp's own, ONNX Runtime's MatMulNBits (its
    graph quantizes itself, onnx_quantize.py), or the torch kernel of the model's spec."""
    if run.gguf:
        return f"llama.cpp's {run.label.removeprefix('llamacpp-')} dot products (ggml, built here for this CPU)"
    if run.backend in GRAPH_QUANTIZED:
        return f"ONNX Runtime com.microsoft.MatMulNBits (accuracy_level {ACCURACY_LEVEL}: int8 activations)"
    return kernel_name(model.quantization, model.embed_tokens.weight.device)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Decode speedups against transformers; for sliding, offloaded and quantized-cache runs (staticrt's
    int8, transformers' QuantizedCache), their step cost over the same backend's Static cache of the
    same attended length; for ONNX Runtime, its step cost over the compiled torch backend; for a
    quantized variant, its speedup over the same run on the float weights; for every run, its
    speedup over each llama.cpp run."""
    step = {label: res["decode_ms_per_token"] for label, res in results.items()}
    found = {}
    for label, res in results.items():
        for other in step:
            if other.startswith("llamacpp-") and not label.startswith("llamacpp-"):
                found[f"{label}_decode_speedup_vs_{other}"] = step[other] / step[label]
        float_label = label.replace(f"-{res['quantize']}", "", 1)
        if res["quantize"] != "none" and float_label in step:
            found[f"{label}_decode_speedup_vs_{float_label}"] = step[float_label] / step[label]
        if "hf" in step and label != "hf":
            found[f"{label}_decode_speedup_vs_hf"] = step["hf"] / step[label]
        compiled = label.replace("onnx", "compiled", 1)
        if label.startswith("onnx") and compiled in step:
            found[f"{label}_decode_cost_vs_{compiled}"] = step[label] / step[compiled]
        base, _, variant = label.rpartition("-")
        static = f"{base}-static" if f"{base}-static" in step else base  # "hf" is transformers' static cache
        if variant in ("sliding", "offloaded", "kvint8", "kvquanto") and static in step:
            found[f"{label}_step_cost_vs_static"] = step[label] / step[static]
    return found


def write_report(report: dict[str, Any], path: Path) -> None:
    """Atomic: a reader never sees half a JSON file."""
    write_text_atomically(Path(path), json.dumps(report, indent=2) + "\n")
