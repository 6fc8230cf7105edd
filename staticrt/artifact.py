"""Artifact folders: program files beside a `manifest.json` that says what they are.

The manifest records the schema version, the staticrt/torch/onnx versions that wrote it, the model
config, the cache spec, batch size, lengths, window, prefill buckets, dtypes, every program's
input/output names and shapes, and the sha256 of every file. An artifact is built in a temporary
folder next to its target and renamed into place only when complete, so an interrupted export
leaves neither a half artifact nor a stray temporary folder. The loader checks the manifest and
every hash before anything is run and names the file or field that does not match.

This module imports no torch: an ONNX artifact deploys with onnxruntime and numpy alone.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ArtifactError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED_FIELDS = ("schema_version", "versions", "model", "cache", "formats", "files")
# Artifact formats, each run by the backend of its name (runtime.py), in the order a default is picked.
FORMATS = ("aoti", "pt2", "onnx")


def program_name(seq_len: int) -> str:
    """The name of the program that runs a step of `seq_len` tokens a row: `decode` or `prefill_N`."""
    return "decode" if seq_len == 1 else f"prefill_{seq_len}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_artifact(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `build(folder)`, which writes the artifact's files into `folder` and returns the
    manifest's fields; hash every file, write the manifest, and move the folder to `target`.

    Nothing appears at `target` unless `build` finishes; on any failure the temporary folder is
    removed and the error propagates. An existing artifact at `target` is replaced only once the
    new one is complete.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        fields = build(work)
        files = sorted(p for p in work.rglob("*") if p.is_file())
        manifest = {
            "schema_version": SCHEMA_VERSION,
            **fields,
            "files": {p.relative_to(work).as_posix(): sha256(p) for p in files},
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if target.exists():
            old = target.with_name(f".{target.name}.replaced")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            work.rename(target)
            shutil.rmtree(old)
        else:
            work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def read_manifest(folder: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of the artifact in `folder`, after checking its schema, its fields and (with
    `verify`) the sha256 of every file it lists."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} is not an artifact: {MANIFEST} is missing; export one with `staticrt export`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path} is not valid JSON ({err}); re-export the artifact") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: field schema_version is {version!r}, this staticrt reads schema_version {SCHEMA_VERSION}; "
            "re-export the artifact with this staticrt"
        )
    missing = [name for name in REQUIRED_FIELDS if name not in manifest]
    if missing:
        raise ArtifactError(f"{path}: field(s) {', '.join(missing)} missing; re-export the artifact")
    if verify:
        for name, expected in manifest["files"].items():
            file = folder / name
            if not file.is_file():
                raise ArtifactError(f"{file} is listed in {MANIFEST} but missing; re-export the artifact")
            if sha256(file) != expected:
                raise ArtifactError(
                    f"{file} does not match the sha256 in {MANIFEST} (changed or corrupted since export); "
                    "re-export the artifact"
                )
    return manifest


def require_format(folder: Path, manifest: dict[str, Any], backend: str | None) -> None:
    """Refuse to run `backend` on an artifact that does not hold its format; every backend checks here."""
    held = [b for b in FORMATS if b in manifest["formats"]]
    if backend not in held:
        raise ArtifactError(
            f"{folder} holds format(s) {', '.join(manifest['formats'])}, not {backend!r}; run it with one of "
            f"{', '.join(held)} or re-export with --format {backend}"
        )
