"""Which kind of graph a compiled step becomes (compiled.py): the options torch.compile is given,
whether a decode graph freezes oneDNN-packed weights, whether a prefill graph compiles its layer
once, and which steps share a graph. A policy over the model and the device, apart from the
compiling and loading that follow it; the CUDA-graph backend overrides parts of it."""

from __future__ import annotations

from typing import Any

import torch

from ..models.packed_linear import PACK_MIN_HIDDEN
from .step import base_choice, verifies

# Inductor's FX cache refuses a graph holding a higher-order op unless the op is named here, and
# every CPU step graph holds `sampling.pick`'s torch.cond: each process compiled every graph again.
# The branches are subgraph modules whose code goes into the key (inductor's cache pickler reduces
# a GraphModule with its children), so a hit is the same graph. A second process's first compiled
# generate of tiny-llama: 34 s before, 9.8 s with it (2-core AVX2 EPYC, docs/measurements.md).
CACHEABLE_COND = {"unsafe_marked_cacheable_functions": {"torch.ops.higher_order.cond": torch.__version__}}


class GraphPolicy:
    """Mixed into `CompiledBackend`, which has the `model` and `device` it reads."""

    model: Any
    device: torch.device

    # How torch.compile is asked. The C++ wrapper calls the step's GEMMs and fused kernels without
    # a Python round trip each, the CPU's fastest path; built apart from the kernels, the wrapper
    # (one long function over every layer) compiles at -O1, which halves a first compile of a
    # 30-layer model at no measurable decode cost (docs/measurements.md).
    compile_options: dict[str, Any] = {
        "options": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, **CACHEABLE_COND}
    }
    # A CPU prefill graph of a float model compiles its layer once (`Decoder.forward`'s
    # `layers_once`), which torch 2.13 codegens only with the Python wrapper: SmolLM2's prefill
    # graph compiled in 27 s instead of 51 s, at the same prefill time (docs/measurements.md).
    # Decode keeps the C++ wrapper and frozen weights, which the region cannot have and whose
    # step is a third faster.
    layers_once_options: dict[str, Any] = {"options": {**CACHEABLE_COND}}

    def graph_choice(self, choice: str) -> str:
        """The graph a step of `choice` runs in. On the CPU greedy and sampling steps share one,
        "pick" (`sampling.pick`: the argmax where every row is greedy, no sort): a server compiles
        half the graphs, and the frozen decode graph packs its weights once ("pick_logprobs" where
        the step returns log-probabilities). CUDA graphs keep one graph a choice: a graph captured
        for replay cannot branch on its data."""
        base = base_choice(choice)
        return "pick" + choice[len(base) :] if base in ("greedy", "sample") and self.device.type == "cpu" else choice

    def freezes(self, seq_len: int, choice: str = "pick", in_process: bool = True) -> bool:
        """Whether a graph of width `seq_len` reads oneDNN-packed weights: a CPU decode or verify
        graph whose matrices are large enough to repay oneDNN's ~20 µs a call (hidden size
        `PACK_MIN_HIDDEN` and up). A verify step's few rows a row read the packed weights once, at
        about a decode step's time (SmolLM2, 5 wide: 29 against 30 ms; unpacked 78 ms). Such a
        graph compiled in the process freezes its weights and packs its own copy; a stored graph,
        any width, reads the packed twin's copy instead, one for all (`_stored_graph`).
        Prefill graphs compiled in the process keep the weights as inputs (each frozen graph would
        hold a packed copy), unless the model is packed in place (`packed_linear.pack`: any graph
        of it freezes, holding its tensors, not copies); so do quantized weights, whose kernels
        read them as they are (freezing would fold them back into floats). `in_process=False` asks
        for a stored graph, which never freezes: the packed clause does not apply to it."""
        return (
            (seq_len == 1 or verifies(choice) or (in_process and self.model.packed))
            and self.device.type == "cpu"
            and self.model.config.hidden_size >= PACK_MIN_HIDDEN
            and self.model.quantization is None
        )

    def layers_once(self, seq_len: int, choice: str = "pick", in_process: bool = True) -> bool:
        """Whether a graph of width `seq_len` compiles its layer once (`layers_once_options`): a CPU
        prefill graph of a float model, unless it freezes (a frozen verify graph keeps the C++
        wrapper, as decode; inductor's freezing fails inside the region).
        torchao's weights cannot enter the region in torch 2.13, and on CUDA the graphs keep the
        path that CUDA graphs were written for."""
        return (
            seq_len > 1
            and self.device.type == "cpu"
            and self.model.quantization is None
            and not self.freezes(seq_len, choice, in_process)
        )

    def graph_options(self, seq_len: int, layers_once: bool) -> dict[str, Any]:
        """How torch.compile is asked for a graph of `seq_len` tokens a row (`layers_once`: see
        `layers_once_options`)."""
        return self.layers_once_options if layers_once else self.compile_options
