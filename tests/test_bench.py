"""The benchmark's sliding-window mode runs what it says (no timings are asserted: speed lives in
`staticrt bench` JSON, not in tests)."""

from __future__ import annotations

import csv
import datetime
import io
import json
import re
import statistics
from pathlib import Path

import pytest

from staticrt.bench import BenchError, run_bench
from staticrt.cli.main import main
from staticrt.models import a8_kernels


def test_sliding_bench_compares_the_same_tokens_as_transformers():
    pytest.importorskip("transformers", reason="the hf backend needs the test extra")
    report = run_bench("tiny-llama", ["eager", "hf"], new_tokens=8, prompt_len=80, repeats=1, window=64)
    runs = report["backends"]
    assert {k: (r["cache"], r["prompt_len"]) for k, r in runs.items()} == {
        "eager-sliding": ("sliding", 80),
        "eager-static": ("static", 56),
        "hf": ("sliding", 80),
    }
    assert runs["eager-sliding"]["tokens"] == runs["hf"]["tokens"]  # transformers' own sliding cache agrees
    assert report["tokens_agree"]
    assert set(report["ratios"]) == {
        "eager-sliding_decode_speedup_vs_hf",
        "eager-sliding_step_cost_vs_static",
        "eager-static_decode_speedup_vs_hf",
    }
    # K/V read per step: 2 (K and V) x 2 layers x 1 row x 2 heads x 64 positions x 16 dims x 4 bytes
    assert runs["eager-sliding"]["kv_bytes_per_step"] == runs["eager-static"]["kv_bytes_per_step"] == 32768


def test_each_backend_is_held_against_the_streaming_rate_sampled_around_its_own_runs(tmp_path, capsys):
    """Through the CLI, which also prints the table as CSV (compile time apart) and draws the plot."""
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (in the test extra)")
    from matplotlib.image import imread

    plot, out = tmp_path / "plots" / "bench.png", tmp_path / "bench.json"
    command = ["bench", "--model", "tiny-llama", "--backends", "eager,compiled", "--new-tokens", "4", "--device", "cpu"]
    command += ["--prompt-len", "16", "--repeats", "3", "--format", "csv", "--plot", str(plot), "--json", str(out)]
    assert main(command) == 0
    captured = capsys.readouterr()
    rows = {row[0]: row for row in csv.reader(io.StringIO(captured.out))}
    assert rows["backend"][:4] == ["backend", "prompt", "compile s", "prefill ms"]
    assert rows["eager"][2] == "0.00"  # eager compiles nothing
    assert float(rows["compiled"][2]) > 0  # the compiled backend's first compile, apart from prefill
    assert "drew " in captured.err
    assert imread(plot).ndim == 3 and not list(plot.parent.glob(".*.tmp"))
    report = json.loads(out.read_text())
    eager, compiled = report["backends"]["eager"], report["backends"]["compiled"]
    # rounds alternate, a sample before every timed run and one after the last: s0 eager s1
    # compiled s2 eager s3 compiled s4 eager s5 compiled s6; each backend gets the samples around
    # its own runs
    assert eager["matvec_samples"][1:] == compiled["matvec_samples"][:-1]
    assert len(eager["matvec_samples"]) == len(compiled["matvec_samples"]) == 6
    every = eager["matvec_samples"] + compiled["matvec_samples"][-1:]
    assert report["matvec_bytes_per_s"] == statistics.median(every)
    for run in (eager, compiled):
        assert run["matvec_bytes_per_s"] == statistics.median(run["matvec_samples"])
        step_s = run["decode_ms_per_token"] / 1000
        assert run["streaming_fraction"] == run["weight_bytes_per_step"] / step_s / run["matvec_bytes_per_s"]
    # every number names its machine: the CPU and its vector flags as /proc/cpuinfo has them, and the day
    info = report["machine"]
    assert datetime.datetime.fromisoformat(info["date"]).date() == datetime.datetime.now(datetime.timezone.utc).date()
    if Path("/proc/cpuinfo").exists():
        cpuinfo = Path("/proc/cpuinfo").read_text()
        assert info["cpu_model"] == re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M).group(1).strip()
        assert ("avx2" in info["cpu_flags"]) == (" avx2" in cpuinfo)
        assert ("avx512f" in info["cpu_flags"]) == (" avx512f" in cpuinfo)


def test_the_machine_block_reads_the_first_processors_model_and_only_isa_flags(tmp_path):
    from staticrt.host import cpuinfo

    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 fma avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert cpuinfo(path) == ("AMD EPYC 9R14", {"fpu", "sse", "avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpuinfo(tmp_path / "absent") == ("", set())


def test_sliding_bench_needs_a_prompt_past_the_window():
    with pytest.raises(
        BenchError,
        match=re.escape(
            "prompt_len 32 is shorter than window 64; the sliding benchmark decodes past the window, so use "
            "--prompt-len 64 or more"
        ),
    ):
        run_bench("tiny-llama", ["eager"], prompt_len=32, window=64)


@pytest.mark.filterwarnings("ignore::staticrt.caches.OffloadWarning")
def test_offload_bench_runs_static_and_offloaded_caches_on_the_same_prompts():
    report = run_bench("tiny-llama", ["eager"], new_tokens=8, prompt_len=48, repeats=1, offload=True, device="cpu")
    runs = report["backends"]
    assert {k: (r["cache"], r["prompt_len"]) for k, r in runs.items()} == {
        "eager-static": ("static", 48),
        "eager-offloaded": ("offloaded", 48),
    }
    assert report["tokens_agree"] and set(report["ratios"]) == {"eager-offloaded_step_cost_vs_static"}
    # 56 positions x 2 layers x (K and V) x 2 heads x 16 dims x 4 bytes, plus the 8-byte length
    assert (runs["eager-static"]["cache_device_bytes"], runs["eager-static"]["cache_host_bytes"]) == (28680, 0)
    # tiny-llama has two layers: the two working buffers are as large as the whole cache
    assert (runs["eager-offloaded"]["cache_device_bytes"], runs["eager-offloaded"]["cache_host_bytes"]) == (
        28680,
        28672,
    )


def test_offload_and_window_benches_are_separate():
    with pytest.raises(
        BenchError, match="^--window and --offload/--kv-int8 compare different things; run them one at a time$"
    ):
        run_bench("tiny-llama", ["eager"], prompt_len=64, window=64, offload=True)


def test_the_window_bench_refuses_a_model_that_is_not_a_llama_or_mistral():
    """It runs the model as a Mistral with every layer sliding: Gemma 2's norms and soft-capping
    (or a recurrent model's layers) would silently become another model."""
    with pytest.raises(BenchError) as refused:
        run_bench("tiny-gemma2", ["eager"], new_tokens=8, prompt_len=80, window=64)
    assert str(refused.value) == (
        "--window runs the model as a Mistral with every layer sliding, which a 'gemma2' model is not (its own "
        "layers and weights would change); use a llama or mistral model (bench-llama, smollm2), or leave --window out"
    )


def test_onnx_bench_exports_and_runs_the_same_tokens_as_eager():
    report = run_bench("tiny-llama", ["eager", "onnx"], new_tokens=8, prompt_len=24, repeats=1, device="cpu")
    onnx, eager = report["backends"]["onnx"], report["backends"]["eager"]
    assert report["tokens_agree"] and onnx["tokens"] == eager["tokens"]
    assert onnx["prompt_len"] == 24 and onnx["decode_ms_per_token"] > 0


@pytest.mark.skipif(a8_kernels.unavailable() is not None, reason="int8-a8 needs AVX512-VNNI or AVX2 (test_a8_kernels)")
def test_the_torch_formats_bench_exports_the_model_as_loaded_and_runs_its_tokens():
    """aoti and pt2 export each weight variant as loaded (int8-a8: staticrt's kernels, called from
    the AOTInductor library) and give the eager backend's tokens on it."""
    report = run_bench(
        "tiny-llama", ["eager", "aoti", "pt2"], new_tokens=8, prompt_len=16, repeats=1, quantize=("none", "int8-a8")
    )
    runs = report["backends"]
    for suffix in ("", "-int8-a8"):
        assert runs[f"aoti{suffix}"]["tokens"] == runs[f"pt2{suffix}"]["tokens"] == runs[f"eager{suffix}"]["tokens"]
    assert runs["aoti-int8-a8"]["weight_bytes_per_step"] < runs["aoti"]["weight_bytes_per_step"] / 3
    kernel = f"staticrt::int8_linear ({a8_kernels.isa()}; int8 weights x int8 activations, float32 out)"
    assert runs["aoti-int8-a8"]["kernel"] == runs["eager-int8-a8"]["kernel"] == kernel and "kernel" not in runs["aoti"]


def test_onnx_cannot_join_the_offload_bench():
    with pytest.raises(
        BenchError,
        match=r"^offloaded caches do not export, so --offload cannot run the onnx "
        r"backend; drop onnx from --backends$",
    ):
        run_bench("tiny-llama", ["onnx"], offload=True)


def test_llamacpp_and_quantized_runs_are_refused_before_anything_loads(tmp_path):
    with pytest.raises(BenchError) as refused:
        run_bench("tiny-llama", ["eager"], gguf=(str(tmp_path / "missing.gguf"),))
    assert str(refused.value) == (
        f"--gguf {tmp_path / 'missing.gguf'}: no such file (or name a type, F32, Q8_0, Q4_0, Q4_1, to write the "
        "bench's model as a GGUF of it)"
    )
    with pytest.raises(BenchError) as refused:
        run_bench("tiny-gemma2", ["eager"], gguf=("Q4_0",))
    assert str(refused.value) == (
        "--gguf Q4_0: writes a float Llama, Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3 or LFM2 model (no biases, "
        "default RoPE) as F32, Q8_0, Q4_0, Q4_1; this model has family 'gemma2': pass a GGUF file of it instead"
    )
    with pytest.raises(BenchError, match="^--gguf runs llama.cpp at batch 1 on its own cache; drop --batch-size"):
        run_bench("tiny-llama", ["eager"], batch_size=2, gguf=(str(tmp_path / "missing.gguf"),))
    with pytest.raises(
        BenchError,
        match=r"^--quantize int8: backends hf run the float weights only; add a staticrt backend "
        r"\(eager, compiled, cudagraph, aoti, pt2, onnx\) or none to --quantize$",
    ):
        run_bench("tiny-llama", ["hf"], quantize=("int8",))


def _tiny_serve_bench(**settings):
    """bench-serve on tiny-llama, eager, 2 rows, 3 clients, 1 thread (and `settings`)."""
    pytest.importorskip("transformers", reason="bench-serve writes the preset with transformers: the test extra")
    pytest.importorskip("fastapi", reason="bench-serve starts staticrt serve: the serve extra")
    from staticrt.bench.serve_bench import ServeBenchRequest

    fixed = dict(max_batch_size=2, concurrency=3, prefill_buckets=(16, 32), threads=1)
    return ServeBenchRequest("tiny-llama", "eager", **fixed, **settings)


def test_bench_serve_sends_the_same_requests_to_every_contender():
    """staticrt serve, transformers serve and the one-at-a-time baseline all produce every token
    asked for (random weights, no eos): the same requests, measured the same way."""
    from staticrt.bench.serve_bench import run_serve_bench

    report = run_serve_bench(
        _tiny_serve_bench(requests=6, prompt_range=(4, 40), output_range=(4, 12), stream_interval=3)
    )
    import numpy as np

    rng = np.random.default_rng(0)  # the workload's own draws: prompt length, ids, then max_tokens
    asked = 0
    for _ in range(6):
        rng.integers(0, 512, size=int(rng.integers(4, 41)))
        asked += int(rng.integers(4, 13))
    results = report["results"]
    assert set(results) == {"staticrt", "transformers", "one_at_a_time"}
    assert {name: (r["output_tokens"], r.get("failed", 0)) for name, r in results.items()} == {
        name: (asked, 0) for name in results
    }
    assert set(report["throughput_ratios"]) == {"staticrt_vs_transformers", "staticrt_vs_one_at_a_time"}
    assert report["settings"]["max_cache_len"] == 64 + 12  # the longest prompt in chunks of 32, and its answer
    assert all(results[name]["tpot"]["p50_ms"] > 0 for name in ("staticrt", "transformers"))


def test_bench_serve_chat_conversations_keep_their_prefix_only_with_reuse():
    """The chat workload: 3 clients, 3 turns each after a shared system prompt, on 2 rows. With
    prefix reuse the server reports kept prompt tokens (the system prompt at least, every turn
    after the first); without, none; with --speculative too; all produce every token asked for."""
    from staticrt.bench.serve_chat import run_chat_bench

    chat = dict(workload="chat", turns=3, system_len=20, speculative="ngram:2")
    report = run_chat_bench(_tiny_serve_bench(prompt_range=(4, 8), output_range=(4, 6), **chat))
    results = report["results"]
    assert set(results) == {"staticrt", "staticrt_no_reuse", "staticrt_speculative"}  # a preset has no GGUF
    assert all((r["requests"], r["failed"]) == (9, 0) for r in results.values())
    assert len({r["output_tokens"] for r in results.values()}) == 1
    assert set(report["speculative_ratios"]) == {"throughput_speculative_over_plain", "tpot_p50_plain_over_speculative"}
    assert (
        results["staticrt"]["cached_prompt_tokens"] >= 6 * 20
        and results["staticrt_no_reuse"]["cached_prompt_tokens"] == 0
    )
    assert set(report["reuse_ratios"]) == {"ttft_p50_no_reuse_over_reuse", "throughput_reuse_over_no_reuse"}


def test_the_load_generator_only_targets_loopback():
    from staticrt.bench.serve_load import check_loopback

    with pytest.raises(ValueError, match="^the load generator only targets loopback servers; http://10.0.0.2:80 is on"):
        check_loopback("http://10.0.0.2:80")


def test_a_preset_written_as_gguf_is_the_same_model_to_transformers(tmp_path):
    """`bench --gguf Q4_0` times llama.cpp on the bench's own model written as GGUF
    (bench/gguf_write.py). Written with float tensors, transformers' GGUF loader (which undoes
    llama.cpp's Q/K row order) gives staticrt's greedy tokens; written as Q4_0, the projections
    are Q4_0 and the embedding and head Q8_0."""
    transformers = pytest.importorskip("transformers", reason="transformers reads GGUF: install the test extra")
    gguf = pytest.importorskip("gguf", reason="the gguf extra writes GGUF")
    import torch

    import staticrt
    from staticrt.bench.gguf_write import write_gguf

    model = staticrt.load_model("tiny-llama")  # untied head, 2 query heads a KV head
    write_gguf(model, tmp_path / "tiny.F32.gguf", "F32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.F32.gguf", dtype=torch.float32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = staticrt.Generator(model, max_cache_len=64).generate([prompt], max_new_tokens=20)[0]
    out = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert out[0, len(prompt) :].tolist() == ours
    written = gguf.GGUFReader(write_gguf(model, tmp_path / "q.gguf", "Q4_0"))
    types = {t.name: t.tensor_type.name for t in written.tensors}
    assert types["blk.1.attn_k.weight"] == types["blk.0.ffn_down.weight"] == "Q4_0"
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"
