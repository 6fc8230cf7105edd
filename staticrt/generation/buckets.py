"""Prefill buckets: the fixed widths a prompt is padded to, so each width is one graph. Imports no torch."""

from __future__ import annotations


def default_buckets(max_cache_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to, and always including, `max_cache_len`."""
    sizes, size = [], smallest
    while size < max_cache_len:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_cache_len,)


def bucket_for(buckets: tuple[int, ...], length: int, exact: bool = False) -> int | None:
    """The smallest bucket that holds `length` tokens; past the largest, the largest (a chunk of
    a longer prompt), or None with `exact`."""
    found = next((b for b in buckets if b >= length), None)
    return found if exact or found is not None else buckets[-1]


def chunk_end(buckets: tuple[int, ...], length: int) -> int:
    """The last position a prompt of `length` tokens writes, padding included, chunk by chunk."""
    largest, start = buckets[-1], 0
    while length - start > largest:
        start += largest
    return start + bucket_for(buckets, length - start)
