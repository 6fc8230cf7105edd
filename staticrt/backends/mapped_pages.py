"""Pages of files this process mapped and only read, handed back to the kernel once an ONNX session
is made: the files stay mapped, and a later read faults their pages back in from the page cache.

Two kinds of file pages outlive making a session without being needed by its steps. ONNX Runtime
maps each external tensor of a graph's data file (private, read and write) and keeps the mappings of
the tensors its kernels did not pack; making a session reads more of them than a step does (on
SmolLM2's int4 artifact, its packed copy: 43 MiB, the token table the lookup reads a row of and the
MatMulNBits scales its packed blobs hold too; 21 tokens read 3.6 MiB of them back). And importing
onnxruntime and making the session run code once (kernel registration, graph loading and
optimization, the files' hashes): of the 42 MiB of libraries' pages resident then, 16 tokens touch
27 again. `madvise(MADV_DONTNEED)` on a private file mapping drops its pages for this process only (the
page cache keeps them); a page the process wrote is its own (anonymous) copy, which dropping would
lose, so a mapping with any such page is left alone (/proc/self/pagemap: a present page of a file
mapping that is not the file's, or a swapped one), and so is a mapping of anything but a regular
file (a device's pages may not fault back). It is the whole process's: with torch imported, 404 MiB
of mappings in 10-19 ms, and the code later steps run faults back in (a small torch computation
after it: 300-700 minor faults). Linux only; elsewhere nothing is done. Imports no torch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import sys
from typing import Any

PRESENT, SWAPPED, FILE_PAGE = 1 << 63, 1 << 62, 1 << 61  # /proc/self/pagemap bits


def page_entries(spans: list[tuple[int, int]]) -> list[Any]:
    """/proc/self/pagemap's entries (uint64, one a page) for each [start, end) of this process's memory."""
    import numpy as np

    found = []
    with open("/proc/self/pagemap", "rb") as pagemap:
        for start, end in spans:
            pagemap.seek(start // mmap.PAGESIZE * 8)
            found.append(np.frombuffer(pagemap.read(-(-(end - start) // mmap.PAGESIZE) * 8), dtype=np.uint64))
    return found


def release_read_pages() -> dict[str, int]:
    """Drop the resident pages of this process's private file mappings that hold only their files'
    bytes; return the bytes of mappings released, by file ({} where /proc cannot tell)."""
    if sys.platform != "linux":
        return {}
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    spans, files, released, kinds = [], [], {}, {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # e.g. "7f1c2a000000-7f1c2a400000 r-xp 00000000 08:01 1234  /usr/lib/libc.so.6"
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1].endswith("p") and _regular(fields[5].rstrip("\n"), kinds):
                    spans.append(tuple(int(bound, 16) for bound in fields[0].split("-")))
                    files.append(fields[5].rstrip("\n"))
        for (start, end), file, entries in zip(spans, files, page_entries(spans), strict=True):
            # a page this process wrote is anonymous: present and not the file's, or swapped out
            # (the file's own pages are never swapped, only dropped)
            written = (entries & np.uint64(PRESENT) != 0) & (entries & np.uint64(FILE_PAGE) == 0)
            if np.any(written | (entries & np.uint64(SWAPPED) != 0)):
                continue  # not the file's to give back
            if libc.madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
                released[file] = released.get(file, 0) + end - start
    except OSError:  # no /proc to read: the pages stay, as they would without this
        pass
    return released


def _regular(path: str, kinds: dict[str, bool]) -> bool:
    """Whether `path` (a mapping's, from /proc/self/maps) names a regular file, asked once a path."""
    if path not in kinds:
        try:
            kinds[path] = path.startswith("/") and stat.S_ISREG(os.stat(path).st_mode)
        except OSError:  # gone (" (deleted)"), or not a path at all
            kinds[path] = False
    return kinds[path]
