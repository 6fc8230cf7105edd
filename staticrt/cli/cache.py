"""`staticrt cache list|clear`: what staticrt keeps for later processes, and freeing it."""

from __future__ import annotations

import argparse
import json
import time

from ..artifacts.user_cache import Entry, cache_root, clear, entries
from .console import console, show_table


def _what(entry: Entry) -> str:
    """A line on what an entry holds: a graph's model and shape, a converted checkpoint's or ONNX graph's source."""
    if entry.kind == "gguf":
        return f"checkpoint converted from {entry.path.name.rsplit('-', 1)[0]}.gguf"
    if entry.kind == "llama.cpp":
        return "llama-server and llama-bench built for this CPU (bench-serve's llama.cpp contender)"
    try:
        if entry.kind == "onnx":
            recorded = json.loads((entry.path / "entry.json").read_text())
            runtime = recorded["fields"]["onnxruntime"]
            return f"ONNX graph of {recorded['source']}, weights packed for this CPU (onnxruntime {runtime})"
        fields = json.loads((entry.path / "entry.json").read_text())["fields"]
        config, (width, choice, _), cache = fields["config"], fields["graph"], fields["cache"]
        step = "decode" if width == 1 else f"{width}-token prefill"
        return (
            f"{step} ({choice}) of a {config['num_layers']}-layer {config['family']} of hidden "
            f"{config['hidden_size']}, {cache[1]} cache {cache[2]}x{cache[3]}, {fields['threads']} threads"
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return "unreadable entry.json (the next process that needs it compiles it again)"


def cmd_cache(args: argparse.Namespace) -> int:
    kind = None if args.kind == "all" else args.kind
    if args.action == "list":
        found = entries(kind)
        now = time.time()
        rows = [
            [e.kind, e.path.name, f"{e.bytes / 1e6:,.1f}", f"{(now - e.last_used) / 86400:.1f}", _what(e)]
            for e in found
        ]
        title = f"{cache_root()}: {len(found)} entries, {sum(e.bytes for e in found) / 1e6:,.1f} MB"
        show_table(title, ["kind", "entry", "MB", "days unused", "holds"], rows, args.format)
        return 0
    removed = clear(kind, args.older_than)
    freed = sum(e.bytes for e in removed) / 1e6
    console.print(f"removed {len(removed)} entries ({freed:,.1f} MB) from {cache_root()}", markup=False)
    return 0
