"""CUDA graphs as the cudagraph backend keeps them: a captured step with its static buffers, its
capture after a warm-up that leaves the cache as it was, and the GPU time of its replays.

`HostGraph` and `HostEvent` stand in for a CUDA graph and event on a device without them, so that
the backend's host side (which graph a step replays, what its buffers hold, the step run ahead,
the cache kept around warm-ups) runs on a CPU exactly as on a GPU: a replay calls what capture
kept, which reads the graph's static buffers and the Python values bound at capture, as a CUDA
graph's kernels do. A conversation continued on a GPU gave wrong tokens that no CPU test saw,
because the CPU ran the compiled path instead; this is how a CPU test sees such a defect.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..caches import KVCache
from ..generation.logprobs import TOP_LOGPROBS
from ..generation.params import SamplingParams, per_row
from .step import VERIFY_SAMPLE, base_choice, choice_candidates, gives_logprobs, verifies


@dataclass
class CapturedGraph:
    graph: Any  # torch.cuda.CUDAGraph, or off CUDA its stand-in `HostGraph`
    inputs: dict[str, torch.Tensor]  # static buffers the graph reads, by step argument name
    output: Any  # on the device: [B] int64 chosen ids, a beam step's ([B, k] float32, [B, k] int64), or
    # the ids and their log-probabilities ([B], [B] float32, [B, K] float32, [B, K] int64)
    expected: tuple[np.ndarray, np.ndarray] | None = None  # decode: (ids, write_index) its buffers hold next
    params: tuple[tuple[Any, ...], ...] | None = None  # sampling parameters its buffers hold, a row each
    biased: bool = False  # whether its `bias` buffer holds a step's logit bias (else zeros)


class HostGraph:
    """A CUDA graph's stand-in off CUDA: `capture` keeps the step, `replay` runs it again."""

    def __init__(self) -> None:
        self.captured: Callable[[], None] | None = None

    def replay(self) -> None:
        assert self.captured is not None, "replay of a graph never captured"
        with torch.no_grad():
            self.captured()


class HostEvent:
    """A CUDA event's stand-in off CUDA, where every step has finished when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def new_graph(dev: torch.device) -> torch.cuda.CUDAGraph | HostGraph:
    """An empty graph to capture into on `dev`: CUDA's own, or its stand-in."""
    return torch.cuda.CUDAGraph() if dev.type == "cuda" else HostGraph()


def same_inputs(held: tuple[np.ndarray, np.ndarray], input_ids: np.ndarray, write_index: np.ndarray) -> bool:
    """Whether a step's `input_ids [B, T]` and `write_index [B]` are the `held` pair."""
    return np.array_equal(held[0], input_ids) and np.array_equal(held[1], write_index)


def load_inputs(
    entry: CapturedGraph,
    input_ids: np.ndarray,
    write_index: np.ndarray,
    num_new: np.ndarray,
    sampling: SamplingParams,
    uniforms: np.ndarray | None,
) -> None:
    """Copy host inputs into the graph's static buffers, skipping what the buffers already hold.
    The step's logit bias `[B, V]` is copied every step it has one (it follows the tokens); a step
    without one finds zeros."""
    buffers = entry.inputs
    if sampling.bias is not None:
        buffers["bias"].copy_(torch.from_numpy(sampling.bias), non_blocking=True)
    elif entry.biased:
        buffers["bias"].zero_()
    entry.biased = sampling.bias is not None
    if entry.expected is None or not same_inputs(entry.expected, input_ids, write_index):
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


def uniform_input(choice: str, batch: int, seq_len: int, dev: torch.device) -> torch.Tensor | None:
    """A captured step's uniform input: `[B]` for a sampling step, `[B, T, 2]` for a verify step
    that samples (`sampling.verify_sample`), none for greedy."""
    if choice == VERIFY_SAMPLE:
        return torch.zeros(batch, seq_len, 2, dtype=torch.float32, device=dev)
    return torch.zeros(batch, dtype=torch.float32, device=dev) if base_choice(choice) == "sample" else None


def output_buffers(choice: str, batch: int, seq_len: int, vocab: int, dev: torch.device) -> Any:
    """Where a captured step of `choice` leaves what it returns (`CapturedGraph.output`)."""
    k, ids = choice_candidates(choice), torch.zeros(batch, dtype=torch.int64, device=dev)
    if k:  # a beam step's candidates: log-probabilities and ids
        return torch.zeros(batch, k, device=dev), torch.zeros(batch, k, dtype=torch.int64, device=dev)
    if verifies(choice):  # the token after every position
        return torch.zeros(batch, seq_len, dtype=torch.int64, device=dev)
    if gives_logprobs(choice):
        top = min(TOP_LOGPROBS, vocab)
        logprobs = torch.zeros(batch, device=dev), torch.zeros(batch, top, device=dev)
        return ids, *logprobs, torch.zeros(batch, top, dtype=torch.int64, device=dev)
    return ids


def warm_and_capture(
    entry: CapturedGraph,
    run: Callable[[], None],
    cache: KVCache,
    pool: Any,
    dev: torch.device,
    load: Callable[[], None] | None = None,
) -> None:
    """Run `run` twice on a side stream of `dev` (compiling what it calls), capture it into
    `entry.graph` in memory pool `pool`, and put back the `cache` state the warm-up runs changed;
    `load` refills the inputs first. Off CUDA the warm-up runs as it is and `entry.graph` (a
    `HostGraph`) keeps `run`."""
    on_cuda = dev.type == "cuda"
    with cache.kept():
        side = torch.cuda.Stream(dev) if on_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side) if side is not None else nullcontext():
            for _ in range(2):
                if load is not None:
                    load()
                run()
        if side is None:
            entry.graph.captured = run
        else:
            torch.cuda.current_stream(dev).wait_stream(side)
            with torch.no_grad(), torch.cuda.graph(entry.graph, pool=pool):
                run()
    if load is not None:
        load()


def replay_gpu_s(entry: CapturedGraph, write_index: np.ndarray, repeats: int = 50) -> float:
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
