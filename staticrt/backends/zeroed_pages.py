"""Host buffers in one anonymous memory mapping: zero until written, and zeroed again by handing
their pages back to the kernel, so memory a cache never writes is never resident.

An ONNX artifact's K/V cache is sized for its whole context (SmolLM2's at 512 positions: 24 MB in
float32), but a conversation writes only the positions it reaches, and reading a page never
written maps the kernel's shared zero page. Filling the buffers with zeros made every page
resident at the first `reset`; here `zero()` is `madvise(MADV_DONTNEED)` on Linux, which gives a
private anonymous mapping fresh zero pages (elsewhere the arrays are filled; a shared mapping would
keep its contents and give them back at the next read). Imports no torch.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

PAGE = mmap.PAGESIZE


class ZeroedPages:
    """Arrays of the given shapes and dtypes, each starting on a page of one private anonymous mapping."""

    def __init__(self, specs: list[tuple[list[int], str]]) -> None:
        starts, end = [], 0
        for shape, dtype in specs:
            starts.append(end)
            end += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // PAGE) * PAGE
        # private: Python's default for -1 is a shared mapping, whose pages MADV_DONTNEED only unmaps
        private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
        self.memory = mmap.mmap(-1, max(end, PAGE), **private)
        self.arrays = [
            np.frombuffer(self.memory, np.dtype(dtype), int(np.prod(shape)), start).reshape(shape)
            for (shape, dtype), start in zip(specs, starts, strict=True)
        ]

    def zero(self) -> None:
        """Every array back to zeros, its pages no longer resident where the kernel allows."""
        if sys.platform == "linux":
            self.memory.madvise(mmap.MADV_DONTNEED)
        else:
            for array in self.arrays:
                array.fill(0)
