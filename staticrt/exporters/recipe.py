"""Export recipes: one TOML file a target in export/, read into a `Recipe`.

    model = "tiny-mistral"          # a preset, or a checkpoint folder (relative to the recipe)
    dtype = "float32"
    quantize = "int8"               # optional: int8 | int4 | int4-g64 | ... (weights; onnx, or pt2/aoti, not both)
    cache = "sliding"               # static | sliding | hybrid
    window = 64                     # optional: slots of rotating layers
    batch_size = 3
    max_cache_len = 64
    prefill_buckets = [64]
    formats = ["aoti", "pt2"]

`staticrt export export/NAME.toml` writes artifacts/NAME/.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import ArtifactError, as_int


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str
    cache: str
    batch_size: int
    max_cache_len: int
    prefill_buckets: tuple[int, ...]
    formats: tuple[str, ...]
    dtype: str | None = None  # float32 by default
    window: int | None = None
    quantize: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def read_recipe(path: str | Path) -> Recipe:
    """Parse and check a recipe; errors name the file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"recipe {path} does not exist; recipes live in export/NAME.toml") from None
    except tomllib.TOMLDecodeError as err:
        raise ArtifactError(f"recipe {path} is not valid TOML: {err}") from None
    known = {f.name for f in fields(Recipe)} - {"name"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ArtifactError(
            f"recipe {path}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(sorted(known))}"
        )
    required = ("model", "cache", "batch_size", "max_cache_len", "prefill_buckets", "formats")
    missing = [k for k in required if k not in data]
    if missing:
        raise ArtifactError(f"recipe {path}: key(s) {', '.join(missing)} missing")
    model = str(data["model"])
    if (path.parent / model).exists():  # a checkpoint folder beside the recipe; else a preset or a full path
        model = str((path.parent / model).resolve())
    number = lambda key, value: as_int(value, f"recipe {path}: {key}", 1, ArtifactError)  # noqa: E731
    lists = [k for k in ("prefill_buckets", "formats") if not isinstance(data[k], list)]
    if lists:
        raise ArtifactError(f"recipe {path}: {', '.join(lists)} must be a list, like {lists[0]} = [...]")
    return Recipe(
        name=path.stem,
        model=model,
        cache=str(data["cache"]),
        batch_size=number("batch_size", data["batch_size"]),
        max_cache_len=number("max_cache_len", data["max_cache_len"]),
        prefill_buckets=tuple(number("prefill_buckets", b) for b in data["prefill_buckets"]),
        formats=tuple(str(f) for f in data["formats"]),
        dtype=None if data.get("dtype") is None else str(data["dtype"]),
        window=None if data.get("window") is None else number("window", data["window"]),
        quantize=None if data.get("quantize") is None else str(data["quantize"]),
    )
