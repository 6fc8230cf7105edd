"""`staticrt bench --chat-turns N`: a conversation piped into `staticrt chat`, with prefix reuse
and without, each in a fresh process, side by side turn by turn.

Both runs answer the same questions greedily, so they hold the same conversation; each turn's
time to the first token comes from the chat's own `--timings` line (from the line read to the
first token streamed), less the time the turn spent building graphs it used for the first time
(compiled: a new bucket's prefill graph), which a warm process does not pay again. Without reuse
a turn prefills the whole conversation so far; with it, the turn alone. The answers must be
equal: reuse changes what is prefilled, never the tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..errors import GenerationError

QUESTIONS = (
    "What is the capital of France?",
    "What is it famous for?",
    "Name three museums there.",
    "Which one is the oldest?",
    "What can I see in it?",
    "How do I get there from the station?",
    "What else is near it?",
    "Where should I eat nearby?",
    "What is a typical dish?",
    "How is it made?",
    "Is it expensive?",
    "Thank you. Summarise our conversation in one sentence.",
)


def _chat(model: str, turns: int, backend: str, threads: int | None, reuse: bool, new_tokens: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "staticrt.cli", "chat", "--model", model, "--backend", backend, "--timings"]
    command += ["--max-new-tokens", str(new_tokens), "--system", "You are a helpful assistant."]
    command += (["--threads", str(threads)] if threads else []) + ([] if reuse else ["--no-prefix-reuse"])
    lines = "".join(q + "\n" for q in QUESTIONS[:turns])
    done = subprocess.run(command, input=lines, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise GenerationError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    timings = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"turn"')]
    return {"answers": done.stdout, "turns": timings}


def chat_turns(
    model: str,
    turns: int,
    backend: str = "eager",
    threads: int | None = None,
    new_tokens: int = 48,
    on_stage: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The report: each turn's time to first token with reuse and without, their ratio, and
    whether both runs gave the same answers."""
    from .machine import machine

    if not 1 <= turns <= len(QUESTIONS):
        raise GenerationError(f"--chat-turns is {turns}; it takes 1 to {len(QUESTIONS)} (the questions it asks)")
    runs = {}
    for reuse in (True, False):
        on_stage(f"staticrt chat --backend {backend}, {turns} turns, {'with' if reuse else 'without'} prefix reuse")
        runs["reuse" if reuse else "no_reuse"] = _chat(model, turns, backend, threads, reuse, new_tokens)
    rows = []
    for on, off in zip(runs["reuse"]["turns"], runs["no_reuse"]["turns"], strict=True):
        for turn in (on, off):
            turn["first_token_warm_ms"] = round(turn["first_token_ms"] - 1000 * turn["compile_s"], 2)
        ratio = off["first_token_warm_ms"] / on["first_token_warm_ms"] if on["first_token_warm_ms"] > 0 else None
        rows.append({"turn": on["turn"], "reuse": on, "no_reuse": off, "first_token_no_reuse_over_reuse": ratio})
    settings = {"model": model, "turns": turns, "backend": backend, "threads": threads, "new_tokens": new_tokens}
    same = runs["reuse"]["answers"] == runs["no_reuse"]["answers"]
    return {"settings": settings, "machine": machine(), "turns": rows, "answers_agree": same, "answers": runs}
