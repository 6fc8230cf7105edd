"""What every backend over an artifact folder shares: the limits the generation loop checks,
read off the manifest once the folder has been checked and an artifact without the format refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifact import read_manifest, require_format


class ArtifactBackend:
    """The `StepBackend` fields of an artifact's manifest; subclasses add `step` and `reset`."""

    def __init__(self, folder: str | Path, format: str, manifest: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(self.folder)
        require_format(self.folder, self.manifest, format)
        cache, config = self.manifest["cache"], self.manifest["model"]["config"]
        self.cache_kind = cache["kind"]
        self.batch_size = cache["max_batch_size"]
        self.max_cache_len = cache["max_cache_len"]
        self.max_sequence_len = cache["max_sequence_len"]
        self.vocab_size = config["vocab_size"]
        self.eos_token_ids = tuple(config.get("eos_token_ids", ()))

    def report(self) -> dict[str, Any]:
        """Nothing beyond the timings: the runtime owns the artifact's memory."""
        return {}
