"""What every backend over an artifact folder shares: the limits the generation loop checks, read
off the manifest once its seal and its fields have been checked (its files' hashes before a torch
program loads, beside an ONNX session: generator.py's `load_artifact`), an artifact without the
format refused, and (by each backend) held against the shapes it actually loaded."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from ..artifacts.manifest import REEXPORT, field, read_manifest, require_format
from ..config import ModelConfig
from ..errors import ArtifactError
from ..generation.prefix import rotating_layouts

FLAGS = {"max_cache_len": "--max-cache-len", "max_batch_size": "--batch-size", "prefill_buckets": "--prefill-buckets"}


class ArtifactBackend:
    """The `StepBackend` fields of an artifact's manifest; subclasses add `step` and `reset`."""

    def __init__(self, folder: str | Path, format: str, manifest: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = manifest or read_manifest(self.folder)
        require_format(self.folder, self.manifest, format)
        self.cache_kind = field(self.manifest, "cache.kind")
        self.batch_size = field(self.manifest, "cache.max_batch_size")
        self.max_cache_len = field(self.manifest, "cache.max_cache_len")
        self.max_sequence_len = field(self.manifest, "cache.max_sequence_len")
        self.vocab_size = field(self.manifest, "model.config.vocab_size")
        config = self.manifest["model"]["config"]
        self.eos_token_ids = tuple(config.get("eos_token_ids", ()))
        self.rope_restart = ModelConfig.from_dict(config).rope_restart
        layers = field(self.manifest, "cache.layers")
        layer_types = config.get("layer_types") or ["full_attention"] * len(layers)
        self.rotating_layouts = rotating_layouts(
            layers,
            field(self.manifest, "cache.layer_lengths"),
            layer_types,
            config.get("sliding_window"),
            config.get("conv_kernel", 0),
        )

    def check_loaded(self, what: str, recorded: Any, loaded: Any, source: Path) -> None:
        """Refuse a manifest whose `what` differs from the shape of the program or weights loaded."""
        if recorded != loaded:
            raise ArtifactError(
                f"{self.folder / 'manifest.json'} records {what} {recorded!r}, but {source} holds {loaded!r}; "
                f"the files do not belong together: {REEXPORT}"
            )

    def remedy(self, limit: str) -> str:
        """An artifact's limits are its programs' shapes: only a new export raises them."""
        return f"re-export the artifact with a larger {FLAGS[limit]}"

    def report(self) -> dict[str, Any]:
        """Nothing beyond the timings: the runtime owns the artifact's memory."""
        return {}

    def prepare(
        self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True, **_: Any
    ) -> float:
        """Nothing to build: the programs were compiled at export and loaded with the artifact."""
        return 0.0

    def unbuilt(
        self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True, **_: Any
    ) -> set[Hashable]:
        return set()
