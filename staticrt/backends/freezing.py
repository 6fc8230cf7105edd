"""Frozen weights for CPU decode and verify graphs: inductor's freezing, packed for oneDNN's GEMM."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _OneDnnLinears:
    """torch.ops.mkldnn as inductor's weight-pack pass sees it, saying "pack fp32 for oneDNN"."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return (lambda: True) if name == "_is_mkldnn_acl_supported" else getattr(self._ops, name)


@contextmanager
def frozen_decode_weights() -> Iterator[None]:
    """Compile the graph traced inside with its weights frozen and prepacked for oneDNN's GEMM.

    A decode step is a few rows times every weight. With weights as graph inputs, inductor calls
    MKL's sgemm, which on the project's CPU runs a `[8, C]` step at ~2.5x the time of a `[1, C]`
    one; oneDNN's prepacked GEMM reads the weights once for all rows (docs/measurements.md).
    Inductor packs weights only when `freezing` is on during the trace, and for fp32 picks MKL's
    packed GEMM (no faster) unless it believes oneDNN is the only path (its `acl` check); the
    second patch answers that check, for the pack pass alone. Torch does not promise either
    name: where they are gone, the graph compiles as before (same tokens, slower).
    Frozen weights are constants of the graph, each frozen graph holding its own packed copy; a
    generation after weights changed in place is refused (`CompiledBackend.step`), never computed
    with the old ones.
    """
    import torch._inductor.config as inductor_config

    try:
        from torch._inductor.fx_passes import mkldnn_fusion
    except ImportError:
        mkldnn_fusion = None
    with inductor_config.patch(freezing=True):
        if mkldnn_fusion is None or not hasattr(mkldnn_fusion, "mkldnn"):
            yield
            return
        original = mkldnn_fusion.mkldnn
        mkldnn_fusion.mkldnn = _OneDnnLinears(original)
        try:
            yield
        finally:
            mkldnn_fusion.mkldnn = original
