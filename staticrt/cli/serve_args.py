"""The command lines of `staticrt serve` and `staticrt bench-serve`. Imports no torch, as main.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import (
    NON_NEGATIVE,
    POSITIVE,
    add_device_arg,
    add_format_arg,
    add_model_args,
    add_quantize_arg,
    add_speculative_arg,
    prompt_ids,
)


def add_serve_parsers(sub: Any) -> None:
    _add_serve_parser(sub)
    _add_bench_serve_parser(sub)


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server, requests batched continuously in the cache's rows (serve extra)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  staticrt serve --model models/smollm2 --backend compiled --max-batch-size 8\n"
        "  staticrt serve artifacts/smollm2 --backend onnx --port 8000   # ONNX Runtime, no torch\n"
        "  staticrt serve artifacts/smollm2 --backend onnx --replicas 2 --threads 1   # 2 processes on Ray\n"
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        '      -d \'{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}]}\'\n'
        "Each of the cache's rows holds one request; a new request is prefilled into a free row while\n"
        "the others keep decoding, with the same step shapes (no recompiles, CUDA graphs intact).\n"
        "Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics (Prometheus), "
        "/openapi.json (every field and answer, with this model's limits).",
    )
    serve.add_argument("artifact", nargs="?", type=Path, help="an artifact folder (instead of --model)")
    add_model_args(serve, required=False)
    add_device_arg(serve)
    serve.add_argument(
        "--backend", default=None, help="as for run: eager (default) | compiled | cudagraph | aoti | pt2 | onnx"
    )
    serve.add_argument(
        "--max-batch-size", type=POSITIVE, default=8, help="rows of the cache: requests decoded at once (default 8)"
    )
    serve.add_argument(
        "--prefill-buckets",
        type=prompt_ids,
        default=None,
        help="prompt widths with a prefill graph, comma-separated; longer prompts are prefilled in chunks "
        "of the largest (default: powers of two up to --max-cache-len)",
    )
    serve.add_argument("--threads", type=POSITIVE, default=None, help="CPU threads (torch, or ONNX Runtime)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=NON_NEGATIVE, default=8000)
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $STATICRT_API_KEY, else none)"
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the folder's name)"
    )
    _add_serving_policy(serve)
    _add_replica_args(serve)


def _add_replica_args(serve: Any) -> None:
    """Replicas on Ray Serve (the ray extra): one scheduler a replica, behind one OpenAI ingress."""
    ray = serve.add_argument_group(
        "replicas on Ray Serve (pip install 'staticrt[ray]')",
        "--replicas N serves from N processes, each its own cache's rows, behind one OpenAI ingress: on a local "
        "Ray instance, or on a running cluster (`ray start --head` there) with --ray-address. A request goes to "
        "the replica holding its prompt's prefix while loads are even; one whose replica dies before it streamed "
        "is sent to another.",
    )
    ray.add_argument(
        "--replicas", type=POSITIVE, default=None, metavar="N", help="replicas (the least, with --max-replicas)"
    )
    ray.add_argument("--max-replicas", type=POSITIVE, default=None, metavar="N", help="scale up to this many on load")
    ray.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        metavar="N",
        help="requests a replica should hold when scaling (default: its rows)",
    )
    ray.add_argument(
        "--ray-address", default=None, metavar="ADDRESS", help="a running Ray cluster, e.g. ray://head:10001 or auto"
    )
    ray.add_argument(
        "--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs Ray reserves a replica (default 1)"
    )
    ray.add_argument(
        "--replica-gpus", type=float, default=0.0, metavar="N", help="GPUs Ray reserves a replica (default 0)"
    )


def _add_serving_policy(serve: Any) -> None:
    """How the server treats requests: queue, streaming, drain, prefix reuse, a warm-up run."""
    serve.add_argument(
        "--max-queue", type=NON_NEGATIVE, default=64, help="requests waiting for a row before 429 (default 64)"
    )
    serve.add_argument(
        "--stream-interval",
        type=POSITIVE,
        default=1,
        help="tokens a streamed chunk after the first, which goes at once (default 1); more send fewer "
        "HTTP events a token, for models whose step costs less than a chunk (SGLang's and vLLM's option)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=POSITIVE,
        default=30,
        help="seconds open requests may take to finish after SIGTERM (default 30)",
    )
    serve.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole; by default a request is seated in the free row holding the longest "
        "prefix of its prompt and prefills only the rest (llama.cpp's cache_prompt)",
    )
    serve.add_argument(
        "--cache-ram",
        type=NON_NEGATIVE,
        default=1024,
        metavar="MB",
        help="host memory for rows that new requests overwrite (default 1024; 0: none): a request whose "
        "prompt continues one is seated with it restored, so more conversations than rows each keep their "
        "prefix (llama.cpp's --cache-ram); only what a row holds is kept",
    )
    add_speculative_arg(
        serve, "greedy requests get greedy decoding's tokens, sampled ones keep drafts by speculative sampling's rule"
    )
    warmup = "build every graph the server needs into the compile cache and exit (once, in a deployment's image)"
    serve.add_argument("--warmup-only", action="store_true", help=warmup)


def _length_range(text: str) -> tuple[int, int]:
    """MIN,MAX token counts (1 <= MIN <= MAX)."""
    values = prompt_ids(text)
    if len(values) != 2 or not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX with 1 <= MIN <= MAX, like 8,96")
    return values[0], values[1]


def _add_bench_serve_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench-serve",
        help="load-test staticrt serve against one request at a time and transformers serve (JSON)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n"
        "  staticrt bench-serve --model bench-llama --threads 2 --json bench/results/serve-bench-llama.json\n"
        "The same requests (random prompts and answer lengths, seeded) go to `staticrt serve`, then to\n"
        "`transformers serve --continuous-batching` when transformers is installed, each its own process\n"
        "on a loopback port, and then run one at a time through Generator.generate (batch 1). Reports\n"
        "output tokens/s, time to first token, the gaps between streamed chunks (ITL) and the time a\n"
        "token after the first (TPOT), p50 and p99, and the ratios.",
    )
    bench.add_argument(
        "--model", default="bench-llama", help="preset, checkpoint folder with tokenizer.json, or .gguf file"
    )
    bench.add_argument("--backend", default="compiled", help="eager | compiled (default) | cudagraph")
    bench.add_argument("--max-batch-size", type=POSITIVE, default=8, help="rows the server decodes at once (8)")
    bench.add_argument("--concurrency", type=POSITIVE, default=16, help="clients sending at once (default 16)")
    bench.add_argument("--requests", type=POSITIVE, default=64, help="requests in all (default 64)")
    bench.add_argument("--prompt-len", type=_length_range, default=(8, 96), help="MIN,MAX prompt tokens (8,96)")
    bench.add_argument("--output-len", type=_length_range, default=(16, 96), help="MIN,MAX max_tokens (16,96)")
    bench.add_argument("--prefill-buckets", type=prompt_ids, default=(32, 64, 128), help="default 32,64,128")
    bench.add_argument("--threads", type=POSITIVE, default=None, help="CPU threads of every contender")
    bench.add_argument(
        "--device",
        default=None,
        help="cpu | cuda | cuda:N: every contender's model (default: cuda for --backend cudagraph when torch sees "
        "a GPU, else cpu)",
    )
    bench.add_argument(
        "--duration", type=POSITIVE, default=600, help="seconds after which no request starts, per server (600)"
    )
    bench.add_argument("--seed", type=NON_NEGATIVE, default=0)
    add_quantize_arg(bench)  # staticrt serve's, to compare at a GGUF's weight width
    bench.add_argument(
        "--stream-interval",
        type=POSITIVE,
        default=1,
        help="staticrt serve's --stream-interval (default 1; transformers serve sends every token)",
    )
    bench.add_argument(
        "--no-transformers", action="store_true", help="skip transformers serve (skipped anyway when not installed)"
    )
    _add_bench_workload(bench)
    bench.add_argument("--json", type=Path, default=None, help="write the report here")
    add_format_arg(bench)


def _add_bench_workload(bench: Any) -> None:
    """What bench-serve sends, and which staticrt servers it measures."""
    bench.add_argument(
        "--workload",
        choices=("random", "chat", "soak"),
        default="random",
        help="random: --requests independent prompts; chat: each of --concurrency clients holds a conversation "
        "of --turns turns (--prompt-len tokens each) after a shared system prompt, on staticrt serve with "
        "prefix reuse and without, and on llama.cpp's server when --model is a .gguf file; soak: staticrt serve "
        "alone held for --duration seconds by --concurrency clients of a mixed load (streams cancelled and left "
        "unread, bursts past the queue, prompts near the context, garbage), sampled every minute: RSS, "
        "descriptors, threads, busy rows, queue, TTFT and inter-token p50/p99, answers by status",
    )
    bench.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="with --workload soak: draw its timeline here"
    )
    bench.add_argument("--turns", type=POSITIVE, default=4, help="with --workload chat: turns a conversation (4)")
    bench.add_argument(
        "--system-len", type=POSITIVE, default=200, help="with --workload chat: system prompt tokens (200)"
    )
    bench.add_argument(
        "--speculative",
        default=None,
        metavar="ngram[:K]",
        help="also measure staticrt serve with --speculative (greedy requests), beside it without",
    )
    bench.add_argument(
        "--replicas",
        type=POSITIVE,
        default=None,
        help="also measure staticrt serve --replicas N on a local Ray instance (the ray extra): what Ray adds; "
        "with --workload soak, soak that server instead",
    )
    bench.add_argument(
        "--kill-every",
        type=POSITIVE,
        default=None,
        metavar="SECONDS",
        help="with --workload soak --replicas N: SIGKILL the replica holding the most requests this often; the "
        "report says the streams lost beside those it was streaming, the requests sent again, and the seconds "
        "until answers came back to their rate before each kill",
    )
    bench.add_argument(
        "--structured",
        action="store_true",
        help="also measure staticrt serve with every request on a JSON schema (an array of at least "
        "max_tokens digits: as many tokens as without): the throughput it keeps, and llguidance's mask time "
        "a token a row",
    )
