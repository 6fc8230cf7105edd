"""The checkpoint's tokenizer, by the tokenizers library alone: an ONNX deploy reads it without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: Path) -> Any:
    """The tokenizer in `path` (a tokenizer.json) as a `tokenizers.Tokenizer`, or None where there is none."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)) if path.is_file() else None
