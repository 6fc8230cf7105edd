"""Backend "reduce-overhead": `torch.compile(mode="reduce-overhead")`, inductor's own CUDA graphs,
kept beside staticrt's cudagraph backend as the contender it is measured against."""

from __future__ import annotations

from .compiled import CompiledBackend
from .step import StepFn


class ReduceOverheadBackend(CompiledBackend):
    """`torch.compile(mode="reduce-overhead")`: inductor captures and replays CUDA graphs itself."""

    name = "reduce-overhead"
    compile_options = {"mode": "reduce-overhead"}

    def past_guards(self, graph: StepFn) -> StepFn:
        """Always through dynamo: inductor's CUDA-graph trees run inside dynamo's call wrapper."""
        return graph
