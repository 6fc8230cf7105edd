"""Model + cache -> torch.export programs (`.pt2`) and AOTInductor packages, in an artifact folder.

One program per step shape: `decode` (T = 1) and `prefill_N` per prefill bucket, each the whole
step (model and cache write, up to the logits; tokens are chosen on the host) with the cache's K/V
as buffers the program mutates in place. Every program and package refers to the same constants
by name (`model.*` weights, `cache.*` state), and the loader (backends/exported.py) hands them
all the same tensors, so a prefill program fills the cache the decode program reads, and the
weights exist once.

Files, beside manifest.json:
  weights.safetensors   every weight once, in the layout the programs were traced with
  pt2/NAME.pt2          torch.export programs without weights (format "pt2"), run by
                        `ExportedProgram.module()` once the loader has put the weights in
  aoti/NAME.pt2         AOTInductor packages without the weights (format "aoti"; they hold only
                        constants inductor made, `keep_own_weights`): they load with no model source
                        and no compile
Both are zip archives torch reads, stored deflated (`deflate`).
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..artifacts.manifest import aoti_package_weights, program_name
from ..caches import KVCache
from ..cpp_builds.aoti_runtime import runtime_compiled_once
from ..dtypes import dtype_name
from ..models.decoder import Decoder

WEIGHTS = "weights.safetensors"
Timed = Callable[[str, Callable[[], Any]], Any]  # runs a stage, reports what finished and its time


class StepProgram(nn.Module):
    """The unit a program holds: one step over `input_ids [B, T]` at `write_index [B]` with
    `num_new [B]` real tokens a row, returning the float32 logits of each row's last real token
    `[B, V]`. The token is chosen on the host (host_sampling.py, as for ONNX Runtime), so one
    program serves greedy and sampled requests, row by row."""

    def __init__(self, model: Decoder, cache: KVCache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, input_ids: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, write_index, self.cache, num_new).float()


def example_inputs(batch: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
    write_index = torch.zeros(batch, dtype=torch.int64, device=device)
    return ids, write_index, torch.full((batch,), seq_len, dtype=torch.int64, device=device)


def io_spec(batch: int, seq_len: int, vocab: int) -> dict[str, Any]:
    """What the manifest says of a program's inputs and outputs."""
    return {
        "seq_len": seq_len,
        "inputs": [
            {"name": "input_ids", "shape": [batch, seq_len], "dtype": "int64"},
            {"name": "write_index", "shape": [batch], "dtype": "int64"},
            {"name": "num_new", "shape": [batch], "dtype": "int64"},
        ],
        "outputs": [{"name": "logits", "shape": [batch, vocab], "dtype": "float32"}],
    }


def export_programs(step: StepProgram, batch: int, buckets: Sequence[int]) -> dict[str, torch.export.ExportedProgram]:
    """`decode` and one `prefill_N` a bucket, traced with static shapes."""
    device = next(step.model.parameters()).device
    programs = {}
    for seq_len in sorted({1, *buckets}):
        with torch.no_grad():
            programs[program_name(seq_len)] = torch.export.export(
                step, example_inputs(batch, seq_len, device), strict=False
            )
    return programs


def program_constants(step: StepProgram) -> dict[str, torch.Tensor]:
    """Every weight (`model.*`) and cache buffer (`cache.*`) by the name programs use."""
    return dict(step.named_parameters()) | dict(step.named_buffers())


def constant_layouts(constants: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Shape, dtype and strides of every constant. Strides matter: the CPU model keeps its weights
    column-major (model.use_column_major_weights) and the compiled code indexes them that way, so
    the loader must hand them back in the same layout."""
    return {
        name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "strides": list(t.stride())}
        for name, t in constants.items()
    }


@contextmanager
def hollow_state(programs: dict[str, torch.export.ExportedProgram]) -> Iterator[None]:
    """Within: every program's weights and buffers are one element each, stretched (stride 0) to
    their shape and dtype, so `torch.export.save` writes the graph and no weight bytes. The loader
    replaces each of them with the one tensor weights.safetensors holds (backends/exported.py);
    saved whole, each program carried its own copy of every weight."""
    saved = {name: dict(ep.state_dict) for name, ep in programs.items()}
    try:
        for ep in programs.values():
            for key, tensor in ep.state_dict.items():
                hollow = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
                ep.state_dict[key] = nn.Parameter(hollow, False) if isinstance(tensor, nn.Parameter) else hollow
        yield
    finally:
        for name, ep in programs.items():
            ep.state_dict.update(saved[name])


def deflate(archive: Path, drop: Collection[str] = (), replace: Mapping[str, bytes] | None = None) -> None:
    """Rewrite the zip `archive` with its entries deflated, in place, without the entries `drop`
    and with `replace`'s bytes for its entries. torch writes a program's archive stored
    (uncompressed); its graph JSON then deflates 20x and an AOTInductor package (library and
    sources) 4x, which keeps the programs of a 30-layer model from adding a tenth to the artifact's
    bytes (docs/measurements.md). torch.export.load and our AOTInductor loader read deflated
    entries as they read stored ones."""
    replace = replace or {}
    staging = archive.with_name(archive.name + ".deflating")
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(staging, "w", zipfile.ZIP_DEFLATED) as target:
        for entry in source.infolist():
            if entry.filename not in drop:
                data = replace[entry.filename] if entry.filename in replace else source.read(entry)
                target.writestr(entry, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(staging, archive)


# AOTInductor writes every weight into its package (torch's `pickle_weights`), and `keep_own_weights`
# takes out the ones weights.safetensors holds: what stays is what inductor made while lowering
# (the int4 kernel's group size, a 0-d int64 constant a matmul), which no weights file has.
AOTI_OPTIONS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


def compile_package(program: torch.export.ExportedProgram, package: Path) -> None:
    """AOTInductor's package of `program`, every constant in it (AOTI_OPTIONS) until `keep_own_weights`."""
    from torch._inductor import aoti_compile_and_package

    with warnings.catch_warnings(), runtime_compiled_once():  # torch's own: its pickling of a LeafSpec
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
        aoti_compile_and_package(program, package_path=str(package), inductor_configs=AOTI_OPTIONS)


def keep_own_weights(package: Path, shared: Collection[str]) -> None:
    """Deflate the AOTInductor `package`, keeping only the weights it holds whose names are not
    in `shared` (the artifact's constants, which every program reads from weights.safetensors)."""
    with zipfile.ZipFile(package) as archive:
        config, held = aoti_package_weights(archive)
    own = {name: where for name, where in held.items() if name not in shared}
    drop = {where[0] for where in held.values()} - {where[0] for where in own.values()}
    listed = {name: [where[0].rsplit("/", 1)[1], *where[1:]] for name, where in own.items()}
    deflate(package, drop, {config: json.dumps(listed).encode()} if config else None)


def write_torch(
    folder: Path, step: StepProgram, buckets: Sequence[int], formats: Sequence[str], timed: Timed
) -> dict[str, Any]:
    """Write the `formats` ("aoti", "pt2") of `step`'s programs and weights.safetensors into
    `folder`; return their manifest fields."""
    from safetensors.torch import save_file

    constants = program_constants(step)
    batch = step.cache.spec.max_batch_size
    programs = timed("trace (torch.export)", lambda: export_programs(step, batch, buckets))
    if "pt2" in formats:
        (folder / "pt2").mkdir()
        with warnings.catch_warnings(), hollow_state(programs):  # save notes CPU weights share no storage group
            warnings.filterwarnings("ignore", message="No complete tensor found")
            timed(
                "write .pt2 programs",
                lambda: [torch.export.save(ep, folder / "pt2" / f"{name}.pt2") for name, ep in programs.items()],
            )
        for name in programs:
            deflate(folder / "pt2" / f"{name}.pt2")
    if "aoti" in formats:
        (folder / "aoti").mkdir()
        for name, ep in programs.items():
            # Weights stay out of the package: weights.safetensors holds them once for every program.
            package = folder / "aoti" / f"{name}.pt2"
            timed(f"lower and compile {name} (AOTInductor)", partial(compile_package, ep, package))
            keep_own_weights(package, constants)
    weights = {k: v.contiguous() for k, v in constants.items() if k.startswith("model.")}
    timed("write weights", lambda: save_file(weights, str(folder / WEIGHTS)))
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector ISA the aoti code targets
        "programs": {program_name(s): io_spec(batch, s, step.model.config.vocab_size) for s in sorted({1, *buckets})},
        "constants": constant_layouts(constants),
        "weights": WEIGHTS,
    }
