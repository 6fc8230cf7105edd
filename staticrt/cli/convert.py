"""`staticrt convert FILE.gguf OUT/`: a GGUF file to a checkpoint folder every command loads."""

from __future__ import annotations

import argparse
import time

from .console import console


def cmd_convert(args: argparse.Namespace) -> int:
    from ..loading.convert import convert_gguf

    start = time.perf_counter()
    current = ["", start]  # the stage under way and when it began

    def finish() -> None:
        if current[0]:
            console.print(f"  {current[0]}: {time.perf_counter() - current[1]:.1f} s")

    with console.status(f"converting {args.gguf}") as status:

        def stage(what: str) -> None:  # a stage's line is printed with its duration once it ends
            finish()
            current[:] = [what, time.perf_counter()]
            status.update(f"converting {args.gguf}: {what}")

        out = convert_gguf(args.gguf, args.out, stage, keep_quantized=args.keep_quantized)
        finish()
    console.print(
        f"wrote {out} in {time.perf_counter() - start:.1f} s; chat with it: staticrt chat --model {out}",
        soft_wrap=True,  # one line: the command can be copied
    )
    return 0
