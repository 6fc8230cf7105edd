"""The machine a benchmark ran on, written into every report: a number without its CPU, ISA and
date cannot be compared with another (these machines are shared, and the CPU model changes
between them: AVX-512 on some, AVX2 only on others)."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch

from ..host import cpuinfo

# The vector and matrix extensions that decide which kernels a CPU step can use.
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


def machine() -> dict[str, Any]:
    """Where and when: CPU model and ISA flags (from /proc/cpuinfo where there is one), torch's
    view of the CPU, threads, GPU and the UTC time the report was written."""
    model, flags = cpuinfo()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_model": model or platform.processor(),
        "cpu_flags": [flag for flag in ISA_FLAGS if flag in flags],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def describe(info: dict[str, Any]) -> str:
    """One line for a table's title: 'AMD EPYC (avx2 fma ... avx512_bf16), 2 threads'."""
    flags = " ".join(info.get("cpu_flags", [])) or "no vector flags read"
    return f"{info.get('cpu_model') or 'unknown CPU'} ({flags}), {info['torch_threads']} threads"
