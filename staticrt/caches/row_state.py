"""A cache row's state copied to host memory and put back into any row: a server's prefix pool
(serve/rows.py) keeps the row a new request is about to overwrite and restores it when its
conversation returns, as llama.cpp's `--cache-ram` does with its slots.

Of a linear layer's storage (`[B, H_kv, L, ...]` with L the positions a row can reach: slot j holds
position j) only the first `length` positions are kept, since those are all the row holds; what
the target row has past them is hidden by position until overwritten, as in any freed row. Every
other buffer (a rotating layer's slots, a recurrent layer's state, per-row lengths) is kept whole;
which is which goes by the buffer's name, never by a size that may happen to equal L. Worked: SmolLM2, 556
positions, a row holding 300 tokens keeps 300 x 30 layers x 2 x 3 heads x 64 x 4 bytes = 13.8 MB
of its 25.6 MB. Writes are in place: compiled and captured graphs keep their addresses.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .recurrent import STATE_PARTS


@dataclass(eq=False)  # tensors have no truth value: a state is equal to itself only
class RowState:
    """Host copies of one row of each buffer, in the order the buffers were given."""

    parts: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


# A saved row of 1 MB and up is one anonymous mapping of its own, its parts views of it: evicted, it
# goes back to the system whole. Copied by torch's allocator instead, a server's parts of 15-170 KB
# (SmolLM2) landed in glibc's heap between the steps' temporaries and left holes there when evicted:
# RSS less the pool 1.71x over an hour's soak with the pool full (docs/measurements.md). Smaller rows
# stay on the heap, where they cannot fragment much: a mapping each would meet the kernel's limit on
# mappings (vm.max_map_count, 65,530 by default) before a pool of a few GB filled.
MAPPED_ROW_BYTES = 1 << 20
ALIGN = 64


def save_row(buffers: Mapping[str, torch.Tensor], row: int, length: int, limit: int | None) -> RowState:
    """Row `row` of every batch-first buffer (by its name in the cache, `{part}_{layer}`), a linear
    layer's (dim 2 == `limit`, the positions a row reaches; None: no layer is linear) cut to its
    first `length` positions, copied to the host. A recurrent layer's buffers are kept whole, whatever
    their sizes: a Mamba2 state `[B, H, D, N]` whose D equals `limit` holds no positions."""
    sources = []
    for name, buf in buffers.items():
        state = name.rpartition("_")[0] in STATE_PARTS
        linear = limit is not None and buf.dim() >= 3 and buf.shape[2] == limit and not state
        sources.append(buf[row, :, :length] if linear else buf[row])
    nbytes = [part.numel() * part.element_size() for part in sources]
    starts = [0]  # each part's offset in the mapping, ALIGN-aligned; the last: its length
    for n in nbytes:
        starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
    if starts[-1] < MAPPED_ROW_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows has no such flags)
        return RowState([part.to("cpu", copy=True) for part in sources])
    # frombuffer keeps the mapping alive while any part is; munmap when the last part goes
    mapping = mmap.mmap(-1, starts[-1], flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem: mmap's default
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    views = (flat[start : start + n].view(p.dtype).view(p.shape) for p, start, n in zip(sources, starts, nbytes))
    return RowState([host.copy_(part) for host, part in zip(views, sources)])


def load_row(buffers: Mapping[str, torch.Tensor], row: int, state: RowState) -> None:
    """Row `row` of every buffer takes `state` (saved from the same layout), in place."""
    for buf, part in zip(buffers.values(), state.parts, strict=True):
        target = buf[row]
        if part.shape != target.shape:  # a linear layer's first positions
            target = target[:, : part.shape[1]]
        target.copy_(part)


class RowStash(ABC):
    """`stash_row`/`restore_row` for a step backend whose cache state is `row_buffers()` (batch-first
    tensors) and whose rows reach `max_sequence_len` positions."""

    max_sequence_len: int | None

    @abstractmethod
    def row_buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor of the backend's cache state, batch-first, by its name in the cache (`key_0`,
        `ssm_1`, ...), in a fixed order."""

    def stash_row(self, row: int, length: int) -> RowState:
        """A host copy of what row `row` holds in its first `length` positions (its rotating slots whole)."""
        return save_row(self.row_buffers(), row, length, self.max_sequence_len)

    def restore_row(self, row: int, state: RowState) -> None:
        load_row(self.row_buffers(), row, state)


class CacheRows:
    """What a cache (base.py's KVCache, an `nn.Module`) does to its state as a whole and row by
    row: keep it across a block, zero it, copy a row from another cache, reorder rows for beams."""

    def state_buffers(self) -> list[torch.Tensor]:
        """Every buffer the cache holds: K/V storage (and working buffers, where there are any) and the lengths."""
        return list(self.buffers())

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Run the block, then put every state buffer back as it was, in place (addresses stay valid
        for captured graphs): for steps run only for what they build, a warm-up, a capture, a timing."""
        held = [buf.clone() for buf in self.state_buffers()]
        yield
        with torch.no_grad():
            for buf, value in zip(self.state_buffers(), held, strict=True):
                buf.copy_(value)

    def reset(self) -> None:
        """Zero the state in place; addresses stay valid for captured graphs."""
        for buf in self.state_buffers():
            buf.zero_()

    def copy_row(self, source: CacheRows, source_row: int, row: int) -> None:
        """Row `row` of every buffer takes `source`'s row `source_row` (a cache of the same layout,
        any batch size; every buffer is batch-first), in place: captured graphs stay valid."""
        theirs = dict(source.named_buffers())
        for name, buf in self.named_buffers():
            buf[row].copy_(theirs[name][source_row])

    def leading_rows(self, rows: int) -> CacheRows | None:
        """A cache of `rows` rows that are this one's first `rows` (every buffer batch-first, viewed:
        the same storage, so a narrower step reads and writes them in place, at addresses that stay
        static); None where a cache keeps state beside its buffers (offloaded.py's write targets)."""
        view = copy.copy(self)
        view._buffers = {name: buf[:rows] for name, buf in self._buffers.items()}  # [rows, ...] views
        for buf in view._buffers.values():
            torch._dynamo.mark_static_address(buf)
        view.spec = dataclasses.replace(self.spec, max_batch_size=rows)
        return view

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Permute rows in place (beam search): row b takes the contents of row `beam_idx[b]`."""
        for buf in self.state_buffers():
            buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))
