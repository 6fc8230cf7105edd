"""Artifact folders: program files beside a `manifest.json` that says what they are.

The manifest records the schema version, the staticrt/torch/onnx versions that wrote it, the model
config, the cache spec, batch size, lengths, window, prefill buckets, dtypes, every program's
input/output names and shapes, and the sha256 of every file in the folder. It is sealed: its own
sha256 (over its canonical JSON, without that field) is its last field, so an edited limit is
refused like an edited program. The loader checks the seal, the type of every field a backend
reads, and every file's hash, and refuses a file the manifest does not list; it names the file or
field at fault. Writing is in write.py.

This module imports no torch: an ONNX artifact deploys with onnxruntime and numpy alone.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, read_json_object

SCHEMA_VERSION = 3  # 2: the manifest is sealed (manifest_sha256) and lists every file; 3: torch programs return logits
MANIFEST = "manifest.json"
SEAL = "manifest_sha256"
# Artifact formats, each run by the backend of its name (generation/generator.py), in the order a default is picked.
FORMATS = ("aoti", "pt2", "onnx")
TORCH_FORMATS = ("aoti", "pt2")
REEXPORT = "re-export the artifact with `staticrt export`"
# The ONNX graph's optional input picking the step's columns that get logits, and the output that
# holds them (exporters/onnx_export.py).
LOGITS_INDEX, INDEXED_LOGITS = "logits_index", "indexed_logits"

# Every field a loader reads, by dotted path, with the JSON types it may hold (None: null).
FIELDS: dict[str, tuple[type | None, ...]] = {
    "versions": (dict,),
    "model": (dict,),
    "model.config": (dict,),
    "model.config.vocab_size": (int,),
    "model.config.max_position_embeddings": (int,),
    "cache": (dict,),
    "cache.kind": (str,),
    "cache.max_batch_size": (int,),
    "cache.max_cache_len": (int,),
    "cache.max_sequence_len": (int, None),
    "cache.layers": (list,),
    "cache.layer_lengths": (list,),
    "dtype": (str,),
    "device": (str,),
    "prefill_buckets": (list,),
    "formats": (list,),
    "files": (dict,),
}
FORMAT_FIELDS: dict[str, dict[str, tuple[type | None, ...]]] = {
    "torch": {"programs": (dict,), "constants": (dict,), "weights": (str,)},
    "onnx": {
        "onnx": (dict,),
        "onnx.graph": (str,),
        "onnx.inputs": (list,),
        "onnx.opset": (int,),
        "onnx.ir_version": (int,),
    },
}


def program_name(seq_len: int) -> str:
    """The name of the program that runs a step of `seq_len` tokens a row: `decode` or `prefill_N`."""
    return "decode" if seq_len == 1 else f"prefill_{seq_len}"


AOTI_WEIGHTS_CONFIG = "data/aotinductor/model/weights_config.json"  # in an AOTInductor package


def aoti_package_weights(archive: zipfile.ZipFile) -> tuple[str | None, dict[str, tuple[str, list, list, int]]]:
    """The weights an AOTInductor package holds (torch's `pickle_weights` layout): the entry of
    its weights_config.json (None without one), and each weight's name -> (its archive entry,
    shape, stride, storage offset)."""
    found = [name for name in archive.namelist() if name.endswith("/" + AOTI_WEIGHTS_CONFIG)]
    if not found:
        return None, {}
    root = found[0][: -len(AOTI_WEIGHTS_CONFIG)]
    config = json.loads(archive.read(found[0]))
    return found[0], {name: (f"{root}data/weights/{file}", *layout) for name, (file, *layout) in config.items()}


def aoti_libraries(archive: zipfile.ZipFile) -> list[tuple[str, str | None]]:
    """Each compiled library an AOTInductor package holds, with the entry of its custom-op calls
    (`<library>.json`, which the runner reads from beside the library to make its proxy executor;
    None where the graph calls no custom op)."""
    names = archive.namelist()
    libraries = [name for name in names if name.endswith(".so") and "/aotinductor/" in name]
    calls = [lib.removesuffix(".so") + ".json" for lib in libraries]
    return [(lib, entry if entry in names else None) for lib, entry in zip(libraries, calls, strict=True)]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with its own sha256 as the last field (what the writer stores, and the loader checks)."""
    body = {key: value for key, value in manifest.items() if key != SEAL}
    return {**body, SEAL: _digest(body)}


def field(manifest: dict[str, Any], path: str) -> Any:
    """The value at dotted `path` (`cache.max_batch_size`), once `read_manifest` has checked its type."""
    value: Any = manifest
    for key in path.split("."):
        value = value[key]
    return value


def _check_field(manifest: dict[str, Any], path: str, kinds: tuple[type | None, ...], source: Path) -> None:
    value: Any = manifest
    for depth, key in enumerate(path.split(".")):
        if not isinstance(value, dict) or key not in value:
            raise ArtifactError(f"{source}: field {'.'.join(path.split('.')[: depth + 1])} is missing; {REEXPORT}")
        value = value[key]
    allowed = tuple(k for k in kinds if k is not None)
    ok = (value is None and None in kinds) or (isinstance(value, allowed) and not isinstance(value, bool))
    if not ok or (isinstance(value, int) and value < 1):
        names = " or ".join("null" if k is None else k.__name__ for k in kinds)
        raise ArtifactError(f"{source}: field {path} is {value!r}, expected {names} (>= 1 for numbers); {REEXPORT}")


def read_manifest(folder: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of the artifact in `folder`, after checking its schema, its seal, the type of
    every field a loader reads and (with `verify`) the sha256 of every file in the folder."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} is not an artifact: {MANIFEST} is missing; export one with `staticrt export`")
    manifest = read_json_object(path, ArtifactError, REEXPORT)
    version = manifest.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: field schema_version is {version!r}, this staticrt reads schema_version {SCHEMA_VERSION}; "
            "re-export the artifact with this staticrt"
        )
    if manifest.get(SEAL) != _digest({k: v for k, v in manifest.items() if k != SEAL}):
        raise ArtifactError(
            f"{path} does not match its own {SEAL} (edited or corrupted since export); the limits it records "
            f"are what the loader enforces, so an edited manifest is refused: {REEXPORT}"
        )
    fields = dict(FIELDS)
    formats = manifest.get("formats")
    if isinstance(formats, list):
        unknown = [f for f in formats if f not in FORMATS]
        if unknown or not formats:
            raise ArtifactError(f"{path}: field formats is {formats!r}; formats are {', '.join(FORMATS)}; {REEXPORT}")
        if any(f in TORCH_FORMATS for f in formats):
            fields |= FORMAT_FIELDS["torch"]
        if "onnx" in formats:
            fields |= FORMAT_FIELDS["onnx"]
    for name, kinds in fields.items():
        _check_field(manifest, name, kinds, path)
    if verify:
        verify_files(folder, manifest["files"])
    return manifest


def verify_files(folder: Path, files: dict[str, Any]) -> None:
    """Every listed file present with its hash, and no file the manifest does not list."""
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise ArtifactError(f"{file} is listed in {MANIFEST} but missing; {REEXPORT}")
        if sha256(file) != expected:
            raise ArtifactError(
                f"{file} does not match the sha256 in {MANIFEST} (changed or corrupted since export); "
                "re-export the artifact"
            )
    held = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    unlisted = [name for name in held if name != MANIFEST and name not in files]
    if unlisted:
        raise ArtifactError(
            f"{folder} holds file(s) {unlisted[:5]} that {MANIFEST} does not list; an artifact holds only what "
            f"its export wrote: move them out of the folder or {REEXPORT}"
        )


def require_format(folder: Path, manifest: dict[str, Any], backend: str | None) -> None:
    """Refuse to run `backend` on an artifact that does not hold its format; every backend checks here."""
    held = [b for b in FORMATS if b in manifest["formats"]]
    if backend not in held:
        raise ArtifactError(
            f"{folder} holds format(s) {', '.join(manifest['formats'])}, not {backend!r}; run it with one of "
            f"{', '.join(held)} or re-export with --format {backend}"
        )
