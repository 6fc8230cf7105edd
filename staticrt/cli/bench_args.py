"""The command line of `staticrt bench`. Imports no torch, as main.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .args import POSITIVE, add_format_arg, add_quantize_arg


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="side-by-side decode benchmark, written as JSON")
    bench.add_argument("--model", default="bench-llama", help="preset or checkpoint folder (default bench-llama)")
    bench.add_argument(
        "--backends",
        default="eager,compiled,hf",
        help="comma-separated: eager, compiled, cudagraph, reduce-overhead, aoti, pt2, onnx (exported to a "
        "temporary artifact, run by AOTInductor, torch.export's program or ONNX Runtime), hf (transformers, when "
        "installed)",
    )
    bench.add_argument("--new-tokens", type=POSITIVE, default=64)
    bench.add_argument("--prompt-len", type=POSITIVE, default=32)
    bench.add_argument("--batch-size", type=POSITIVE, default=1)
    bench.add_argument(
        "--repeats",
        type=POSITIVE,
        default=5,
        help="timed rounds after every backend's warm-up; a round runs each backend once, in turn",
    )
    bench.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads")
    bench.add_argument(
        "--dtype",
        default="float32",
        help="of the float weights (default float32); quantized variants compute in bfloat16",
    )
    add_quantize_arg(bench, several=True)
    bench.add_argument(
        "--gguf",
        default=None,
        metavar="FILE[,FILE]",
        help="also run llama.cpp on these GGUF files (its own quantization; batch 1), labelled llamacpp-Q4_1 etc., "
        "or on the bench's model written as GGUF: F32, Q8_0, Q4_0, Q4_1 in place of a file (bench/gguf_write.py "
        "writes Llama, Qwen3, Qwen3-MoE, Gemma 3, Phi-3, LFM2; the llamacpp extra: llama-cpp-python from source)",
    )
    bench.add_argument(
        "--window",
        type=POSITIVE,
        default=None,
        help="give every layer this sliding window and compare, past it, a SlidingWindow cache "
        "with a Static cache of the window and transformers' sliding-window cache "
        "(a Llama or Mistral model; needs --prompt-len >= window)",
    )
    bench.add_argument(
        "--offload",
        action="store_true",
        help="run each staticrt backend with a Static and an OffloadedStatic cache and report "
        "the offloaded step's cost (make --prompt-len long enough that the K/V outweighs "
        "the weights)",
    )
    bench.add_argument(
        "--kv-int8",
        action="store_true",
        help="run each staticrt backend with a Static and a static-int8 cache (K/V int8 with a scale a "
        "token and head), and hf also with transformers' QuantizedCache (optimum-quanto int4: "
        "pip install 'staticrt[kvquant]'), and report each one's step cost and cache bytes; a long "
        "--prompt-len shows it",
    )
    _add_other_runs(bench)
    bench.add_argument("--json", type=Path, default=None, help="write the report here")
    add_format_arg(bench)


def _add_other_runs(bench: Any) -> None:
    """Where the bench runs (--device), what it draws, and the runs it makes instead of the decode benchmark."""
    bench.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU)")
    bench.add_argument(
        "--cold-start",
        type=Path,
        default=None,
        metavar="ARTIFACT",
        help="instead: from a fresh process to its first token, seconds and peak RSS, cold (empty compile "
        "caches) and warm, for the artifact's model on the eager and compiled backends, each of its programs, "
        "transformers, and llama.cpp on --gguf (with --threads)",
    )
    bench.add_argument(
        "--speculative",
        default=None,
        metavar="ngram[:K]",
        help="instead: the bench's own prompts (copy-heavy: rewrite, edit code, repeat; open-ended chat) decoded "
        "greedily without and with speculation on --model's chat template (the first of --backends; --threads, "
        "--new-tokens, --repeats), and transformers without and with prompt_lookup_num_tokens=K (hf in --backends)",
    )
    bench.add_argument(
        "--draft",
        default=None,
        metavar="MODEL[:K]",
        help="instead: as --speculative, drafting up to K tokens a step (default 4) with a draft model sharing "
        "--model's tokenizer, and transformers with that model as its assistant_model (assisted generation)",
    )
    bench.add_argument(
        "--chat-turns",
        type=int,
        default=None,
        metavar="N",
        help="instead: N questions piped into `staticrt chat --model ... --backend ...` (the first of --backends), "
        "with prefix reuse and without, each turn's time to the first token side by side (--threads, "
        "--new-tokens: each answer's most)",
    )
    bench.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw ms/token per backend beside its weight-streaming bound (the plot extra: matplotlib)",
    )
