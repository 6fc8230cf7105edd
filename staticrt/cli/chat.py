"""`staticrt chat`: a conversation in the terminal, each answer streamed as whole characters.

Every turn renders the whole conversation with the checkpoint's template and generates from it
in the Generator's one cache row (a fixed number of positions), which keeps what it held: only
the tokens the conversation added since the last turn are prefilled (`reuse_prefix`). An answer
stops where the cache ends, and a conversation that has filled it asks for /reset. Lines read
from a pipe are turns too, so the command can be scripted and tested without a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import GenerationError, StaticrtError
from ..text.chat_template import Message
from .console import console
from .run import timings
from .session import bind, generate_options, open_source

HELP = "/reset starts over, /exit or Ctrl-D ends, Ctrl-C stops an answer"


def cmd_chat(args: argparse.Namespace) -> int:
    source = open_source(args)
    tokenizer = source.tokenizer
    if tokenizer is None:
        raise GenerationError(
            f"chat needs the checkpoint's tokenizer.json and chat template, and {source.name} has no tokenizer.json; "
            "use a checkpoint folder (or an artifact exported from one) that has both"
        )
    system: list[Message] = [{"role": "system", "content": args.system}] if args.system is not None else []
    extra = args.chat_template_kwargs
    tokenizer.apply_chat_template([*system, {"role": "user", "content": "hi"}], template_kwargs=extra)  # refused now
    gen = bind(source, args, 1, None)
    options = generate_options(args, source, gen)
    interactive = sys.stdin.isatty()
    # a line that is not UTF-8 reaches the tokenizer, which refuses it by name: the conversation goes on
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        console.print(f"chatting with {source.name} on {gen.backend.name}; {HELP}")
    messages, number = list(system), 0
    while (line := _read_turn(interactive)) is not None:
        began = time.perf_counter()
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            console.print("(a new conversation)")
            continue
        if not text:
            continue
        turn = [*messages, {"role": "user", "content": text}]
        try:
            answer, first = _answer(gen, tokenizer, turn, args.max_new_tokens, options, not args.no_prefix_reuse, extra)
        except StaticrtError as err:  # a conversation the cache cannot hold: the session goes on
            console.print(f"staticrt chat: {err}", style="red", markup=False, soft_wrap=True)
            continue
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            console.print("(answer stopped; it is not kept in the conversation)")
            continue
        if interactive:
            console.print(timings(gen.last_stats), style="dim")
        if args.timings:
            number += 1
            print(json.dumps(_turn_timings(number, first - began, gen.last_stats)), file=sys.stderr, flush=True)
        messages = [*turn, {"role": "assistant", "content": answer}]
    return 0


def _read_turn(interactive: bool) -> str | None:
    """The next line the user typed (or the pipe holds); None at the end."""
    if not interactive:
        return sys.stdin.readline() or None
    try:
        return input(">>> ")
    except (EOFError, KeyboardInterrupt):
        sys.stdout.write("\n")
        return None


def _turn_timings(number: int, first_token_s: float, stats: Any) -> dict[str, Any]:
    """One turn's `--timings` line: from the line read to the first token streamed, and the parts."""
    decode = stats.decode_ms_per_token
    return {
        "turn": number,
        "first_token_ms": round(1000 * first_token_s, 2),
        "prefill_ms": round(1000 * stats.prefill_s, 2),
        "compile_s": round(stats.compile_s, 2),
        "prompt_tokens_kept": stats.kept[0],
        "decode_ms_per_token": None if decode is None else round(decode, 3),
    }


def _answer(
    gen: Any,
    tokenizer: Any,
    turn: list[Message],
    max_new_tokens: int,
    options: dict[str, Any],
    reuse: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, float]:
    """Stream the answer to `turn` to stdout; return its text (without the eos it stopped on) and
    when its first token came (`time.perf_counter`)."""
    ids = tokenizer.apply_chat_template(turn, template_kwargs=template_kwargs)
    limit = gen.backend.max_sequence_len
    room = max_new_tokens if limit is None else min(max_new_tokens, limit - len(ids))
    if room < 1:
        raise GenerationError(
            f"the conversation is {len(ids)} tokens and the cache holds {limit}; /reset starts a new one "
            "(or restart with a larger --max-cache-len)"
        )
    text, first = tokenizer.stream(), []

    def show(row: int, token: int) -> None:
        if not first:
            first.append(time.perf_counter())
        sys.stdout.write(text.push(token))
        sys.stdout.flush()

    tokens = gen.generate([ids], room, stream=show, reuse_prefix=reuse, **options)[0]
    sys.stdout.write(text.flush() + "\n")
    sys.stdout.flush()
    return tokenizer.decode(tokens), first[0]
