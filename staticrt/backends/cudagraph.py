"""CUDA-graph backend: each step shape is the compiled step captured once in a CUDA graph and
replayed, so a decode step costs one graph launch plus a few small copies.

For the Generator's batch size there is one graph per (tokens a row, greedy|sample|beam{k}): decode
and each prefill bucket. A graph reads its inputs from static buffers (`input_ids`, `write_index`,
`num_new`, sampling parameters, the uniform random numbers) and writes the chosen ids (a beam
step: each row's k candidates) to static outputs; all graphs share one memory pool. The greedy
and sampling decode graphs also feed themselves: they copy their output into their own
`input_ids` and advance `write_index`, so in steady decode the host copies nothing in (only the
sampling uniforms when sampling) and reads the ids out once a step. Beam search's reordering of
the cache rows is a captured graph of its own, over a static `rows` buffer.

A graph is captured the first time its shape is asked for, mid-generation: the compiled step is
warmed up on a side stream (which compiles it) and captured, and because warm-up runs the step
for real, the cache and the static inputs are saved before and restored after. After capture a
generation allocates no device memory.

Without CUDA, `backend="cudagraph"` warns once and runs the compiled path, so a script written
for a GPU still runs on a CPU. Backend "reduce-overhead" is `torch.compile(mode="reduce-overhead")`
(inductor's own CUDA graphs) for comparison.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..generation.loop import SamplingParams, per_row
from .compiled import CompiledBackend
from .eager import VERIFY_SAMPLE, StepFn, choice_candidates, starts_fresh, step_choice, verifies

_WARNED = False


def _uniform_input(choice: str, batch: int, seq_len: int, dev: torch.device) -> torch.Tensor | None:
    """A captured step's uniform input: `[B]` for a sampling step, `[B, T, 2]` for a verify step
    that samples (`sampling.verify_sample`), none for greedy."""
    if choice == VERIFY_SAMPLE:
        return torch.zeros(batch, seq_len, 2, dtype=torch.float32, device=dev)
    return torch.zeros(batch, dtype=torch.float32, device=dev) if choice == "sample" else None


class CudaGraphWarning(UserWarning):
    """The cudagraph backend fell back to the compiled path (no CUDA device)."""


def _warn_no_cuda(device: torch.device) -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            f"backend 'cudagraph' needs a CUDA device and the model is on {device}; running the compiled backend "
            "instead (the same tokens, without CUDA graphs)",
            CudaGraphWarning,
            stacklevel=4,
        )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static buffers the graph reads, by step argument name
    output: Any  # on the device: [B] int64 chosen ids, or a beam step's ([B, k] float32, [B, k] int64)
    expected: tuple[np.ndarray, np.ndarray] | None = None  # decode: (ids, write_index) its buffers hold next
    params: tuple[tuple[Any, ...], ...] | None = None  # sampling parameters its buffers hold, a row each


class CudaGraphBackend(CompiledBackend):
    name = "cudagraph"
    compile_options: dict[str, Any] = {"options": {}}  # inductor's defaults on CUDA (cpp_wrapper is the CPU's)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.captured: dict[tuple[int, str, bool], _Graph] = {}  # by (tokens a row, `step_choice`, `starts_fresh`)
        self.reorder_graph: _Graph | None = None
        self.decode_from: np.ndarray | None = None  # write_index of the last generation's first decode step
        if self.device.type != "cuda":
            _warn_no_cuda(self.device)
            self.compile_options = CompiledBackend.compile_options
            return
        self.pool = torch.cuda.graph_pool_handle()  # one pool for every graph
        self.host_ids = torch.empty(self.batch_size, dtype=torch.int64, pin_memory=True)

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        if self.device.type != "cuda":
            return super().step(input_ids, write_index, num_new, sampling, uniforms)
        batch, seq_len = input_ids.shape
        if seq_len == 1 and self.decode_from is None:
            self.decode_from = write_index.copy()
        choice = step_choice(uniforms is not None)
        output = self.run(choice, input_ids, write_index, num_new, sampling, uniforms)
        # The step's one device-to-host synchronisation: the chosen ids, copied out of the graph's
        # output before the next replay overwrites it.
        self.host_ids.copy_(output, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        next_ids = self.host_ids.numpy().copy()
        if seq_len == 1:  # the graph left these in its own input buffers
            self.captured[1, choice, False].expected = (next_ids.reshape(batch, 1), write_index + 1)
        return next_ids

    def run(
        self,
        choice: str,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> Any:
        """Replay the step's graph (captured on first use) and return its static output buffers."""
        if self.device.type != "cuda":
            return super().run(choice, input_ids, write_index, num_new, sampling, uniforms)
        seq_len = input_ids.shape[1]
        self.cache.check_step(write_index, seq_len)
        key = (seq_len, choice, starts_fresh(write_index, seq_len))
        if key not in self.captured:
            self.captured[key] = self._capture(key, input_ids, write_index, num_new, sampling, uniforms)
        entry = self.captured[key]
        self._load_inputs(entry, input_ids, write_index, num_new, sampling, uniforms)
        entry.graph.replay()
        return entry.output

    def reorder_rows(self, rows: np.ndarray) -> None:
        """Beam search's in-place reorder of the cache rows, as a captured graph on CUDA. Warm-up
        and capture run it with `rows` the identity, which leaves the cache as it is."""
        if self.device.type != "cuda":
            return super().reorder_rows(rows)
        if self.reorder_graph is None:
            buffer = torch.arange(self.batch_size, device=self.device)
            entry = _Graph(torch.cuda.CUDAGraph(), {"rows": buffer}, None)
            self._warm_and_capture(entry, lambda: self.cache.reorder_cache(buffer))
            self.reorder_graph = entry
        self.reorder_graph.inputs["rows"].copy_(torch.from_numpy(rows), non_blocking=True)
        self.reorder_graph.graph.replay()

    def reset(self) -> None:
        super().reset()
        self.decode_from = None

    def report(self) -> dict[str, Any]:
        """Also, on CUDA, the GPU time of one replay of the greedy decode graph (`graph_gpu_ms`)."""
        report = super().report()
        decode = self.captured.get((1, "greedy", False))
        if decode is not None and self.decode_from is not None:
            report["graph_gpu_ms"] = 1000 * self.graph_gpu_s(decode, self.decode_from)
            decode.expected = None  # the replays left other inputs in its buffers
        return report

    @staticmethod
    def graph_gpu_s(entry: _Graph, write_index: np.ndarray, repeats: int = 50) -> float:
        """Seconds of GPU time one replay of a decode graph takes, from CUDA events around each
        replay (the host's share of a step is the step's wall time minus this). The graph advances
        its own `write_index` buffer, so it is set back before each replay, outside the events."""
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        position = torch.from_numpy(write_index).to(entry.inputs["write_index"].device)
        for start, end in pairs:
            entry.inputs["write_index"].copy_(position)
            start.record()
            entry.graph.replay()
            end.record()
        pairs[-1][1].synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in pairs) / 1000

    def _load_inputs(
        self,
        entry: _Graph,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> None:
        """Copy host inputs into the graph's static buffers, skipping what the buffers already hold."""
        buffers = entry.inputs
        held = entry.expected
        if held is None or not (np.array_equal(held[0], input_ids) and np.array_equal(held[1], write_index)):
            buffers["input_ids"].copy_(torch.from_numpy(input_ids), non_blocking=True)
            buffers["write_index"].copy_(torch.from_numpy(write_index), non_blocking=True)
            buffers["num_new"].copy_(torch.from_numpy(num_new), non_blocking=True)
        if uniforms is not None:
            buffers["uniform"].copy_(torch.from_numpy(uniforms), non_blocking=True)
            batch = len(uniforms)
            values = {
                "temperature": per_row(sampling.temperature, batch, np.float32),
                "top_k": per_row(sampling.top_k, batch, np.int64),
                "top_p": per_row(sampling.top_p, batch, np.float32),
            }
            params = tuple(tuple(v.tolist()) for v in values.values())
            if entry.params != params:
                for name, value in values.items():
                    buffers[name].copy_(torch.from_numpy(value))
                entry.params = params

    def _capture(
        self,
        key: tuple[int, str, bool],
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> _Graph:
        """Warm up (compile) on a side stream and capture the step of this shape, leaving the cache
        as it was: warm-up runs the step for real. `key`: (tokens a row, `step_choice`, `starts_fresh`)."""
        (seq_len, choice, fresh), batch, dev = key, self.batch_size, self.device
        inputs = {
            "input_ids": torch.zeros(batch, seq_len, dtype=torch.int64, device=dev),
            "write_index": torch.zeros(batch, dtype=torch.int64, device=dev),
            "num_new": torch.ones(batch, dtype=torch.int64, device=dev),
            "temperature": torch.ones(batch, dtype=torch.float32, device=dev),
            "top_k": torch.zeros(batch, dtype=torch.int64, device=dev),
            "top_p": torch.ones(batch, dtype=torch.float32, device=dev),
            "uniform": _uniform_input(choice, batch, seq_len, dev),
        }
        fn, k = self.step_function(*key), choice_candidates(choice)
        if k:  # a beam step's candidates: log-probabilities and ids, [B, k] each
            output: Any = (torch.zeros(batch, k, device=dev), torch.zeros(batch, k, dtype=torch.int64, device=dev))
        else:  # a token a row, or after every position of a verify step
            output = torch.zeros((batch, seq_len) if verifies(choice) else batch, dtype=torch.int64, device=dev)
        entry = _Graph(torch.cuda.CUDAGraph(), {n: v for n, v in inputs.items() if v is not None}, output)
        feeds_itself = seq_len == 1 and not k  # beams take their tokens from the host

        def run() -> None:
            result = fn(self.model, self.cache, *inputs.values(), k, fresh)
            for buffer, value in zip(output, result) if isinstance(output, tuple) else [(output, result)]:
                buffer.copy_(value)
            if feeds_itself:  # feed the next decode step from the device
                inputs["input_ids"].copy_(result[:, None])
                inputs["write_index"].add_(1)

        def load() -> None:
            entry.expected, entry.params = None, None
            self._load_inputs(entry, input_ids, write_index, num_new, sampling, uniforms)

        self._warm_and_capture(entry, run, load)
        return entry

    def _warm_and_capture(self, entry: _Graph, run: Any, load: Any = None) -> None:
        """Run `run` twice on a side stream (compiling what it calls), capture it into `entry.graph`,
        and put back the cache state the warm-up runs changed; `load` refills the inputs first."""
        dev = self.device
        saved = [b.clone() for b in self.cache.state_buffers()]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                if load is not None:
                    load()
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.no_grad(), torch.cuda.graph(entry.graph, pool=self.pool):
            run()
        for buffer, value in zip(self.cache.state_buffers(), saved):
            buffer.copy_(value)
        if load is not None:
            load()


class ReduceOverheadBackend(CompiledBackend):
    """`torch.compile(mode="reduce-overhead")`: inductor captures and replays CUDA graphs itself."""

    name = "reduce-overhead"
    compile_options = {"mode": "reduce-overhead"}

    def past_guards(self, graph: StepFn) -> StepFn:
        """Always through dynamo: inductor's CUDA-graph trees run inside dynamo's call wrapper."""
        return graph
