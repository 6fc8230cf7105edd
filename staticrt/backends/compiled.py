"""Compiled backend: `torch.compile(fullgraph=True, dynamic=False)` of the whole step.

One graph per (prefill bucket, greedy|sample) and one for decode. Dynamo keys its cache on code
objects, so each graph gets its own copy of `run_step`'s code: a new bucket is then a first
compile rather than a recompile, dynamo's recompile limit never silently drops a bucket to
eager, and `error_on_recompile` can prove that a generation never recompiles.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from ..generate import SamplingParams
from .eager import EagerBackend, StepFn, run_step


def _own_code_copy(fn: types.FunctionType, tag: str) -> types.FunctionType:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledBackend(EagerBackend):
    name = "compiled"
    # The C++ wrapper calls the step's GEMMs and fused kernels without a Python round trip
    # each: on bench-llama (2 CPU threads) decode went from ~10.5 to ~8 ms/token. Inductor's
    # `freezing` (constant weights, MKL pre-packing) measured no faster once the weights are
    # column-major (see `use_column_major_weights`), and costs compile time and a weight copy.
    options = {"cpp_wrapper": True}
    mode: str | None = None  # a torch.compile mode instead of `options` (cudagraph.py's reduce-overhead)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._graphs: dict[tuple[int, bool], StepFn] = {}
        self._checked: dict[tuple[int, bool], StepFn] = {}  # graphs whose guards passed in this generation

    def reset(self) -> None:
        super().reset()
        self._checked.clear()

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        """Each call of a compiled function goes through dynamo's frame hook, which looks up the
        cache entry and checks its guards (the shape, stride, dtype and device of every weight,
        buffer and input): ~0.5 ms a decode step on bench-llama with 2 CPU threads, ~5% of it, and
        still ~0.3 ms under `set_stance(skip_guard_eval_unsafe=True)`. Within one generation nothing
        the guards check can change (the loop fixes every input's shape and dtype, and model and
        cache stay put). So each graph's first step of a generation goes through dynamo, and the
        rest call the code dynamo ran for it (`_checked_code`) directly. The next generation
        checks the guards again, so a model changed between generations (a dtype, a device, a
        layout) recompiles; a `stream` callback must not change model or cache in the middle of one."""
        key = (input_ids.shape[1], uniforms is not None)
        next_ids = super().step(input_ids, write_index, num_new, sampling, uniforms)
        if key not in self._checked and self.mode is None:
            self._checked[key] = self._checked_code(self._graphs[key])
        return next_ids

    @staticmethod
    def _checked_code(graph: StepFn) -> StepFn:
        """The code dynamo ran on `graph`'s last call, as a plain function: it fetches the weights,
        buffers and inputs and calls the compiled graph, with no frame hook and no guards. Dynamo
        keeps a code object's cache entries most recently used first, so the first entry is the
        one whose guards just passed."""
        original = graph._torchdynamo_orig_callable  # the function torch.compile wrapped
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(original.__code__)
        code = entries[0].code
        return types.FunctionType(code, original.__globals__, code.co_name)

    def step_function(self, steps: int, do_sample: bool) -> StepFn:
        key = (steps, do_sample)
        if key in self._checked:
            return self._checked[key]
        if key not in self._graphs:
            tag = f"{'decode' if steps == 1 else f'prefill{steps}'}_{'sample' if do_sample else 'greedy'}"
            how = {"mode": self.mode} if self.mode else {"options": self.options}
            self._graphs[key] = torch.compile(_own_code_copy(run_step, tag), fullgraph=True, dynamic=False, **how)
        return self._graphs[key]
