"""Every error a user can cause, in one torch-free module.

Each class derives from `StaticrtError`, so the CLI (and any caller) catches one class to tell
a bad request from a bug; each message names the input, the limit and the way out. Nothing here
imports torch or numpy: the ONNX deploy path raises these too.
"""

from __future__ import annotations

import json
import numbers
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class StaticrtError(ValueError):
    """A request staticrt refuses, before any state changes; the message says what to do instead."""


class GenerationError(StaticrtError):
    """A bad generation request: prompts, token ids, lengths, sampling parameters."""


class CacheError(StaticrtError):
    """A cache request that cannot be met by this model or this cache kind."""


class ConfigError(StaticrtError):
    """A model config that staticrt cannot run, with the field at fault."""


class CheckpointError(StaticrtError):
    """A checkpoint folder that cannot be loaded, naming the file or tensor."""


class ArtifactError(StaticrtError):
    """An artifact that cannot be written or loaded as asked, naming the file or manifest field."""


class BenchError(StaticrtError):
    """A benchmark that cannot run as asked, naming the option."""


def first_line(err: BaseException) -> str:
    """What a library's exception says, in one line (its type where it says nothing), for our message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def read_json_object(path: Path, error: type[StaticrtError], way_out: str) -> dict[str, Any]:
    """The JSON object in `path` (config.json, a manifest, ...), or `error` naming the file and `way_out`."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path} is not valid JSON ({err}); {way_out}") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, not an object; {way_out}")
    return data


def as_int(value: Any, name: str, minimum: int | None = None, error: type[StaticrtError] = GenerationError) -> int:
    """`value` as a Python int when it is an integer (Python or NumPy, never a bool, a float or a
    digit string: those would run as some other number without a word), at least `minimum`."""
    try:
        number = None if isinstance(value, bool) or type(value).__name__ == "bool_" else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise error(f"{name} is {value!r} ({type(value).__name__}); it must be an int")
    if minimum is not None and number < minimum:
        raise error(f"{name} is {number}; it must be an int >= {minimum}")
    return number


def as_real(value: Any, name: str, error: type[StaticrtError] = GenerationError) -> float:
    """`value` as a finite Python float when it is a real number (never a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value).__name__ == "bool_":
        raise error(f"{name} is {value!r} ({type(value).__name__}); it must be a number")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise error(f"{name} is {number}; it must be a finite number")
    return number


def check_positions(
    write_index: Sequence[int],
    seq_len: int,
    limit: int | None,
    cache_kind: str,
    error: type[StaticrtError] = GenerationError,
    way_out: str = "build it with a larger max_cache_len",
) -> None:
    """Refuse, on the host and before anything runs, a step of `seq_len` tokens a row at
    `write_index` that would write past position `limit - 1` of a `cache_kind` cache (None: no
    limit). A compiled graph or an exported program cannot raise on data, so every backend checks
    here; `way_out` says how this backend's limit is raised."""
    if limit is None:
        return
    for row, start in enumerate(write_index):
        if int(start) + seq_len > limit:
            raise error(
                f"row {row} writes positions {int(start)}..{int(start) + seq_len - 1}, but this {cache_kind} "
                f"cache holds positions 0..{limit - 1} (max_cache_len={limit}); {way_out}"
            )


def check_positive(owner: Any, label: str, name: str, zero: bool = False) -> None:
    """`owner.name` a finite number > 0 (>= 0 with `zero`), or a ConfigError naming it: a zero or
    negative rope theta, scale or norm epsilon decodes NaN logits, which run as token 0."""
    value = as_real(getattr(owner, name), label, ConfigError)
    if not (value >= 0 if zero else value > 0):
        raise ConfigError(
            f"{label} is {value}; it must be {'>= 0' if zero else '> 0'} (it would decode NaN logits): "
            "restore config.json"
        )
