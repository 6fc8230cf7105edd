"""The argument types and groups staticrt's commands share: strict token-id lists and counts (a
typo is refused, never run as another number), one-line usage errors, and the model, backend and
sampling options of `run` and `chat`. Imports no torch, as main.py."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ..generation.loop import MAX_NEW_TOKENS
from ..models.quant_spec import QUANTIZE_CHOICES


def prompt_ids(text: str) -> list[int]:
    """Comma-separated token ids, ASCII digits only: "1 2 3", "1,,2", "1_000" and full-width
    digits are refused rather than run as some other prompt."""
    if not re.fullmatch(r"\s*[0-9]+(\s*,\s*[0-9]+)*\s*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not comma-separated token ids; write them like 1,2,3 (digits 0-9, one comma between ids)"
        )
    return [int(t) for t in text.split(",")]


def template_kwargs(text: str) -> dict:
    """A JSON object of extra chat-template variables, as vLLM's `chat_template_kwargs`."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({err}); write an object like '{{\"enable_thinking\": false}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object; write one like '{{\"enable_thinking\": false}}'"
        )
    return value


TEMPLATE_KWARGS_HELP = (
    "extra variables for the chat template, a JSON object (vLLM's chat_template_kwargs): "
    "'{\"enable_thinking\": false}' turns Qwen3's thinking off"
)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of ASCII digits, at least `minimum`."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*-?[0-9]+\s*", text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return int(text)

    return parse


POSITIVE, NON_NEGATIVE = at_least(1), at_least(0)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (the command, the problem, where help is)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def add_quantize_arg(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--quantize: the weights in fewer bytes (the quant extra: torchao)."""
    choices = ", ".join(QUANTIZE_CHOICES)
    if several:
        p.add_argument(
            "--quantize",
            default="none",
            help=f"comma-separated weight variants to run side by side: none, {choices} (default none)",
        )
        return
    p.add_argument(
        "--quantize",
        default=None,
        choices=("none", *QUANTIZE_CHOICES),
        help="store the projections as int8 or int4 and the head as int8: fewer bytes a token, a faster decode. "
        "int8 and int4 take the kernels this device runs fastest: on a CPU with AVX512-VNNI or AVX2, staticrt's "
        "own (int8-a8, int4-a8: int8 weights, or int4 with a scale and minimum a block of 32, times int8 "
        "activations in blocks of 32, computing in float32; compiled once on first use, ~20 s), elsewhere, or "
        "with --dtype bfloat16, torchao's weight-only ones (int8-wo: one scale an output channel; int4-g32, "
        "-g64, -g128: a scale and zero a group of inputs; computing in bfloat16; needs the quant extra: pip "
        "install 'staticrt[quant]'). export writes the weights as loaded to pt2 and aoti, or ONNX Runtime's "
        "MatMulNBits (computing in float32) to onnx, one artifact each",
    )


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help="preset name, Hugging Face checkpoint folder, or a .gguf file (converted once into the cache)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16: what the model computes in (default float32; bfloat16 with --quantize)",
    )
    add_quantize_arg(p)
    p.add_argument(
        "--cache",
        default="auto",
        help="KV cache: static (every position), sliding (every layer a rotating buffer of the "
        "window; generation never runs out), hybrid (rotating buffers for sliding-window "
        "layers only, as in Gemma2), offloaded (every layer's K/V in host memory, two layers' "
        "worth on the device), offloaded-hybrid (hybrid with the global layers offloaded), sink "
        "(StreamingLLM: 4 attention-sink positions kept for good, the newest --max-cache-len - 4 in a "
        "rotating buffer; generation never runs out), static-int8 | sliding-int8 | hybrid-int8 (those "
        "layouts with K/V as int8 and a scale a token and head: about a quarter of float32), auto (default: "
        "what the model's config implies, "
        "static when the window is no shorter than --max-cache-len)",
    )
    p.add_argument(
        "--max-cache-len",
        type=POSITIVE,
        default=None,
        help="positions a static layer holds (default: run fits prompt + new tokens; chat, export and "
        "inspect take the model's context, at most 1024; never below the window for sliding and "
        "hybrid)",
    )
    p.add_argument(
        "--window", type=POSITIVE, default=None, help="slots of a rotating layer (default: the model's sliding_window)"
    )


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device of a command that loads --model to run it."""
    p.add_argument(
        "--device",
        default=None,
        help="with --model: cpu | cuda | cuda:N, where the weights, the cache and every step live (default: "
        "cuda for cudagraph and reduce-overhead when torch sees a GPU, else cpu)",
    )


def add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
    """What `run` and `chat` take: a model or an artifact, the backend, sampling and stopping."""
    p.add_argument(
        "artifact",
        nargs="?",
        type=Path,
        help="an artifact folder from `staticrt export` (instead of --model): runs its programs",
    )
    add_model_args(p, required=False)
    add_device_arg(p)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=max_new_tokens, help=f"(default {max_new_tokens})")
    p.add_argument(
        "--threads",
        type=POSITIVE,
        default=None,
        help="CPU threads for torch, or for ONNX Runtime with --backend onnx (default: the library's choice)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="with --model: eager (default) | compiled | cudagraph (CUDA graphs of the compiled step; the "
        "compiled path on a CPU) | reduce-overhead (torch.compile's own CUDA graphs); with an artifact: aoti "
        "(AOTInductor packages) | pt2 (torch.export programs) | onnx (ONNX Runtime, no torch), default the "
        "first it holds",
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    defaults = "default: generation_config.json's, else"
    p.add_argument("--temperature", type=float, default=None, help=f"with --do-sample ({defaults} 1.0)")
    p.add_argument("--top-k", type=NON_NEGATIVE, default=None, help=f"with --do-sample ({defaults} 0: every token)")
    p.add_argument("--top-p", type=float, default=None, help=f"with --do-sample ({defaults} 1.0)")
    p.add_argument("--seed", type=NON_NEGATIVE, default=None)
    p.add_argument(
        "--stop-ids",
        type=prompt_ids,
        default=None,
        help="stop token ids, comma-separated (default: the checkpoint's eos ids)",
    )
    add_speculative_arg(
        p,
        "greedy tokens are greedy decoding's; with --do-sample, kept drafts follow the model's distribution "
        "(speculative sampling's rule), not the seed's plain tokens",
    )


def add_speculative_arg(p: argparse.ArgumentParser, scope: str) -> None:
    """--speculative and --draft of run, chat and serve; `scope` says whose tokens they leave unchanged."""
    p.add_argument(
        "--speculative",
        default=None,
        metavar="ngram[:K]",
        help="speculative decoding: a step verifies up to K tokens (default 4) drafted from the text so "
        f"far (prompt lookup), while drafting pays; {scope}. Fastest where the answer copies its prompt "
        "(rewriting, editing code, summarising); a torch --model backend only",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="MODEL[:K]",
        help="speculative decoding with a draft model (a folder, preset or .gguf sharing the model's tokenizer, "
        "in --dtype on the model's device): each step it drafts up to K tokens (default 4) greedily in a "
        "cache of its own, with the rows and positions of the model's, and the model verifies them in one step",
    )


def add_format_arg(p: argparse.ArgumentParser) -> None:
    """--format of a command that shows a table."""
    p.add_argument(
        "--format",
        choices=("table", "csv", "markdown"),
        default="table",
        help="table (stderr; one block a row where the terminal is too narrow for whole numbers), or csv / "
        "markdown on stdout, to parse or paste",
    )
