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

Greedy decode runs one step ahead (`run_ahead`): a step launches the next replay before it waits
for its own ids, so the GPU never idles while the host reads ids, checks stops and calls back. The
step ahead is fed the ids the loop feeds next anyway; where the loop asks for something else (a
stop, a verify or prefill step) its one column a row lies past what the row holds, which a linear
cache never reads: hence greedy decode on caches without rotating layers only. A step with a logit
bias (logit_bias, penalties, a grammar's mask: a static `[B, V]` input of every graph, zeros
otherwise) does not run ahead: its next bias follows the token it chooses.

A graph is captured the first time its shape is asked for, mid-generation: the compiled step is
warmed up on a side stream (which compiles it) and captured, and because warm-up runs the step
for real, the cache and the static inputs are saved before and restored after. After capture a
generation allocates no device memory.

Without CUDA, `backend="cudagraph"` warns once and runs the compiled path, so a script written
for a GPU still runs on a CPU. `HostReplayBackend` runs this backend's host side on any device
instead, each graph replayed by calling what it captured (graph_capture.py): the tests check the
capture contract with it on a CPU. Backend "reduce-overhead" (reduce_overhead.py) is inductor's
own CUDA graphs, for comparison.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from ..generation.params import SamplingParams
from .compiled import CompiledBackend
from .eager import EagerBackend
from .graph_capture import (
    CapturedGraph,
    HostEvent,
    load_inputs,
    new_graph,
    output_buffers,
    replay_gpu_s,
    same_inputs,
    uniform_input,
    warm_and_capture,
)
from .step import StepFn, choice_candidates, put_logprobs, starts_fresh, step_choice

_WARNED = False


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


class CudaGraphBackend(CompiledBackend):
    name = "cudagraph"
    compile_options: dict[str, Any] = {"options": {}}  # inductor's defaults on CUDA (cpp_wrapper is the CPU's)
    # One row's decode step: inductor turns each matrix-vector product into a reduction it tunes
    # (torch's mm decomposition, taken with coordinate descent tuning; gpt-fast's setting).
    matvec_options: dict[str, Any] = {"options": {"coordinate_descent_tuning": True}}
    run_ahead = True  # launch greedy decode's next replay before reading this step's ids (module docstring)
    host_replay = False  # capture and replay off CUDA too (`HostReplayBackend`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # by (tokens a row, `step_choice`, `starts_fresh`)
        self.captured: dict[tuple[int, str, bool], CapturedGraph] = {}
        self.reorder_graph: CapturedGraph | None = None
        self.decode_from: np.ndarray | None = None  # write_index of the last generation's first decode step
        on_cuda = self.device.type == "cuda"
        self.captures = on_cuda or self.host_replay  # whether steps replay captured graphs
        if not self.captures:
            _warn_no_cuda(self.device)
            self.compile_options = CompiledBackend.compile_options
            return
        self.pool = torch.cuda.graph_pool_handle() if on_cuda else None  # one pool for every graph
        self.host_ids = torch.empty(self.batch_size, dtype=torch.int64, pin_memory=on_cuda)
        self.copied = torch.cuda.Event() if on_cuda else HostEvent()  # the step's ids are in `host_ids`
        self.ahead: tuple[np.ndarray, np.ndarray] | None = None  # (ids [B, 1], write_index [B]) of a replay in flight
        self.decodes = 0  # greedy decode steps in a row: the loop runs ahead from the second on
        self.linear_cache = not self.rotating_layouts  # a step ahead's column is never read (module docstring)

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        if not self.captures:
            return super().step(input_ids, write_index, num_new, sampling, uniforms)
        self.live = True  # rows now hold tokens a later step may continue: `prepare` keeps them
        batch, seq_len = input_ids.shape
        if seq_len == 1 and self.decode_from is None:
            self.decode_from = write_index.copy()
        sink = sampling.logprobs_to
        choice = step_choice(uniforms is not None, logprobs=sink is not None)
        decode, ahead = self.captured.get((1, "greedy", False)), self.ahead
        streak = self.decodes + 1 if seq_len == 1 and choice == "greedy" else 0
        if ahead is not None and choice == "greedy" and same_inputs(ahead, input_ids, write_index):
            output, self.ahead = decode.output, None  # this step is the replay in flight
        else:
            output = self.run(choice, input_ids, write_index, num_new, sampling, uniforms)
        # The step's one wait: for its ids, copied out before the next replay overwrites them.
        self.host_ids.copy_(output if sink is None else output[0], non_blocking=True)
        self.copied.record()
        self.decodes = streak
        launched = streak > 1 and sampling.bias is None and self._may_run_ahead(write_index)
        if launched:
            decode.graph.replay()  # fed from its own buffers: this step's ids, at write_index + 1
        self.copied.synchronize()
        next_ids = self.host_ids.numpy().copy()
        if sink is not None:  # a step with log-probabilities never runs ahead: its buffers hold them still
            put_logprobs(sink, output[1:])
        if seq_len == 1:  # the graph left these in its own input buffers, or fed them to the step ahead
            fed = (next_ids.reshape(batch, 1), write_index + 1)
            if launched:
                self.ahead, decode.expected = fed, None
            else:
                self.captured[1, choice, False].expected = fed
        return next_ids

    def _may_run_ahead(self, write_index: np.ndarray) -> bool:
        """Whether greedy decode may launch the step after the one at `write_index [B]`: its
        column lies inside the cache, and no layer rotates (whose slots it would overwrite)."""
        limit = self.max_sequence_len
        within = limit is None or int(write_index.max()) + 2 <= limit
        return self.run_ahead and within and self.linear_cache

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
        if not self.captures:
            return super().run(choice, input_ids, write_index, num_new, sampling, uniforms)
        self.ahead, self.decodes = None, 0  # a replay in flight is not this one (its buffers: `expected` None)
        seq_len = input_ids.shape[1]
        self.cache.check_step(write_index, seq_len)
        key = (seq_len, choice, starts_fresh(write_index, seq_len))
        if key not in self.captured:
            self.captured[key] = self._capture(key, input_ids, write_index, num_new, sampling, uniforms)
        entry = self.captured[key]
        load_inputs(entry, input_ids, write_index, num_new, sampling, uniforms)
        entry.graph.replay()
        return entry.output

    def graph_options(self, seq_len: int, layers_once: bool) -> dict[str, Any]:
        """One row's decode step on CUDA as tuned matrix-vector reductions (`matvec_options`)."""
        if self.device.type == "cuda" and self.batch_size * seq_len == 1:
            return self.matvec_options
        return super().graph_options(seq_len, layers_once)

    def graph_choice(self, choice: str) -> str:
        """Captured graphs keep one graph a choice (a replay cannot branch on its data)."""
        return choice if self.captures else super().graph_choice(choice)

    def reorder_rows(self, rows: np.ndarray) -> None:
        """Beam search's in-place reorder of the cache rows, as a captured graph on CUDA. Warm-up
        and capture run it with `rows` the identity, which leaves the cache as it is."""
        if not self.captures:
            return super().reorder_rows(rows)
        if self.reorder_graph is None:
            buffer = torch.arange(self.batch_size, device=self.device)
            entry = CapturedGraph(new_graph(self.device), {"rows": buffer}, None)
            reorder = lambda: self.cache.reorder_cache(buffer)  # noqa: E731
            warm_and_capture(entry, reorder, self.cache, self.pool, self.device)
            self.reorder_graph = entry
        self.reorder_graph.inputs["rows"].copy_(torch.from_numpy(rows), non_blocking=True)
        self.reorder_graph.graph.replay()

    def reset(self) -> None:
        super().reset()
        self.decode_from, self.ahead, self.decodes = None, None, 0

    def report(self) -> dict[str, Any]:
        """Also, on CUDA, the GPU time of one replay of the greedy decode graph (`graph_gpu_ms`).
        The timed replays write a column of every row; the cache is put back as it was, since a
        later generation may continue those rows (`reuse_prefix`)."""
        report = super().report()
        decode = self.captured.get((1, "greedy", False))
        if decode is not None and self.decode_from is not None and self.device.type == "cuda":
            with self.cache.kept():
                report["graph_gpu_ms"] = 1000 * replay_gpu_s(decode, self.decode_from)
            decode.expected, self.ahead = None, None  # the replays left other inputs in its buffers
        return report

    def _capture(
        self,
        key: tuple[int, str, bool],
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> CapturedGraph:
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
            "uniform": uniform_input(choice, batch, seq_len, dev),
        }
        bias = torch.zeros(batch, self.vocab_size, dtype=torch.float32, device=dev)  # a step's logit bias, or zeros
        fn, k = self.step_function(*key), choice_candidates(choice)
        output = output_buffers(choice, batch, seq_len, self.vocab_size, dev)
        buffers = {n: v for n, v in {**inputs, "bias": bias}.items() if v is not None}
        entry = CapturedGraph(new_graph(dev), buffers, output)
        feeds_itself = seq_len == 1 and not k  # beams take their tokens from the host

        def run() -> None:
            result = fn(self.model, self.cache, *inputs.values(), k, fresh, bias)
            for buffer, value in zip(output, result) if isinstance(output, tuple) else [(output, result)]:
                buffer.copy_(value)
            if feeds_itself:  # feed the next decode step from the device
                inputs["input_ids"].copy_((result[0] if isinstance(output, tuple) else result)[:, None])
                inputs["write_index"].add_(1)

        def load() -> None:
            entry.expected, entry.params = None, None
            load_inputs(entry, input_ids, write_index, num_new, sampling, uniforms)

        warm_and_capture(entry, run, self.cache, self.pool, dev, load)
        return entry


class HostReplayBackend(CudaGraphBackend):
    """The cudagraph backend's host side on any device, each graph a `HostGraph` that replays by
    calling what it captured: which graph a step replays, what its static buffers hold, the step
    run ahead and the cache kept around warm-ups run as on a GPU, so a CPU test sees their
    defects. Its steps run eagerly: the contract is what a replay reads, not how the step computes,
    and a test of it then compiles nothing."""

    name = "cudagraph-host"
    host_replay = True

    def step_function(self, seq_len: int, choice: str, fresh: bool) -> StepFn:
        return EagerBackend.step_function(self, seq_len, choice, fresh)
