"""Side-by-side decoding benchmarks: staticrt backends and transformers on the same weights, in one
process, one run, so ratios are not skewed by a noisy machine drifting between runs.

Decode is weight-streaming bound at small batch, so every result is also put against the
machine's measured streaming rate: the bytes/s of a large matrix-vector product of the model's
dtype, timed in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .caches import CacheSpec
from .checkpoint import load_model, resolve_dtype
from .config import ModelConfig
from .generate import Generator
from .model import Decoder

STAGE = Callable[[str], None]


class BenchError(ValueError):
    """A benchmark request that cannot be run as asked; names the option and the fix."""


def weight_bytes_per_step(model: Decoder, batch_size: int) -> int:
    """Bytes of weights one decode step reads: every matrix once, but of an untied embedding
    table only the looked-up rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head is not None:
        total -= embed.numel() * embed.element_size()
        total += batch_size * embed.shape[1] * embed.element_size()
    return total


class StreamProbe:
    """The streaming rate of a large matrix-vector product on `device`: the bound a decode step
    can approach. This machine's memory bandwidth drifts by 20% and more from minute to minute
    (other tenants share it), so the rate is sampled next to each timed run (`sample` before
    every repeat and after the last) rather than once per process: a backend's fraction of the
    bound then compares times taken under the same conditions. The matrix is allocated once."""

    def __init__(self, dtype: torch.dtype, device: torch.device, mib: int = 256) -> None:
        cols = 8192
        rows = mib * 2**20 // (cols * torch.finfo(dtype).bits // 8)
        self.matrix = torch.randn(rows, cols).to(dtype=dtype, device=device)  # [rows, 8192]
        self.vector = torch.randn(cols).to(dtype=dtype, device=device)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        self.samples: list[float] = []

    def sample(self, repeats: int = 15) -> float:
        """Bytes/s of the median of `repeats` products after 3 warm-up ones; kept in `samples`."""
        for _ in range(3):
            torch.mv(self.matrix, self.vector)
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            torch.mv(self.matrix, self.vector)
            self.sync()
            times.append(time.perf_counter() - start)
        rate = self.matrix.numel() * self.matrix.element_size() / statistics.median(times)
        self.samples.append(rate)
        return rate


def copy_bytes_per_s(device: torch.device, mib: int = 1024, repeats: int = 20) -> float:
    """A CUDA device's memory bandwidth as a device-to-device copy of `mib` MiB measures it (bytes
    read plus bytes written a second): the yardstick of the CUDA-graph decode goal."""
    source = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    target.copy_(source)
    start.record()
    for _ in range(repeats):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * repeats / (start.elapsed_time(end) / 1000)


def graph_gpu_s(graph: torch.cuda.CUDAGraph, write_index: torch.Tensor, position: int, repeats: int = 50) -> float:
    """Seconds of GPU time one replay of a decode `graph` takes, from CUDA events around each
    replay (the host's share of a step is the step's wall time minus this). The graph advances its
    own `write_index` buffer, so it is set back to `position` before each replay, outside the events."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        write_index.fill_(position)
        start.record()
        graph.replay()
        end.record()
    pairs[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) / 1000


def bench_prompts(vocab: int, batch_size: int, prompt_len: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, size=prompt_len).tolist() for _ in range(batch_size)]


@dataclasses.dataclass
class Contender:
    """A backend warmed up (compiled, captured) and ready to be timed: `run` times one generation
    and returns (prefill seconds, median decode seconds a step); `finish` adds what is read off it
    once timing is over."""

    run: Callable[[], tuple[float, float]]
    tokens: list[list[int]]
    warmup_s: float
    finish: Callable[[list[float]], dict[str, Any]] = lambda decode: {}


def staticrt_contender(
    model: Decoder, backend: str, prompts: list[list[int]], new_tokens: int, cache: str = "static",
    max_cache_len: int | None = None,
) -> Contender:
    """A staticrt backend after one warm-up generation (it compiles). The prompt fills its prefill
    bucket exactly, so prefill times carry no padding. Backend "onnx" exports the model with its
    cache to a temporary artifact first and runs it in ONNX Runtime with torch's thread count."""
    max_cache_len = max_cache_len or len(prompts[0]) + new_tokens
    if backend == "onnx":
        gen = _onnx_generator(model, CacheSpec(cache, len(prompts), max_cache_len), len(prompts[0]))
    else:
        gen = Generator(model, cache=cache, max_batch_size=len(prompts), max_cache_len=max_cache_len,
                        backend=backend, prefill_buckets=(len(prompts[0]),))
    start = time.perf_counter()
    tokens = gen.generate(prompts, max_new_tokens=new_tokens)
    warmup_s = time.perf_counter() - start

    def run() -> tuple[float, float]:
        gen.generate(prompts, max_new_tokens=new_tokens)
        return gen.last_stats.prefill_s, statistics.median(gen.last_stats.decode_s)

    def finish(decode: list[float]) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if backend != "onnx":
            extra.update(cache_device_bytes=gen.backend.cache.device_bytes(),
                         cache_host_bytes=gen.backend.cache.host_bytes())
        if backend == "cudagraph" and gen.backend.device.type == "cuda":
            decode_graph = gen.backend.captured[1, False]  # replays write one slot at a position the run used
            gpu_s = graph_gpu_s(decode_graph.graph, decode_graph.inputs["write_index"], len(prompts[0]))
            extra.update(graph_gpu_ms=1000 * gpu_s, host_overhead_us=1e6 * (statistics.median(decode) - gpu_s))
        return extra

    return Contender(run, tokens, warmup_s, finish)


def _onnx_generator(model: Decoder, spec: CacheSpec, bucket: int) -> Generator:
    from .backends.onnx import OnnxBackend
    from .exporters import export_artifact

    scratch = Path(tempfile.mkdtemp(prefix="staticrt-bench-onnx-"))
    try:
        folder = export_artifact(model, spec, [bucket], scratch / "artifact", ["onnx"])
        device = next(model.parameters()).device.type
        return Generator(OnnxBackend(folder, device=device, threads=torch.get_num_threads()))
    finally:  # the session holds the graph and weights in memory; the files may go
        shutil.rmtree(scratch, ignore_errors=True)


def _result(prefill_s: float, decode_s: float, batch: int, tokens: list[list[int]], warmup_s: float) -> dict[str, Any]:
    return {
        "prefill_ms": 1000 * prefill_s,
        "decode_ms_per_token": 1000 * decode_s,
        "tokens_per_s": batch / decode_s,
        "first_run_s": warmup_s,
        "tokens": tokens,
    }


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The transformers config.json that describes the same model, for running presets in transformers."""
    rope: dict[str, Any] = {"rope_type": config.rope.kind, "rope_theta": config.rope.theta}
    if config.rope.kind != "default":
        rope["factor"] = config.rope.factor
    if config.rope.kind == "llama3":
        rope.update(low_freq_factor=config.rope.low_freq_factor, high_freq_factor=config.rope.high_freq_factor,
                    original_max_position_embeddings=config.rope.original_max_position_embeddings)
    cfg = {
        "model_type": config.family, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0,
    }
    if config.sliding_window is not None:
        cfg["sliding_window"] = config.sliding_window
        if config.family != "mistral":  # Mistral windows every layer and takes no layer_types
            cfg["layer_types"] = list(config.layer_types)
    if config.family == "gemma2":
        cfg.update(hidden_activation=config.hidden_act, query_pre_attn_scalar=config.query_pre_attn_scalar,
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
    else:
        cfg["hidden_act"] = config.hidden_act
    if config.family == "qwen2":
        cfg["use_sliding_window"] = config.sliding_window is not None
    return cfg


def hf_model_like(model: Decoder):
    """A transformers model holding the very same weights as `model`."""
    import transformers

    dtype = next(model.parameters()).dtype
    cfg = transformers.AutoConfig.for_model(**hf_config(model.config))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)  # a name that does not match must not leave random weights
    return hf


class _TokenClock:
    """A transformers streamer that timestamps every `put`: the prompt first, then each token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_contender(model: Decoder, prompts: list[list[int]], new_tokens: int) -> Contender:
    """transformers' own static-cache `generate` with its decode step compiled by torch.compile
    (fullgraph, static shapes), on the same weights, timed token by token through a streamer."""
    from transformers import CompileConfig

    device = next(model.parameters()).device
    hf = hf_model_like(model).to(device)
    # Its sliding-window layers branch on a Python int length that grows every step: with static
    # shapes that is a recompile a token (and a hard failure under fullgraph), so there dynamo may
    # turn the int symbolic after the first recompile.
    dynamic = None if model.config.sliding_window else False
    compile_config = CompileConfig(fullgraph=True, dynamic=dynamic, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, cache_implementation="static", compile_config=compile_config,
                  eos_token_id=None, pad_token_id=0)

    def generate() -> tuple[float, float, list[list[int]]]:
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, streamer=clock, **kwargs)
        first = clock.stamps[1] if len(clock.stamps) > 1 else time.perf_counter()
        gaps = np.diff(clock.stamps[1:])
        return first - start, float(np.median(gaps)), out[:, ids.shape[1]:].tolist()

    start = time.perf_counter()
    _, _, tokens = generate()
    return Contender(lambda: generate()[:2], tokens, time.perf_counter() - start)


def with_sliding_window(model: Decoder, window: int) -> Decoder:
    """The same weights as a Mistral-style model whose every layer attends through `window`
    positions: a window changes masks and caches, never a weight, so one model serves both."""
    layers = ("sliding_attention",) * model.config.num_layers
    model.config = dataclasses.replace(model.config, family="mistral", sliding_window=window, layer_types=layers)
    return model


def kv_bytes_per_step(config: ModelConfig, batch_size: int, attended: int, dtype: torch.dtype) -> int:
    """Bytes of K and V a decode step must read when every layer attends to `attended` positions."""
    element = torch.finfo(dtype).bits // 8
    return 2 * config.num_layers * batch_size * config.num_kv_heads * attended * config.head_dim * element


def run_bench(
    model_name: str,
    backends: Sequence[str],
    new_tokens: int = 64,
    prompt_len: int = 32,
    batch_size: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    dtype: str = "float32",
    window: int | None = None,
    offload: bool = False,
    device: str | None = None,
    on_stage: STAGE = lambda _: None,
) -> dict[str, Any]:
    """Benchmark `backends` on one model in one process; returns the JSON-ready report.

    With `window`, every layer gets that sliding window and the prompt must be at least as long:
    each staticrt backend runs twice, with a SlidingWindow cache past the window ("NAME-sliding")
    and with a Static cache of `window` positions ("NAME-static", the same attended length, so
    the only difference is the rotating buffer), and "hf" runs transformers' sliding-window
    static cache on the sliding prompts.

    With `offload`, each staticrt backend runs with a Static cache ("NAME-static") and an
    OffloadedStatic one ("NAME-offloaded") on the same prompts. `device` defaults to CUDA where
    there is one.
    """
    if window is not None and offload:
        raise BenchError("--window and --offload compare different things; run them one at a time")
    if offload and "onnx" in backends:
        raise BenchError("offloaded caches do not export, so --offload cannot run the onnx backend; drop onnx from "
                         "--backends")
    if window is not None and prompt_len < window:
        raise BenchError(
            f"prompt_len {prompt_len} is shorter than window {window}; the sliding benchmark decodes past the "
            f"window, so use --prompt-len {window} or more"
        )
    if window is not None and new_tokens >= window:
        raise BenchError(
            f"new_tokens {new_tokens} must be below window {window}: the Static run holds the window; "
            "ask for fewer --new-tokens"
        )
    if threads:
        torch.set_num_threads(threads)
    torch_dtype = resolve_dtype(dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(model_name, dtype=torch_dtype, device=device)
    if window is not None:
        with_sliding_window(model, window)
    config = model.config
    prompts = bench_prompts(config.vocab_size, batch_size, prompt_len)
    probe = StreamProbe(torch_dtype, torch.device(device))
    copy_bps = copy_bytes_per_s(torch.device(device)) if device == "cuda" else None
    weight_bytes = weight_bytes_per_step(model, batch_size)
    # label -> (backend, cache, prompts, max_cache_len, positions a decode step attends to)
    runs: dict[str, tuple[str, str, list[list[int]], int | None, int]] = {}
    for name in backends:
        if window is None and offload and name != "hf":
            for cache in ("static", "offloaded"):
                runs[f"{name}-{cache}"] = (name, cache, prompts, None, prompt_len + new_tokens)
        elif window is None:
            runs[name] = (name, "static", prompts, None, prompt_len + new_tokens)
        elif name == "hf":
            runs[name] = (name, "sliding", prompts, None, window)
        else:
            runs[f"{name}-sliding"] = (name, "sliding", prompts, prompt_len, window)
            short = [p[: window - new_tokens] for p in prompts]
            runs[f"{name}-static"] = (name, "static", short, window, window)
    contenders: dict[str, Contender] = {}
    for label, (backend, cache, run_prompts, max_cache_len, _) in runs.items():
        on_stage(f"{label}: warm-up (compiles) on {len(run_prompts[0])} prompt + {new_tokens} new tokens")
        if backend == "hf":
            contenders[label] = hf_contender(model, run_prompts, new_tokens)
        else:
            contenders[label] = staticrt_contender(model, backend, run_prompts, new_tokens, cache, max_cache_len)
    # Timed rounds take every contender in turn, so a drift of the machine's speed falls on all of
    # them alike, and the streaming rate is sampled between any two timed generations.
    timings: dict[str, list[tuple[float, float]]] = {label: [] for label in contenders}
    bracket: dict[str, set[int]] = {label: set() for label in contenders}  # probe samples around its runs
    for round_ in range(repeats):
        on_stage(f"timed round {round_ + 1} of {repeats}: {', '.join(contenders)}")
        for label, contender in contenders.items():
            probe.sample()
            bracket[label].update((len(probe.samples) - 1, len(probe.samples)))
            timings[label].append(contender.run())
    probe.sample()
    results: dict[str, Any] = {}
    for label, (backend, cache, run_prompts, max_cache_len, attended) in runs.items():
        contender = contenders[label]
        decode = [d for _, d in timings[label]]
        res = _result(statistics.median(p for p, _ in timings[label]), statistics.median(decode), batch_size,
                      contender.tokens, contender.warmup_s)
        res.update(contender.finish(decode))
        samples = [probe.samples[i] for i in sorted(bracket[label])]
        stream_bps = statistics.median(samples)
        kv_bytes = kv_bytes_per_step(config, batch_size, attended, torch_dtype)
        step_s = res["decode_ms_per_token"] / 1000
        # the weight-streaming bound as the foundation issue defines it, and with the K/V a step reads
        res.update(cache=cache, prompt_len=len(run_prompts[0]), weight_bytes_per_step=weight_bytes,
                   kv_bytes_per_step=kv_bytes, matvec_bytes_per_s=stream_bps, matvec_samples=samples,
                   streaming_fraction=weight_bytes / step_s / stream_bps,
                   streaming_fraction_with_kv=(weight_bytes + kv_bytes) / step_s / stream_bps)
        if copy_bps:  # the CUDA goal's measure: weight + K/V bytes a step reads against a device copy
            res["bandwidth_fraction"] = (weight_bytes + kv_bytes) / step_s / copy_bps
        results[label] = res
    return {
        "model": model_name,
        "dtype": dtype,
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "window": window,
        "offload": offload,
        "device": device,
        "repeats": repeats,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "matvec_bytes_per_s": statistics.median(probe.samples),  # each backend's own is in its entry
        "copy_bytes_per_s": copy_bps,
        "weight_bytes_per_step": weight_bytes,
        "backends": results,
        "ratios": _ratios(results),
        # every run of the same prompts must choose the same tokens (the static-at-window runs differ)
        "tokens_agree": len({json.dumps(r["tokens"]) for r in results.values() if r["prompt_len"] == prompt_len}) == 1,
    }


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """Decode speedups against transformers; for sliding and offloaded runs, their step cost over a
    Static cache of the same attended length (the goals: at most 1.2 for the rotating buffer, 1.5
    for offloading); for ONNX Runtime, its step cost over the compiled torch backend."""
    step = {label: res["decode_ms_per_token"] for label, res in results.items()}
    ratios = {}
    for label in step:
        if "hf" in step and label != "hf":
            ratios[f"{label}_decode_speedup_vs_hf"] = step["hf"] / step[label]
        compiled = label.replace("onnx", "compiled", 1)
        if label.startswith("onnx") and compiled in step:  # the goal: at most 1.2
            ratios[f"{label}_decode_cost_vs_{compiled}"] = step[label] / step[compiled]
        base, _, variant = label.rpartition("-")
        if variant in ("sliding", "offloaded") and f"{base}-static" in step:
            static = f"{base}-static"
            ratios[f"{label}_step_cost_vs_static"] = step[label] / step[static]
    return ratios


def write_report(report: dict[str, Any], path: Path) -> None:
    """Atomic: a reader never sees half a JSON file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def first_token_main(argv: Sequence[str] | None = None) -> None:
    """Child process of `cold_start`: build the generator named on the command line, generate
    one token a row, print the wall-clock time (time.time()) at which the first one arrived."""
    import sys

    mode, source = (argv or sys.argv[1:])[:2]
    stamp: list[float] = []
    if mode == "compiled":
        spec = json.loads(source)
        model = load_model(spec["model"], dtype=spec["dtype"])
        gen = Generator(model, cache=spec["cache"], max_batch_size=spec["batch_size"],
                        max_cache_len=spec["max_cache_len"], window=spec["window"], backend="compiled",
                        prefill_buckets=spec["prefill_buckets"])
    else:
        from .artifact import load_artifact

        gen = load_artifact(source, backend=mode)
    gen.generate([[1, 2, 3]], max_new_tokens=1, stream=lambda row, token: stamp or stamp.append(time.time()))
    print(json.dumps({"first_token_at": stamp[0]}))


def cold_start(artifact: Path, formats: Sequence[str] = ("aoti",), on_stage: STAGE = lambda _: None) -> dict[str, Any]:
    """Seconds from launching a fresh Python process to its first generated token: with the
    artifact's programs, and with the compiled backend on the same model and cache spec.

    Each process gets its own copy of an inductor cache folder that holds only the machine's
    CPU-ISA probe (which inductor, and AOTInductor's loader, compile test programs for once per
    machine: ~20 s on 2 cores, reported as `isa_probe_s`), so the compiled backend reuses no compiled
    graph and the artifact no loader state: program-cold, machine-warm.
    """
    import subprocess
    import sys

    from .artifact import read_manifest

    manifest = read_manifest(artifact)
    recipe = manifest.get("recipe")
    if recipe is None:
        raise BenchError(f"{artifact} records no recipe (model source); export it with `staticrt export`")
    spec = {k: recipe[k] for k in ("model", "dtype", "cache", "batch_size", "max_cache_len", "window",
                                   "prefill_buckets")}
    runs = {fmt: [fmt, str(artifact)] for fmt in formats} | {"compiled": ["compiled", json.dumps(spec)]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        probed = Path(root) / "probed"

        def child(code: str, args: Sequence[str], cache: Path) -> subprocess.CompletedProcess:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
            done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise BenchError(f"cold start child {' '.join(args) or code} failed:\n{done.stderr[-2000:]}")
            return done

        on_stage("probing the CPU ISA once for every process (inductor caches it per machine)")
        start = time.time()
        child("from torch._inductor.cpu_vec_isa import pick_vec_isa; pick_vec_isa()", [], probed)
        results["isa_probe_s"] = time.time() - start
        for label, args in runs.items():
            on_stage(f"cold start: {label} in a fresh process")
            cache = Path(shutil.copytree(probed, Path(root) / label))
            start = time.time()
            done = child("from staticrt.bench import first_token_main; first_token_main()", args, cache)
            results[f"{label}_s"] = json.loads(done.stdout.strip().splitlines()[-1])["first_token_at"] - start
    for fmt in formats:
        results[f"compiled_over_{fmt}"] = results["compiled_s"] / results[f"{fmt}_s"]
    return {"artifact": str(artifact), "cache": manifest["cache"]["kind"], "model": recipe["model"], **results}
