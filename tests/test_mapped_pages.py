"""backends/mapped_pages.py: the pages of private file mappings that hold only their files' bytes
(a graph's data, a library's code) are given back to the kernel and read again as they were; a
mapping the process wrote keeps them."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from staticrt.backends.mapped_pages import page_entries, release_read_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pages are released and counted through Linux's /proc")


def _present(pages: np.ndarray) -> int:
    """How many pages of `pages`' memory are present in this process (/proc/self/pagemap bit 63)."""
    (entries,) = page_entries([(pages.ctypes.data, pages.ctypes.data + pages.nbytes)])
    return int(np.count_nonzero(entries >> np.uint64(63)))


def test_pages_only_read_are_given_back_and_read_again_and_a_written_mapping_keeps_them(tmp_path):
    data = tmp_path / "model.onnx.data"
    data.write_bytes(np.arange(64 * mmap.PAGESIZE, dtype=np.uint32).astype(np.uint8).tobytes())  # 64 pages
    private = {"flags": mmap.MAP_PRIVATE, "prot": mmap.PROT_READ | mmap.PROT_WRITE}  # as ONNX Runtime maps them
    with open(data, "rb") as file:
        read, written = (np.frombuffer(mmap.mmap(file.fileno(), 0, **private), np.uint8) for _ in range(2))
    expected = int(read.astype(np.int64).sum())
    assert int(written.astype(np.int64).sum()) == expected  # every page of both present
    written[mmap.PAGESIZE] = 7  # one page of this mapping is the process's own copy now
    assert _present(read) == _present(written) == 64
    released = release_read_pages()
    assert released[str(data.resolve())] == 64 * mmap.PAGESIZE  # the one only read
    assert _present(read) == 0 and _present(written) == 64
    assert int(read.astype(np.int64).sum()) == expected  # read again from the file, as it was
    assert written[mmap.PAGESIZE] == 7 and data.read_bytes()[mmap.PAGESIZE] != 7
    # numpy's own code was among the pages given back, and runs again from the page cache
    assert any(Path(file).name.startswith("_multiarray_umath") for file in released)
    assert int(np.arange(1000).sum()) == 499500


def test_a_mapping_of_anything_but_a_regular_file_on_disk_keeps_its_pages(tmp_path):
    """A device's pages may not fault back once dropped, so only regular files' mappings are given
    back; no device a test can map privately fails that way, so a file deleted while mapped (no
    longer a path on disk) stands in for one."""
    gone = tmp_path / "gone.data"
    gone.write_bytes(bytes(range(256)) * (16 * mmap.PAGESIZE // 256))  # 16 pages
    with open(gone, "rb") as file:
        pages = np.frombuffer(mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ), np.uint8)
    total = int(pages.astype(np.int64).sum())
    gone.unlink()
    released = release_read_pages()
    assert not any(file.startswith(str(gone)) for file in released) and _present(pages) == 16
    assert int(pages.astype(np.int64).sum()) == total
