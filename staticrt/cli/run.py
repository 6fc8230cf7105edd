"""`staticrt run`: generate from a prompt, with a model or an artifact; tokens stream to stdout."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import GenerationError
from ..text.tokenizer import check_text
from .console import console
from .session import bind, generate_options, open_source


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    for flag, value in (("--system", args.system), ("--chat-template-kwargs", args.chat_template_kwargs)):
        if value is not None and args.chat is None:
            raise GenerationError(f"{flag} belongs to a chat turn; give the user's message with --chat")
    if args.prompt is None and args.chat is None:
        return args.prompt_ids
    if tokenizer is None:
        raise GenerationError(
            f"--{'prompt' if args.chat is None else 'chat'} needs a tokenizer.json in {args.artifact or args.model}, "
            "which has none; pass token ids with --prompt-ids 1,2,3 instead"
        )
    if args.chat is None:
        return [tokenizer.encode(check_text(args.prompt, "--prompt"))]
    system = [{"role": "system", "content": check_text(args.system, "--system")}] if args.system is not None else []
    turn = [*system, {"role": "user", "content": check_text(args.chat, "--chat")}]
    return [tokenizer.apply_chat_template(turn, template_kwargs=args.chat_template_kwargs)]


def cmd_run(args: argparse.Namespace) -> int:
    source = open_source(args)
    tokenizer = source.tokenizer
    prompts = _prompts(args, tokenizer)
    gen = bind(source, args, len(prompts) * args.num_beams, max(len(p) for p in prompts) + args.max_new_tokens)

    texts = [tokenizer.stream() for _ in prompts] if tokenizer is not None else None

    def show(row: int, text: str) -> None:
        if text and not args.json:
            sys.stdout.write(text if len(prompts) == 1 else f"[{row}]{text} ")
            sys.stdout.flush()

    def stream(row: int, token: int) -> None:
        show(row, texts[row].push(token) if texts is not None else f" {token}")  # whole characters only

    options = generate_options(args, source, gen)
    if args.num_beams > 1:  # the winning beam is known only at the end: printed then, not streamed
        options.update(num_beams=args.num_beams, length_penalty=args.length_penalty)
        tokens = gen.generate(prompts, args.max_new_tokens, **options)
        for row, ids in enumerate(tokens):
            for token in ids:
                stream(row, token)
    else:
        tokens = gen.generate(prompts, args.max_new_tokens, stream=stream, **options)
    stats = gen.last_stats
    if args.json:
        out: dict[str, Any] = {
            "tokens": tokens,
            "backend": gen.backend.name,
            "cache": gen.backend.cache_kind,
            "compile_s": stats.compile_s,  # graphs this run built first, apart from prefill
            "prefill_ms": 1000 * stats.prefill_s,
            "decode_ms_per_token": stats.decode_ms_per_token,  # null when one token was asked for
        }
        if args.speculative is not None or args.draft is not None:  # how the drafts fared
            out.update(verify_steps=stats.verify_steps, drafted=stats.drafted, accepted=stats.accepted)
            out["tokens_per_step"] = stats.decode_tokens / len(stats.decode_s) if stats.decode_s else None
        if tokenizer is not None:
            out["text"] = [tokenizer.decode(t) for t in tokens]
        print(json.dumps(out, allow_nan=False))
    else:
        for row, text in enumerate(texts or []):
            show(row, text.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()  # before the timings, which go to stderr
        console.print(timings(stats))
    return 0


def timings(stats: Any) -> str:
    """A generation's times in one line: compile (when it compiled), prefill (and the prompt
    tokens the cache kept), decode."""
    decode = stats.decode_ms_per_token
    kept = f" ({sum(stats.kept)} prompt tokens kept in the cache)" if any(stats.kept) else ""
    drafts = (
        f" ({stats.verify_steps} of {len(stats.decode_s)} steps verified drafts, {stats.accepted} of "
        f"{stats.drafted} drafted tokens accepted)"
        if stats.verify_steps
        else ""
    )
    return (
        (f"compile {stats.compile_s:.1f} s, " if stats.compile_s else "")
        + f"prefill {1000 * stats.prefill_s:.1f} ms{kept}, "
        + (f"decode {decode:.2f} ms/token{drafts}" if decode is not None else "no decode step (one new token)")
    )
