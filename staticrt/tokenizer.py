"""The checkpoint's tokenizer, by the tokenizers library alone: an ONNX deploy reads it without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CheckpointError


def load_tokenizer(path: Path) -> Any:
    """The tokenizer in `path` (a tokenizer.json) as a `tokenizers.Tokenizer`, or None where there is none."""
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for any parse error
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path} cannot be read by the tokenizers library ({reason}); restore the checkpoint's tokenizer.json"
        ) from None
