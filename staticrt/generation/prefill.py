"""A generation's multi-token steps: the first one (what each row keeps of its prompt, what it
prefills) and LongRoPE's restart.

LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) rotates with its short factors while a sequence is within
`original_max_position_embeddings` (P) and with its long ones past it; transformers, once a
sequence passes P, computes it again from position 0 with the long factors (Phi-3's
`prepare_inputs_for_generation` drops the cache), so every later token is the long world's. The
decode loop does the same (`restart_step`): the step that would feed position P feeds instead,
for each row that reaches it, all it holds plus that token from position 0, in one prefill-wide
step beside the other rows' decode tokens; the model picks the long factors for it from its last
position (rope.py). A kept prefix is reused only within its own world (`kept_prefixes`).
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import GenerationError
from .buckets import bucket_for
from .prefix import kept_prefix
from .request import check_bucket

StepBackend = object  # loop.py's StepBackend; loop.py imports this module


def kept_prefixes(backend: StepBackend, rows: list[list[int]], held: list[list[int]]) -> list[int]:
    """Prompt tokens each row keeps in its cache (prefix.py): none where the backend writes one
    column for every row (the ONNX graph's layout, past batch 1), or where the continuing step
    would not fit the cache (a torch backend writes the whole bucket, padding past the row's end)."""
    if not backend.row_positions and backend.batch_size > 1:
        return [0] * len(rows)
    kept = [kept_prefix(held[r], ids, backend.rotating_layouts) for r, ids in enumerate(rows)]
    restart = backend.rope_restart  # a row's cache holds the short or the long world: keep it only for the same
    if restart is not None:
        kept = [
            k if (len(held[r]) > restart) == (len(ids) > restart) else 0 for r, (ids, k) in enumerate(zip(rows, kept))
        ]
    width = bucket_for(backend.buckets, max(len(ids) - k for ids, k in zip(rows, kept, strict=True)))
    limit = backend.max_sequence_len
    written = [k + (width if backend.row_positions else len(ids) - k) for ids, k in zip(rows, kept, strict=True)]
    return [0] * len(rows) if limit is not None and max(written) > limit else kept


def prefill_inputs(
    backend: StepBackend, rows: list[list[int]], held: list[list[int]], reuse: bool
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The prompt tokens each row keeps (with `reuse`), and the first step's `input_ids [B, bucket]`,
    `write_index [B]` and `num_new [B]`: each row's prompt after what it keeps, right-padded; rows
    beyond the request prefill one dummy token at 0. Checked before the cache is touched."""
    kept = kept_prefixes(backend, rows, held) if reuse else [0] * len(rows)
    for r, (ids, k) in enumerate(zip(rows, kept, strict=True)):
        check_bucket(backend, r, len(ids) - k, k)
    batch, n_rows = backend.batch_size, len(rows)
    write_index = np.zeros(batch, dtype=np.int64)
    write_index[:n_rows] = kept
    lengths = np.ones(batch, dtype=np.int64)
    lengths[:n_rows] = [len(ids) - k for ids, k in zip(rows, kept, strict=True)]
    input_ids = np.zeros((batch, bucket_for(backend.buckets, int(lengths.max()))), dtype=np.int64)
    for r, ids in enumerate(rows):
        input_ids[r, : lengths[r]] = ids[kept[r] :]
    return kept, input_ids, write_index, lengths


def crossing(restart: int | None, prompt_lengths: list[int], max_new_tokens: int) -> bool:
    """Whether a row's decode steps will feed position `restart` (its prompt ends before it and
    its last fed token, at prompt length + max_new_tokens - 2, reaches it)."""
    return restart is not None and any(n <= restart <= n + max_new_tokens - 2 for n in prompt_lengths)


def restart_width(backend: StepBackend, prompt_lengths: list[int], max_new_tokens: int) -> int | None:
    """The width of the restart step a generation will need (a prefill bucket that holds
    `rope_restart + 1` tokens), None where no row crosses; refused before anything runs where no
    bucket is that wide."""
    restart = backend.rope_restart
    if not crossing(restart, prompt_lengths, max_new_tokens):
        return None
    width = bucket_for(backend.buckets, restart + 1, exact=True)
    switch = f"this model's LongRoPE switches to its long factors at position {restart}, where a sequence is"
    if width is None:
        raise GenerationError(
            f"{switch} computed again from position 0 in one step of {restart + 1} tokens, past the largest prefill "
            f"bucket {backend.buckets[-1]}: {backend.remedy('prefill_buckets')} of {restart + 1} or more, or "
            "keep prompt and new tokens within it"
        )
    # The restarting rows write `width` columns from 0; the others decode in that step, each writing
    # `width` columns from its position (padding past it), where the backend writes each row at its
    # own positions (restart_step says the other case). A row beyond the request sits at its step + 1.
    limit = backend.max_sequence_len if backend.row_positions else None
    lengths = [*prompt_lengths, *([1] * (backend.batch_size - len(prompt_lengths)))]
    steps = {restart - n for n in prompt_lengths if n <= restart <= n + max_new_tokens - 2}
    reach = max([n + step + width for step in steps for n in lengths if n + step != restart] + [width])
    if limit is not None and reach > limit:
        raise GenerationError(
            f"{switch} computed again from position 0 in a step {width} wide beside the other rows, which would "
            f"write up to position {reach - 1}, past the cache's {limit}: generate these prompts apart, or "
            f"{backend.remedy('max_cache_len')} of {reach} or more"
        )
    return width


def restart_step(
    backend: StepBackend, width: int, next_ids: np.ndarray, write_index: np.ndarray, held: list[list[int]], rows: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The inputs `[B, width]` ids and `num_new [B]` of a step that restarts each of the first
    `rows` rows about to feed position `rope_restart` from position 0 (all it holds, then its next
    token) and decodes the others' `next_ids [B]`; None where no row restarts. Sets a restarting
    row's `write_index` to 0 and `held` to []: the step holds them again. A backend that writes one
    column for every row (ONNX past batch 1) restarts every row, each on its own side of the switch
    (exact for all: a row's factors follow its own last position), its columns begun again."""
    restart, batch = backend.rope_restart, len(next_ids)
    starting = [r for r in range(rows) if write_index[r] == restart and len(held[r]) == restart]
    if not starting:
        return None
    if not backend.row_positions and batch > 1:
        starting = list(range(batch))
        backend.reset()
    ids = np.zeros((batch, width), dtype=np.int64)
    ids[:, 0] = next_ids
    num_new = np.ones(batch, dtype=np.int64)
    for r in starting:
        fed = [*held[r], int(next_ids[r])] if r < rows else [int(next_ids[r])]
        ids[r, : len(fed)] = fed
        num_new[r], write_index[r], held[r] = len(fed), 0, []
    return ids, num_new


def decoding(
    backend: StepBackend,
    step: Callable[[np.ndarray, np.ndarray], np.ndarray],
    width: int | None,
    write_index: np.ndarray,
    held: list[list[int]],
    rows: int,
) -> Callable[[np.ndarray], np.ndarray]:
    """The loop's decode step, `ids [B, 1]` -> the next ids `[B]`, through `step(ids, num_new)`:
    one token a row, or, where a row is about to pass LongRoPE's switch (`width`: `restart_width`'s),
    the restart step. It keeps `write_index [B]` one short of what the step wrote, as a decode
    step's caller adds that one."""

    def decode(ids: np.ndarray) -> np.ndarray:
        restarting = width is not None and restart_step(backend, width, ids[:, 0], write_index, held, rows)
        if not restarting:
            return step(ids, np.ones(len(ids), dtype=np.int64))
        next_ids = step(*restarting)
        write_index[:] += restarting[1] - 1
        return next_ids

    return decode
