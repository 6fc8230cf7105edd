"""Exported backend: runs an artifact's torch programs through the one generation loop.

Format "aoti" loads AOTInductor packages (no model source, no compile at load); format "pt2" runs
the torch.export programs. Either way every program gets the same tensors for every constant
(weights read once from weights.safetensors, in the strides they were traced with; cache
buffers allocated here once), so prefill fills the cache that decode reads, in place.
"""

from __future__ import annotations

import io
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..artifacts.manifest import REEXPORT, aoti_libraries, aoti_package_weights, program_name
from ..caches.row_state import RowStash
from ..dtypes import recorded_dtype
from ..errors import ArtifactError, check_positions
from ..generation.host_sampling import choose
from ..generation.params import SamplingParams
from ..models.a8_kernels import load as load_kernels
from ..models.quant_spec import A8_CHOICES, A8_LAYOUT
from .artifact_base import ArtifactBackend

Program = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def load_constants(folder: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every constant the programs name: the weights in their traced strides, zeroed cache state."""
    from safetensors.torch import load_file

    source = folder / manifest["weights"]
    weights = load_file(str(source))
    constants = {}
    for name, layout in manifest["constants"].items():
        tensor = torch.empty_strided(layout["shape"], layout["strides"], dtype=recorded_dtype(layout["dtype"]))
        if name in weights:
            if weights[name].shape != tensor.shape:
                raise ArtifactError(
                    f"{source} holds {name} of shape {list(weights[name].shape)}, manifest.json records "
                    f"{layout['shape']}; the files do not belong together: {REEXPORT}"
                )
            tensor.copy_(weights[name])
        elif name.startswith("cache."):
            tensor.zero_()
        else:
            raise ArtifactError(f"{source} lacks constant {name}; {REEXPORT}")
        constants[name] = tensor
    return constants


def _aoti_program(path: Path, constants: dict[str, torch.Tensor]) -> Program:
    """The package's compiled model, run by torch's AOTInductor runner directly: the package
    loader would import inductor and probe the CPU's vector ISA by compiling test programs (once a
    process and once a machine; docs/measurements.md), which is most of a cold
    start. The ISA was recorded at export and checked by `ExportedBackend` instead."""
    with zipfile.ZipFile(path) as archive, tempfile.TemporaryDirectory() as scratch:
        libraries = aoti_libraries(archive)
        if len(libraries) != 1:
            raise ArtifactError(f"{path} holds {len(libraries)} compiled models, expected 1; re-export the artifact")
        # The runner reads the custom-op calls (staticrt's kernels) from beside the library, and
        # dlopen maps the library; the extracted files may go once it is loaded.
        library, calls = libraries[0]
        if calls is not None:
            archive.extract(calls, scratch)
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(archive.extract(library, scratch), 1)
        own = {name: _held_weight(archive, *where) for name, where in aoti_package_weights(archive)[1].items()}
    names = runner.get_constant_names_to_original_fqns()  # runner's constant name -> program fqn
    missing = [fqn for fqn in names.values() if fqn not in constants and fqn not in own]
    if missing:
        raise ArtifactError(f"{path} needs constants {missing[:3]} that manifest.json does not list; re-export")
    # user_managed: the runner keeps these very tensors (no copy), shared with every other program.
    supplied = {name: constants[fqn] if fqn in constants else own[fqn] for name, fqn in names.items()}
    runner.update_constant_buffer(supplied, False, True, True)
    return lambda *inputs: runner.run(list(inputs))[0]


def _held_weight(archive: zipfile.ZipFile, entry: str, shape: list, stride: list, offset: int) -> torch.Tensor:
    """A weight the AOTInductor package holds itself (torch.save'd; `keep_own_weights` says which)."""
    with archive.open(entry) as stored:
        whole = torch.load(io.BytesIO(stored.read()), weights_only=True)
    return whole.as_strided(shape, stride, offset)


def with_constants(
    program: torch.export.ExportedProgram, constants: dict[str, torch.Tensor]
) -> torch.export.ExportedProgram:
    """`program` (a pt2 file of an artifact, torch.export.load-ed) with the artifact's weights and
    cache state (`load_constants`) put in place of the one-element stand-ins it was saved with: the
    loader runs it so, every program sharing the same tensors, and so it can be lowered or run
    outside staticrt (ExecuTorch, AOTInductor, `module()`)."""
    missing = [name for name in program.state_dict if name not in constants]
    if missing:
        raise ArtifactError(f"a pt2 program needs constants {missing[:3]} that manifest.json does not list; {REEXPORT}")
    for name, stand_in in program.state_dict.items():
        tensor = constants[name]
        program.state_dict[name] = (
            torch.nn.Parameter(tensor, False) if isinstance(stand_in, torch.nn.Parameter) else tensor
        )
    return program


def _pt2_program(path: Path, constants: dict[str, torch.Tensor]) -> Program:
    return with_constants(torch.export.load(str(path)), constants).module()


class ExportedBackend(ArtifactBackend, RowStash):
    """A `StepBackend` over an artifact folder written by `staticrt export`."""

    row_positions = True

    def __init__(self, folder: str | Path, format: str = "aoti", manifest: dict[str, Any] | None = None) -> None:
        super().__init__(folder, format, manifest)
        folder, manifest = self.folder, self.manifest
        assert format in ("aoti", "pt2"), f"format {format!r} is not a torch program format; onnx runs on OnnxBackend"
        if manifest.get("device", "cpu") != "cpu":
            raise ArtifactError(f"{folder} was exported for {manifest['device']}; this backend runs CPU artifacts")
        capability = torch.backends.cpu.get_cpu_capability()
        if format == "aoti" and manifest.get("cpu_capability") != capability:
            raise ArtifactError(
                f"{folder / 'manifest.json'}: field cpu_capability is {manifest.get('cpu_capability')!r}, this CPU "
                f"offers {capability!r}; the compiled code may not run here: use --backend pt2 or re-export here"
            )
        if manifest.get("quantize") in A8_CHOICES:  # the programs call staticrt's kernels by name
            layout = manifest.get("a8_layout", 1)
            if manifest["quantize"] == "int4-a8" and layout != A8_LAYOUT:
                raise ArtifactError(
                    f"{folder / 'manifest.json'}: field a8_layout is {layout!r}: its int4 codes are laid out for "
                    f"an earlier staticrt's kernels, this one's read layout {A8_LAYOUT}; {REEXPORT}"
                )
            load_kernels(manifest["quantize"])
        self.constants = load_constants(folder, manifest)
        embedding = self.constants["model.embed_tokens.weight"]  # [V, C], as the weights file holds it
        self.check_loaded("vocab_size", self.vocab_size, embedding.shape[0], folder / manifest["weights"])
        load = _aoti_program if format == "aoti" else _pt2_program
        self.programs = {name: load(folder / format / f"{name}.pt2", self.constants) for name in manifest["programs"]}
        self.cache_state = {
            name.removeprefix("cache."): t for name, t in self.constants.items() if name.startswith("cache.")
        }
        self.name = f"exported-{format}"
        self.buckets = tuple(manifest["prefill_buckets"])

    def reset(self) -> None:
        for tensor in self.cache_state.values():
            tensor.zero_()

    def row_buffers(self) -> dict[str, torch.Tensor]:
        return self.cache_state

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        seq_len = input_ids.shape[1]
        check_positions(
            write_index, seq_len, self.max_sequence_len, self.cache_kind, way_out=self.remedy("max_cache_len")
        )
        program = self.programs[program_name(seq_len)]
        with torch.no_grad():
            logits = program(torch.from_numpy(input_ids), torch.from_numpy(write_index), torch.from_numpy(num_new))
        return choose(logits.numpy(), sampling, uniforms)  # logits [B, V] -> tokens [B]
