"""`import staticrt` asks torch's CPU allocator for transparent huge pages (staticrt/__init__.py),
which decodes 1.2-1.3x faster on the bench presets (docs/measurements.md), and leaves a user's own
choice alone. Each case is a fresh process: c10 reads the variable once, at its first allocation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = (
    "import os, staticrt, torch\n"
    "t = torch.ones(16 << 20)  # 64 MB: c10 madvises allocations of 2 MB and up\n"
    "huge = [l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]\n"
    "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), int(huge[0]) // 1024)\n"
)
MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def probe(setting: str | None) -> tuple[str, int]:
    """THP_MEM_ALLOC_ENABLE as the process saw it after `import staticrt`, and its huge-page MB."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    value, megabytes = run.stdout.split()
    return value, int(megabytes)


@pytest.mark.skipif(not MODE.exists(), reason="transparent huge pages are a Linux kernel's")
def test_a_staticrt_process_gives_its_large_tensors_huge_pages_unless_the_user_said_no():
    mode = MODE.read_text().split("[")[1].split("]")[0]  # "always [madvise] never" -> madvise
    value, megabytes = probe(None)
    assert value == "1"
    if mode in ("madvise", "always"):
        assert megabytes >= 32, f"a 64 MB tensor got {megabytes} MB of huge pages (THP mode {mode})"
    value, megabytes = probe("0")
    assert value == "0"
    if mode == "madvise":  # "always" gives huge pages whatever torch asks
        assert megabytes == 0
