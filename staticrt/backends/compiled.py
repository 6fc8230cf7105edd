"""Compiled backend: `torch.compile(fullgraph=True, dynamic=False)` of the whole step.

One graph per (prefill bucket, choice) and one per choice for decode, the choice being greedy,
sample or beam{k} (`step_choice`). Dynamo keys its cache on code
objects, so each graph gets its own copy of `run_step`'s code: a new bucket is then a first
compile rather than a recompile, dynamo's recompile limit never silently drops a bucket to
eager, and `error_on_recompile` can prove that a generation never recompiles.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Hashable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..artifacts.user_cache import storing
from ..cpp_builds.kernel_libraries import few_kernel_libraries
from ..errors import GenerationError
from ..generation import builds
from ..generation.params import SamplingParams
from ..models.packed_linear import PACK_MIN_HIDDEN, packs, weight_stamps
from ..models.quant_spec import torchao_weights
from .eager import EagerBackend
from .freezing import frozen_decode_weights
from .graph_policy import GraphPolicy
from .graph_store import GraphStore, StepModule, StoredStep, live_addresses
from .guards import code_past_guards
from .step import StepFn, base_choice, gives_logprobs, graph_name, run_step, starts_fresh, step_choice, verifies

log = logging.getLogger("staticrt")


# What a greedy step runs as in a "pick" graph: each row top-k 1 at temperature 1, the argmax.
_GREEDY_AS_PICK = SamplingParams(True, 1.0, 1, 1.0)


def _own_code_copy(fn: types.FunctionType, tag: str, **keywords: Any) -> types.FunctionType:
    """`fn` under a code object of its own, its keyword-only defaults set to `keywords`: a
    constant of the graph traced from it."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **keywords}
    return copy


class CompiledBackend(GraphPolicy, EagerBackend):
    name = "compiled"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Graphs by (tokens a row, `step_choice`, `starts_fresh`).
        self._graphs: dict[tuple[int, str, bool], StepFn] = {}
        self._checked: dict[tuple[int, str, bool], StepFn] = {}  # what runs a graph whose guards passed this generation
        self._built: set[tuple[int, str, bool]] = set()  # graphs that have run once: compiled (and captured)
        self._frozen_weights: list[tuple[int, int]] | None = None  # weights as a frozen graph holds them
        self._no_bias: torch.Tensor | None = None  # the [B, V] zeros a step without a logit bias adds
        # CPU graphs kept across processes (graph_store.py); STATICRT_COMPILE_CACHE=off compiles each time.
        self.store = GraphStore(self.model, self.cache) if storing() else None

    def reset(self) -> None:
        super().reset()
        self._checked.clear()

    def run(
        self,
        choice: str,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> Any:
        """Each graph's first step of a generation goes through dynamo (guards, and a recompile
        if the model changed between generations); the rest run `past_guards` of it (guards.py).
        A `stream` callback must not change the model or the cache in the middle of a generation."""
        choice = self.graph_choice(choice)
        if base_choice(choice) == "pick" and uniforms is None:
            sampling, uniforms = (
                replace(_GREEDY_AS_PICK, bias=sampling.bias),
                np.zeros(len(input_ids), dtype=np.float32),
            )
        key = (input_ids.shape[1], choice, starts_fresh(write_index, input_ids.shape[1]))
        if key in self._checked:
            return super().run(choice, input_ids, write_index, num_new, sampling, uniforms)
        stored = self._graphs.get(key)
        if isinstance(stored, StoredStep) and stored.addresses != live_addresses(self._stored_graph(key)):
            del self._graphs[key]  # weights replaced since it loaded (dynamo would guard): load it for the new ones
        freezes = self.freezes(key[0], choice)
        if freezes and self._frozen_weights not in (None, weight_stamps(self.model)):
            raise GenerationError(
                "the model's weights changed in place after its decode graph froze them (CPU decode graphs "
                "hold the weights as they were at compile); build a new Generator for the changed model"
            )
        with frozen_decode_weights() if freezes else nullcontext(), few_kernel_libraries():
            result = super().run(choice, input_ids, write_index, num_new, sampling, uniforms)
        if freezes and self._frozen_weights is None:
            self._frozen_weights = weight_stamps(self.model)
        self._checked[key] = self.past_guards(self._graphs[key])
        return result

    def bias_input(self, bias: np.ndarray | None, batch: int) -> torch.Tensor:
        """Always a bias `[B, V]`, zeros where the step has none: one graph serves steps with a
        logit bias and steps without (an add of zeros leaves every logit, so every token, as it was)."""
        if bias is not None:
            return super().bias_input(bias, batch)
        if self._no_bias is None or self._no_bias.shape[0] != batch:
            self._no_bias = torch.zeros(batch, self.vocab_size, device=self.device)
        return self._no_bias

    def prepare(
        self,
        widths: Sequence[int],
        do_sample: bool,
        continuing: bool = False,
        fresh: bool = True,
        candidates: int = 0,
        verify: bool = False,
    ) -> float:
        """Compile (and, on CUDA, capture) each graph a generation will use for the first time, by
        running it once on dummy inputs (zeros, at position 0, or 1 for a `continuing` graph), and
        say so in the log: a 30-layer model takes minutes on a CPU. Rows that may hold tokens a
        later step continues (`live`) get their cache back afterwards. `candidates` > 0: the
        graphs of a beam step (`beam_step`); `verify`: of a step that checks drafts (`verify_step`)."""
        spent, batch, choice = 0.0, self.batch_size, self.graph_choice(step_choice(do_sample, candidates, verify))
        todo = self._unbuilt_keys(widths, choice, continuing, fresh)
        if not todo:
            return 0.0
        count = builds.current(len(todo))
        with self.cache.kept() if self.live else nullcontext():  # rows a later step continues
            for key in todo:
                width, _, starts = key
                name, began, stored = graph_name(*key), time.perf_counter(), self.stored(key)
                log.info(
                    "%s the %s step graph, %s (first use; later generations reuse it%s) ...",
                    *("loading" if stored else "compiling", name, count.number, count.left),
                )
                write_index = np.full(batch, 0 if starts or width == 1 else 1, dtype=np.int64)
                ones = np.ones(batch, dtype=np.int64)
                uniforms = np.zeros((batch, width, 2) if verify else batch, dtype=np.float32) if do_sample else None
                inputs = np.zeros((batch, width), dtype=np.int64)
                self.run(choice, inputs, write_index, ones, SamplingParams(do_sample), uniforms)
                self._built.add(key)
                spent += time.perf_counter() - began
                count.finished(time.perf_counter() - began)
                folder = self.store.loaded.get(key) if self.store else None
                done = f"loaded from the compile cache, {folder}," if folder else "compiled"
                log.info("%s the %s step graph in %.1f s", done, name, time.perf_counter() - began)
        return spent

    def unbuilt(
        self,
        widths: Sequence[int],
        do_sample: bool,
        continuing: bool = False,
        fresh: bool = True,
        candidates: int = 0,
        verify: bool = False,
    ) -> set[Hashable]:
        """The graphs `prepare` with these arguments would build, by (width, choice, fresh)."""
        choice = self.graph_choice(step_choice(do_sample, candidates, verify))
        return set(self._unbuilt_keys(widths, choice, continuing, fresh))

    def _unbuilt_keys(
        self, widths: Sequence[int], choice: str, continuing: bool, fresh: bool = True
    ) -> list[tuple[int, str, bool]]:
        limit = self.max_sequence_len
        keys = [(width, choice, width > 1) for width in widths if fresh or width == 1]  # a prefill at 0 starts fresh
        if continuing:  # and from position 1, where a continuing step of that width fits
            keys += [(w, choice, False) for w in widths if w > 1 and (limit is None or w < limit)]
        return [key for key in dict.fromkeys(keys) if key not in self._built]

    def past_guards(self, graph: StepFn) -> StepFn:
        """What runs `graph` for the rest of the generation, its guards having passed: its code
        called directly, or the graph itself where torch offers no such code."""
        if isinstance(graph, StoredStep):  # no dynamo, no guards
            return graph
        return code_past_guards(graph) or graph

    def step_function(self, seq_len: int, choice: str, fresh: bool) -> StepFn:
        key = (seq_len, choice, fresh)
        if key in self._checked:
            return self._checked[key]
        if key not in self._graphs and (graph := self._stored_graph(key)) is not None:
            try:
                self._graphs[key] = self.store.load(graph)
            except Exception as err:  # noqa: BLE001 - the store only saves time: compile as before
                name, reason = graph_name(*key), f"{type(err).__name__}: {err}"
                log.warning("the %s graph cannot go through the compile cache (%s); compiling it", name, reason)
        if key not in self._graphs:
            once = self.layers_once(seq_len, choice)
            compiled = torch.compile(
                _own_code_copy(
                    run_step,
                    graph_name(*key),
                    layers_once=once,
                    either=base_choice(choice) == "pick",
                    every_position=verifies(choice),
                    logprobs=gives_logprobs(choice),
                ),
                fullgraph=True,
                dynamic=False,
                **self.graph_options(seq_len, once),
            )
            self._graphs[key] = compiled
        return self._graphs[key]

    def _stored_graph(self, key: tuple[int, str, bool]) -> StepModule | None:
        """The graph `key` as the compile cache builds and keys it; None where graphs compile in
        the process: on CUDA (CUDA graphs capture them), for torchao's weights (its tensors do not
        travel as plain constants; staticrt's int8-a8/int4-a8 codes do), for a small model, or
        with the cache turned off. A float model's graphs, prefill as decode, read the packed
        twin's weights (packed_linear.py): SmolLM2 decodes 1.5x and prefills 200 tokens 2x faster
        than frozen decode and unpacked prefill graphs did (docs/measurements.md)."""
        small = self.model.config.hidden_size < PACK_MIN_HIDDEN  # compiles in seconds, faster in process
        if self.store is None or self.device.type != "cpu" or torchao_weights(self.model.quantization) or small:
            return None
        width, choice, _ = key
        return self.store.graph(key, packs(self.model), self.layers_once(width, choice, False))

    def stored(self, key: tuple[int, str, bool]) -> bool:
        """Whether the graph `key` is loaded from the compile cache rather than compiled."""
        graph = self._stored_graph(key)
        return graph is not None and self.store.holds(graph)
