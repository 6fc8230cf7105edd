"""Model + cache -> torch.export programs (`.pt2`) and AOTInductor packages, in an artifact folder.

One program per step shape: `decode` (T = 1) and `prefill_N` per prefill bucket, each the whole
step (model, cache write, greedy choice) with the cache's K/V as buffers the program mutates in
place. Every program and package refers to the same constants by name (`model.*` weights,
`cache.*` state), and the loader (backends/exported.py) hands them all the same tensors, so a
prefill program fills the cache the decode program reads, and the weights exist once.

Files, beside manifest.json:
  weights.safetensors   every weight once, in the layout the programs were traced with
  pt2/NAME.pt2          torch.export programs (format "pt2"), run by `ExportedProgram.module()`
  aoti/NAME.pt2         AOTInductor packages without weights inside (format "aoti"): they load with
                        no model source and no compile
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import __version__
from ..artifact import ArtifactError, program_name, write_artifact
from ..caches import KVCache, build_cache
from ..caches.base import CacheSpec
from ..model import Decoder
from ..sampling import greedy

TORCH_FORMATS = ("aoti", "pt2")
EXPORTABLE_CACHES = ("static", "sliding", "hybrid", "auto")
WEIGHTS = "weights.safetensors"
Stage = Callable[[str, float], None]  # (what finished, seconds it took)


class StepProgram(nn.Module):
    """The unit a program holds: one greedy step over `input_ids [B, T]` at `write_index [B]`
    with `num_new [B]` real tokens a row, returning the next token of each row `[B]`."""

    def __init__(self, model: Decoder, cache: KVCache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, input_ids: torch.Tensor, write_index: torch.Tensor, num_new: torch.Tensor) -> torch.Tensor:
        return greedy(self.model(input_ids, write_index, self.cache, num_new))


def example_inputs(batch: int, steps: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros(batch, steps, dtype=torch.int64, device=device)
    write_index = torch.zeros(batch, dtype=torch.int64, device=device)
    return ids, write_index, torch.full((batch,), steps, dtype=torch.int64, device=device)


def io_spec(batch: int, steps: int) -> dict[str, Any]:
    """What the manifest says of a program's inputs and outputs."""
    return {
        "steps": steps,
        "inputs": [
            {"name": "input_ids", "shape": [batch, steps], "dtype": "int64"},
            {"name": "write_index", "shape": [batch], "dtype": "int64"},
            {"name": "num_new", "shape": [batch], "dtype": "int64"},
        ],
        "outputs": [{"name": "next_ids", "shape": [batch], "dtype": "int64"}],
    }


def export_programs(step: StepProgram, batch: int, buckets: Sequence[int]) -> dict[str, torch.export.ExportedProgram]:
    """`decode` and one `prefill_N` a bucket, traced with static shapes."""
    device = next(step.model.parameters()).device
    programs = {}
    for steps in sorted({1, *buckets}):
        with torch.no_grad():
            programs[program_name(steps)] = torch.export.export(step, example_inputs(batch, steps, device), strict=False)
    return programs


def program_constants(step: StepProgram) -> dict[str, torch.Tensor]:
    """Every weight (`model.*`) and cache buffer (`cache.*`) by the name programs use."""
    return dict(step.named_parameters()) | dict(step.named_buffers())


def constant_layouts(constants: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Shape, dtype and strides of every constant. Strides matter: the CPU model keeps its weights
    column-major (model.use_column_major_weights) and the compiled code indexes them that way, so
    the loader must hand them back in the same layout."""
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "strides": list(t.stride())}
        for name, t in constants.items()
    }


def export_torch(
    model: Decoder,
    spec: CacheSpec,
    buckets: Sequence[int],
    target: Path,
    formats: Sequence[str] = TORCH_FORMATS,
    fields: dict[str, Any] | None = None,
    on_stage: Stage = lambda what, seconds: None,
    extra_files: Callable[[Path], None] = lambda folder: None,
) -> Path:
    """Export `model` with a cache of `spec` to the artifact folder `target` (atomically).

    `fields` are merged into the manifest (e.g. the recipe); `extra_files(folder)` may add files
    (the tokenizer) before the hashes are taken.
    """
    unknown = [f for f in formats if f not in TORCH_FORMATS]
    if unknown or not formats:
        raise ArtifactError(f"format(s) {unknown or formats} are not torch formats; choose from {', '.join(TORCH_FORMATS)}")
    if spec.kind not in EXPORTABLE_CACHES:
        raise ArtifactError(
            f"cache {spec.kind!r} cannot be exported (its host transfers live outside the program); choose one "
            f"of {', '.join(EXPORTABLE_CACHES)}"
        )
    param = next(model.parameters())
    cache = build_cache(model.config, spec, param.dtype, param.device)
    step = StepProgram(model, cache).eval()
    constants = program_constants(step)
    if any(b > cache.spec.max_cache_len for b in buckets):
        raise ArtifactError(f"prefill buckets {list(buckets)} must not exceed max_cache_len {cache.spec.max_cache_len}")
    batch = cache.spec.max_batch_size

    def timed(what: str, run: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = run()
        on_stage(what, time.perf_counter() - start)
        return result

    def build(folder: Path) -> dict[str, Any]:
        from safetensors.torch import save_file
        from torch._inductor import aoti_compile_and_package

        programs = timed("trace (torch.export)", lambda: export_programs(step, batch, buckets))
        if "pt2" in formats:
            (folder / "pt2").mkdir()
            timed("write .pt2 programs", lambda: [torch.export.save(ep, folder / "pt2" / f"{name}.pt2")
                                                  for name, ep in programs.items()])
        if "aoti" in formats:
            (folder / "aoti").mkdir()
            for name, ep in programs.items():
                # Weights stay out of the package: weights.safetensors holds them once for every program.
                timed(f"lower and compile {name} (AOTInductor)", lambda: aoti_compile_and_package(
                    ep, package_path=str(folder / "aoti" / f"{name}.pt2"),
                    inductor_configs={"aot_inductor.package_constants_in_so": False}))
        weights = {k: v.contiguous() for k, v in constants.items() if k.startswith("model.")}
        timed("write weights", lambda: save_file(weights, str(folder / WEIGHTS)))
        extra_files(folder)
        return {
            "versions": _versions(),
            "model": {"config": model.config.to_dict(), "source": getattr(model, "source", None)},
            "cache": {
                "kind": cache.kind, "max_batch_size": batch, "max_cache_len": cache.spec.max_cache_len,
                "window": cache.window, "max_sequence_len": cache.max_sequence_len,
                "layers": [cache.layer_kind(i) for i in range(len(cache.rotating))],
            },
            "dtype": str(param.dtype).removeprefix("torch."),
            "device": param.device.type,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the vector ISA the aoti code targets
            "prefill_buckets": sorted(set(buckets)),
            "formats": list(formats),
            "programs": {program_name(s): io_spec(batch, s) for s in sorted({1, *buckets})},
            "constants": constant_layouts(constants),
            "weights": WEIGHTS,
            **(fields or {}),
        }

    return write_artifact(target, build)


def _versions() -> dict[str, str]:
    import onnx

    return {"staticrt": __version__, "torch": torch.__version__, "onnx": onnx.__version__}
