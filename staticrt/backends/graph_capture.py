"""CUDA graphs as the cudagraph backend keeps them: a captured step with its static buffers, its
capture after a warm-up that leaves the cache as it was, and the GPU time of its replays."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..caches import KVCache
from .eager import VERIFY_SAMPLE


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static buffers the graph reads, by step argument name
    output: Any  # on the device: [B] int64 chosen ids, or a beam step's ([B, k] float32, [B, k] int64)
    expected: tuple[np.ndarray, np.ndarray] | None = None  # decode: (ids, write_index) its buffers hold next
    params: tuple[tuple[Any, ...], ...] | None = None  # sampling parameters its buffers hold, a row each


def same_inputs(held: tuple[np.ndarray, np.ndarray], input_ids: np.ndarray, write_index: np.ndarray) -> bool:
    """Whether a step's `input_ids [B, T]` and `write_index [B]` are the `held` pair."""
    return np.array_equal(held[0], input_ids) and np.array_equal(held[1], write_index)


def uniform_input(choice: str, batch: int, seq_len: int, dev: torch.device) -> torch.Tensor | None:
    """A captured step's uniform input: `[B]` for a sampling step, `[B, T, 2]` for a verify step
    that samples (`sampling.verify_sample`), none for greedy."""
    if choice == VERIFY_SAMPLE:
        return torch.zeros(batch, seq_len, 2, dtype=torch.float32, device=dev)
    return torch.zeros(batch, dtype=torch.float32, device=dev) if choice == "sample" else None


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
    `load` refills the inputs first."""
    with cache.kept():
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                if load is not None:
                    load()
                run()
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
