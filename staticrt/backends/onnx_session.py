"""The ONNX Runtime session an artifact's graph runs in: its providers and options, errors that
name the graph and the way out, and ONNX Runtime's CUDA graph where it will capture one."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, first_line
from .mapped_pages import release_read_pages
from .onnx_packed import packed_session


class OnnxCudaGraphWarning(UserWarning):
    """ONNX Runtime would not capture an artifact's decode in a CUDA graph: it runs on CUDA without."""


class _NoCapture(Exception):
    """ONNX Runtime refused the session's CUDA graph (its reason as the message)."""


# How onnxruntime says it will not capture: some node runs off the CUDA provider, or a copy between
# host and device sits inside the graph (InferenceSession::Initialize, "graph capture feature").
_NO_CAPTURE = "cannot use the graph capture feature"


def session(
    path: Path,
    threads: int | None,
    device: str,
    cuda_graphs: bool,
    manifest: dict[str, Any],
    verified: Callable[[], Any] = lambda: None,
) -> tuple[Any, bool]:
    """An InferenceSession for the graph at `path` and whether its CUDA graph is on (asked with
    `cuda_graphs`; where ONNX Runtime refuses to capture one, the session runs without it, with
    an `OnnxCudaGraphWarning`), or an ArtifactError that names the graph, its opset and the
    installed onnxruntime, and the way out. `verified()` returns once the artifact's files have
    passed their hashes: nothing is written from them before (onnx_packed.py)."""
    try:
        return _session(path, threads, device, cuda_graphs, manifest, verified), cuda_graphs
    except _NoCapture as err:
        reason = str(err)
    warnings.warn(
        f"{path}: ONNX Runtime would not capture its decode step in a CUDA graph ({reason}); decode runs on "
        "CUDA without one, launching each node's kernels every step. Its node placements (the session at log "
        "level 0, or bench/onnx_placement.py) show which node or copy keeps it off",
        OnnxCudaGraphWarning,
        stacklevel=3,
    )
    return _session(path, threads, device, False, manifest, verified), False


def _session(
    path: Path, threads: int | None, device: str, capture: bool, manifest: dict[str, Any], verified: Callable[[], Any]
) -> Any:
    """An InferenceSession (on the CPU, over the packed copy of the graph: onnx_packed.py), or an
    ArtifactError: ONNX Runtime's CPU provider has no bfloat16 kernels for most operators (a
    bfloat16 graph loads on CUDA only)."""
    import onnxruntime as ort

    def options() -> Any:
        made = ort.SessionOptions()
        # Loading logs errors only: the graph's optional input (logits_index, whose default is an
        # initializer) draws a warning on every load that it is not constant-folded, which it must not
        # be. A run logs warnings (`run_options`), where ONNX Runtime says what it copies.
        made.log_severity_level = 3
        if threads:
            made.intra_op_num_threads = threads
        return made

    providers: list[Any] = ["CPUExecutionProvider"]
    if device == "cuda":
        # ONNX Runtime's CUDA provider multiplies float32 matrices in TF32 (10-bit mantissas) unless
        # told not to; a float32 artifact computes in float32, as torch's CUDA backends do
        cuda = {"enable_cuda_graph": "1" if capture else "0", "use_tf32": "0"}
        providers.insert(0, ("CUDAExecutionProvider", cuda))

    def make(graph: str, asked: Any) -> Any:
        try:
            made = ort.InferenceSession(graph, asked, providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types, by status
            reason, section = first_line(err), manifest["onnx"]
            if capture and _NO_CAPTURE in reason:
                raise _NoCapture(reason) from None
            bfloat16_on_cpu = manifest["dtype"] == "bfloat16" and device == "cpu"
            way_out = (
                "ONNX Runtime's CPU provider has no bfloat16 kernels for it: run it where a CUDA GPU is (the onnx "
                "backend takes it when present), or re-export with --dtype float32 or float16 for the CPU"
                if bfloat16_on_cpu
                else f"install an onnxruntime-gpu that runs opset {section['opset']} or re-export the artifact with "
                "this staticrt"
            )
            raise ArtifactError(
                f"{graph}: onnxruntime {ort.__version__} cannot load this graph (opset {section['opset']}, IR version "
                f"{section['ir_version']}, {manifest['dtype']}): {reason}; {way_out}"
            ) from None
        if device == "cpu":  # what making it read and its steps do not (mapped_pages.py)
            release_read_pages()
        return made

    if device == "cpu":
        return packed_session(path, manifest, make, options, verified)
    return make(str(path), options())


def has_cuda_device() -> bool:
    """Whether a CUDA device is present (onnxruntime-gpu lists its CUDA provider on any machine)."""
    import ctypes

    try:
        count = ctypes.c_int(0)
        return ctypes.CDLL("libcudart.so").cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return False
