"""`staticrt run`: generate from a prompt, with a model or an artifact; tokens stream to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..console import console
from ..errors import GenerationError


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if args.system is not None and args.chat is None:
        raise GenerationError("--system is the system prompt of a chat turn; give the user's message with --chat")
    if args.prompt is None and args.chat is None:
        return args.prompt_ids
    if tokenizer is None:
        raise GenerationError(
            f"--{'prompt' if args.chat is None else 'chat'} needs a tokenizer.json in {args.artifact or args.model}, "
            "which has none; pass token ids with --prompt-ids 1,2,3 instead"
        )
    if args.chat is None:
        return [tokenizer.encode(args.prompt)]
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [tokenizer.apply_chat_template([*system, {"role": "user", "content": args.chat}])]


def _artifact_run(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]]]:
    from ..runtime import load_artifact
    from ..tokenizer import load_tokenizer

    if args.model:
        raise GenerationError("give an artifact folder or --model, not both")
    gen = load_artifact(args.artifact, backend=args.backend, threads=args.threads)
    tokenizer = load_tokenizer(args.artifact)
    return gen, tokenizer, _prompts(args, tokenizer)


def _model_run(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]]]:
    """A model bound to a cache sized for the request."""
    from ..caches import resolve_max_cache_len
    from ..checkpoint import load_model
    from ..runtime import Generator

    if not args.model:
        raise GenerationError("say what to run: --model PRESET_OR_FOLDER, or an artifact folder")
    model = load_model(args.model, dtype=args.dtype)
    prompts = _prompts(args, model.tokenizer)
    needed = max(len(p) for p in prompts) + args.max_new_tokens
    max_cache_len = resolve_max_cache_len(model.config, args.cache, args.max_cache_len, needed, args.window)
    gen = Generator(
        model,
        cache=args.cache,
        max_batch_size=len(prompts),
        max_cache_len=max_cache_len,
        backend=args.backend or "eager",
        window=args.window,
    )
    return gen, model.tokenizer, prompts


def cmd_run(args: argparse.Namespace) -> int:
    if args.threads and args.backend != "onnx":
        import torch

        torch.set_num_threads(args.threads)
    gen, tokenizer, prompts = (_artifact_run if args.artifact is not None else _model_run)(args)

    texts = [tokenizer.stream() for _ in prompts] if tokenizer is not None else None

    def show(row: int, text: str) -> None:
        if text and not args.json:
            sys.stdout.write(text if len(prompts) == 1 else f"[{row}]{text} ")
            sys.stdout.flush()

    def stream(row: int, token: int) -> None:
        show(row, texts[row].push(token) if texts is not None else f" {token}")  # whole characters only

    tokens = gen.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=args.stop_ids if args.stop_ids is not None else gen.backend.eos_token_ids,
        stream=stream,
    )
    stats = gen.last_stats
    if args.json:
        out: dict[str, Any] = {
            "tokens": tokens,
            "backend": gen.backend.name,
            "cache": gen.backend.cache_kind,
            "prefill_ms": 1000 * stats.prefill_s,
            "decode_ms_per_token": stats.decode_ms_per_token,  # null when one token was asked for
        }
        if tokenizer is not None:
            out["text"] = [tokenizer.decode(t) for t in tokens]
        print(json.dumps(out, allow_nan=False))
    else:
        for row, text in enumerate(texts or []):
            show(row, text.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()  # before the timings, which go to stderr
        decode = stats.decode_ms_per_token
        console.print(
            f"prefill {1000 * stats.prefill_s:.1f} ms, "
            + (f"decode {decode:.2f} ms/token" if decode is not None else "no decode step (one new token)")
        )
    return 0
