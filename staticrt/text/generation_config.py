"""A checkpoint's generation_config.json: the ids generation stops on and the sampling settings the
model's authors chose, the defaults transformers' `generate` takes from the same file.

Read without torch: an exported artifact carries the file, and its ONNX deploy path has no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, StaticrtError, as_int, as_real, read_json_object

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What a folder's generation_config.json sets; None where it is silent (the library's own
    default applies: temperature 1, top_k 0 = every token, top_p 1)."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def sampling(self, temperature: float | None, top_k: int | None, top_p: float | None) -> dict[str, Any]:
        """The sampling keywords for `generate`: each value asked for, else this file's, else the library's."""
        pick = lambda asked, own, library: asked if asked is not None else own if own is not None else library  # noqa: E731
        return {
            "temperature": pick(temperature, self.temperature, 1.0),
            "top_k": pick(top_k, self.top_k, 0),
            "top_p": pick(top_p, self.top_p, 1.0),
        }


def read_generation_defaults(folder: str | Path) -> GenerationDefaults:
    """The defaults of `folder`'s generation_config.json; all unset when there is none (a preset)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return GenerationDefaults()
    raw = read_json_object(path, CheckpointError, f"restore the checkpoint's {FILE}")
    try:
        eos = raw.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return GenerationDefaults(
            eos_token_ids=tuple(as_int(t, "eos_token_id", 0, CheckpointError) for t in eos_ids),
            temperature=_optional(raw, "temperature", lambda v, n: as_real(v, n, CheckpointError)),
            top_k=_optional(raw, "top_k", lambda v, n: as_int(v, n, 0, CheckpointError)),
            top_p=_optional(raw, "top_p", lambda v, n: as_real(v, n, CheckpointError)),
        )
    except StaticrtError as err:
        raise CheckpointError(f"{path}: {err}; fix or remove that field") from None


def _optional(raw: dict[str, Any], name: str, convert: Any) -> Any:
    return None if raw.get(name) is None else convert(raw[name], name)
