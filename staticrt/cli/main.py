"""staticrt command line: demo | run | chat | serve | export | convert | bench | bench-serve | inspect | cache.

Importing this module imports no torch: `staticrt run ARTIFACT --backend onnx` deploys without it.
Each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..artifacts.manifest import FORMATS
from ..errors import StaticrtError
from ..generation.loop import MAX_NEW_TOKENS
from .args import (
    POSITIVE,
    TEMPLATE_KWARGS_HELP,
    Parser,
    add_format_arg,
    add_generation_args,
    add_model_args,
    prompt_ids,
    template_kwargs,
)
from .bench_args import add_bench_parser
from .console import console, show_log
from .serve_args import add_serve_parsers

EPILOG = """\
examples:
  staticrt demo
  staticrt run --model tiny-llama --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16 --json
  staticrt run --model ./my-llama --prompt "The capital of France is" --backend compiled
  staticrt convert SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
  staticrt chat --model models/smollm2 --system "You are terse."
  staticrt bench --model bench-llama --backends eager,compiled,hf --new-tokens 64 --threads 2 --json bench.json
  staticrt bench --model bench-llama --backends compiled,onnx --threads 2 --json bench-onnx.json
  staticrt bench --backends compiled,hf --window 4096 --prompt-len 4160 --new-tokens 32 --json bench-sliding.json
  staticrt bench --backends compiled --offload --prompt-len 8192 --new-tokens 32 --json bench-offload.json
  staticrt bench-serve --model bench-llama --threads 2 --json bench-serve.json
  staticrt export export/tiny-llama.toml && staticrt bench --cold-start artifacts/tiny-llama --json bench-cold.json
  staticrt run --model tiny-mistral --cache sliding --prompt-ids 1,2,3 --max-new-tokens 500
  staticrt inspect --model tiny-gemma2 --cache hybrid --max-cache-len 4096
  staticrt inspect --model bench-llama --cache offloaded --max-cache-len 8192

A model is a built-in preset ({presets}) or a Hugging Face checkpoint folder
(config.json + safetensors, tokenizer.json for --prompt).
"""


def _preset_names() -> str:
    from ..models.presets import PRESETS

    return ", ".join(PRESETS)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="staticrt",
        description="LLM decoding as a fixed-shape, static-graph program.",
        epilog=EPILOG.format(presets=_preset_names()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run every backend on a built-in tiny model and check they agree")
    demo.add_argument("--model", default="tiny-llama", help="preset to demo (default tiny-llama)")
    demo.add_argument("--new-tokens", type=POSITIVE, default=MAX_NEW_TOKENS)

    run = sub.add_parser(
        "run",
        help="generate from a prompt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Tokens stream to stdout as they are chosen; --json prints one object at the end.",
    )
    add_generation_args(run)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="one chat turn: MESSAGE as the user's, through the checkpoint's chat template (with --system)",
    )
    src.add_argument(
        "--prompt-ids",
        type=prompt_ids,
        action="append",
        help="token ids of one row, comma-separated; repeat for a batch",
    )
    run.add_argument("--system", default=None, help="with --chat: the system prompt (default: the template's)")
    run.add_argument(
        "--chat-template-kwargs", type=template_kwargs, metavar="JSON", help=f"with --chat: {TEMPLATE_KWARGS_HELP}"
    )
    run.add_argument(
        "--num-beams",
        type=POSITIVE,
        default=1,
        help="beam search with N beams, as transformers' generate(num_beams=N): each prompt takes N cache rows; "
        "the best beam prints at the end (eager, compiled, cudagraph; default 1: no beams)",
    )
    run.add_argument(
        "--length-penalty", type=float, default=1.0, help="with --num-beams: a finished beam scores log p / length^this"
    )
    run.add_argument("--json", action="store_true", help='print {"tokens": [[...] per row], ...} as one JSON object')

    chat = sub.add_parser(
        "chat",
        help="talk to a chat model in the terminal, turn after turn",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each line you type is a user turn; the answer streams back. /reset starts over (keeping\n"
        "the system prompt), /exit or Ctrl-D ends, Ctrl-C stops an answer. Lines read from a pipe work\n"
        "the same way, one turn each:\n"
        "  printf 'What is the capital of France?\\nAnd of Italy?\\n' | staticrt chat --model models/smollm2\n"
        "The conversation is kept in one cache of --max-cache-len positions (default: the model's\n"
        "context, at most 1024); /reset when it is full. The cache keeps what it holds between turns,\n"
        "so each turn prefills only what the conversation added (the tokens are a whole prefill's).",
    )
    add_generation_args(chat, max_new_tokens=256)
    chat.add_argument("--system", default=None, help="the system prompt (default: the template's)")
    chat.add_argument("--chat-template-kwargs", type=template_kwargs, metavar="JSON", help=TEMPLATE_KWARGS_HELP)
    chat.add_argument(
        "--no-prefix-reuse", action="store_true", help="prefill the whole conversation every turn (to compare)"
    )
    chat.add_argument(
        "--timings",
        action="store_true",
        help="after each answer, one JSON line on stderr: time to the first token, prefill, prompt tokens kept",
    )
    _add_export_parser(sub)
    add_serve_parsers(sub)

    convert = sub.add_parser(
        "convert",
        help="convert a GGUF file to a checkpoint folder (needs the gguf extra)",
        epilog="example:\n  staticrt convert SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2\n"
        "  staticrt run --model models/smollm2 --chat 'What is the capital of France?'\n"
        "  staticrt convert --keep-quantized SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-int4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("gguf", type=Path, help="the .gguf file (llama, mistral, qwen2 or gemma2; any weight type)")
    convert.add_argument("out", type=Path, help="the checkpoint folder to write (new, or empty)")
    convert.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q4_0/Q4_1 projections' 4-bit codes (they load as int4-g32) or Q8_0's (int8, one scale a "
        "channel at load) instead of writing float32: a folder about the GGUF's size that loads quantized, "
        "in bfloat16, with the quant extra; transformers cannot read it",
    )

    add_bench_parser(sub)

    cache = sub.add_parser(
        "cache",
        help="list or free what staticrt keeps for later processes (compiled graphs, converted GGUFs, ONNX graphs)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The cache is $STATICRT_CACHE, else $XDG_CACHE_HOME/staticrt, else ~/.cache/staticrt.\n"
        "graphs: the compiled backend's CPU step graphs (AOTInductor libraries, a decode graph with its\n"
        "packed weights), keyed by the weights' hash, config, cache shape, threads, torch and CPU: a later\n"
        "process loads them in about a second instead of compiling for a minute. gguf: checkpoints\n"
        "converted from a .gguf --model. onnx: ONNX artifacts' graphs as ONNX Runtime optimizes them, their\n"
        "weights packed for this CPU (about twice the graph's bytes): a later session maps them instead of\n"
        "packing them again. A process with an entry loaded keeps running when it is removed.\n"
        "STATICRT_COMPILE_CACHE=off compiles, and packs ONNX weights, in each process and stores nothing.\n"
        "examples:\n  staticrt cache list\n  staticrt cache clear --older-than 30\n"
        "  staticrt cache clear --kind graphs",
    )
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument(
        "--kind",
        choices=("all", "graphs", "gguf", "onnx", "llama.cpp"),
        default="all",
        help="which entries (default all)",
    )
    cache.add_argument(
        "--older-than", type=float, default=None, metavar="DAYS", help="clear: only entries unused this many days"
    )
    add_format_arg(cache)

    inspect = sub.add_parser("inspect", help="show a model's cache layout and memory")
    add_model_args(inspect)
    inspect.add_argument("--batch-size", type=POSITIVE, default=1)
    add_format_arg(inspect)
    return parser


def _add_export_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="export a model with its cache to an artifact folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  staticrt export export/tiny-mistral.toml          # writes artifacts/tiny-mistral/\n"
        "  staticrt export --model ./my-llama --cache static --batch-size 1 --max-cache-len 2048 \\\n"
        "      --prefill-buckets 128,512 --out artifacts/my-llama\n"
        "  staticrt export export/tiny-llama.toml --format onnx  # only the recipe's ONNX graph\n"
        "  staticrt export --model ./my-llama --format onnx --quantize int4 --out artifacts/my-llama-int4\n"
        "  staticrt run artifacts/tiny-mistral --prompt-ids 1,2,3 --json\n"
        "  staticrt run artifacts/tiny-mistral --backend onnx --prompt-ids 1,2,3   # ONNX Runtime, no torch",
    )
    export.add_argument("recipe", nargs="?", type=Path, help="a recipe, export/NAME.toml (writes artifacts/NAME/)")
    add_model_args(export, required=False)
    export.add_argument(
        "--batch-size",
        type=POSITIVE,
        default=1,
        help="rows of the cache (default 1; an onnx artifact speculates, --speculative or --draft, with one row)",
    )
    export.add_argument(
        "--prefill-buckets",
        type=prompt_ids,
        default=None,
        help="prompt widths to export a prefill program for, comma-separated (default: max-cache-len)",
    )
    export.add_argument(
        "--format",
        default=None,
        help="comma-separated: aoti (AOTInductor packages), pt2 (torch.export programs), onnx (an "
        "ONNX graph with genai_config.json for ONNX Runtime and onnxruntime-genai); default: "
        f"the recipe's formats, or all of {','.join(FORMATS)} with --model",
    )
    export.add_argument("--out", type=Path, default=None, help="artifact folder (default artifacts/RECIPE_NAME)")


# command -> (module, function), imported when the command runs
COMMANDS = {
    "demo": ("staticrt.cli.demo", "cmd_demo"),
    "run": ("staticrt.cli.run", "cmd_run"),
    "export": ("staticrt.cli.export", "cmd_export"),
    "bench": ("staticrt.cli.bench", "cmd_bench"),
    "inspect": ("staticrt.cli.inspect", "cmd_inspect"),
    "cache": ("staticrt.cli.cache", "cmd_cache"),
    "convert": ("staticrt.cli.convert", "cmd_convert"),
    "chat": ("staticrt.cli.chat", "cmd_chat"),
    "serve": ("staticrt.cli.serve", "cmd_serve"),
    "bench-serve": ("staticrt.cli.bench_serve", "cmd_bench_serve"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, name = COMMANDS[args.command]
    if args.command == "serve" and (args.replicas is not None or args.ray_address is not None):
        module, name = "staticrt.cli.serve_replicas", "cmd_serve_replicas"  # replicas on Ray Serve
    show_log()
    try:
        return getattr(importlib.import_module(module), name)(args)
    except StaticrtError as err:  # a bad request: its message, exit status 2
        console.print(f"staticrt {args.command}: {err}", style="red", markup=False, soft_wrap=True)
        return 2
