"""staticrt's float32 matrix-vector kernels (f32_source.py), for the CPU graphs of a float32 model.

A decode step multiplies one row (or a few) by every matrix of the model: it reads each weight
once, so it runs at the rate two cores stream memory, and the kernel that streams fastest wins.
On bench-qwen3's matrices (2,380 MB, one row, 2 threads, AVX2-only AMD EPYC) oneDNN's packed linear
read 22.4 GB/s and llama.cpp's F32 dot products 24.2 GB/s; four weight rows against one activation
row, two FMA chains a row, 25.0-25.8 GB/s (docs/measurements.md). `f32_linear` reads the model's
own row-major weights, so no packed copy is held; more rows than a decode step's (a prefill) go to
torch's GEMM on the same tensor. `f32_experts` multiplies each row by its own expert's weights in
place, where a gather would first copy the k chosen experts (a mixture of experts' decode step).

They are built with the int8-activation kernels into one library (a8_kernels.py); a machine that
cannot build it keeps oneDNN's packed linear and the gathered experts.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from . import a8_kernels

log = logging.getLogger("staticrt")
_usable: list[bool] = []  # whether the library loaded, once a process


def usable(dtype: torch.dtype) -> bool:
    """Whether float `dtype` weights run on the float kernels here (float32 on a CPU whose kernels
    build: AVX2 with FMA and F16C, or AVX-512); loads the library on first use, and says once why
    not where it cannot be built."""
    if dtype != torch.float32 or a8_kernels.unavailable() is not None:
        return False
    if not _usable:
        try:
            a8_kernels.load(None)
            _usable.append(True)
        except ConfigError as err:
            log.warning("%s", err)
            _usable.append(False)
    return _usable[0]
