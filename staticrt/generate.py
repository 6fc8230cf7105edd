"""The one host-side generation loop, for every backend. It never imports torch.

It deals in token ids only (Python ints, NumPy arrays): each step hands the backend fixed-shape
`input_ids [B, T]`, `write_index [B]` and `num_new [B]` (T is 1 for decode and a bucket size
for prefill; prompts are right-padded) plus the sampling parameters and the uniforms drawn here
from the seeded generator. The backend returns the next token of each row `[B]`. That read is
the one device-to-host synchronisation per generated token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

StreamCallback = Callable[[int, int], None]  # (row, token id), called as each token is chosen


class GenerationError(ValueError):
    """A bad generation request, raised before any state changes; names the input and the limit."""


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise GenerationError(f"temperature is {self.temperature}; it must be > 0 (use do_sample=False for greedy)")
        if self.top_k < 0:
            raise GenerationError(f"top_k is {self.top_k}; it must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p is {self.top_p}; it must be in (0, 1]")


class StepBackend(Protocol):
    """What the loop needs of a backend; caches and graphs stay behind it."""

    name: str
    batch_size: int
    max_cache_len: int
    max_sequence_len: int | None  # positions a row can reach; None when the cache never runs out
    vocab_size: int
    buckets: tuple[int, ...]

    def reset(self) -> None: ...

    def step(
        self,
        input_ids: np.ndarray,  # [B, T] int64
        write_index: np.ndarray,  # [B] int64
        num_new: np.ndarray,  # [B] int64, real tokens per row in this step
        sampling: SamplingParams,
        uniforms: np.ndarray | None,  # [B] float32 when sampling
    ) -> np.ndarray: ...  # [B] int64


@dataclass
class GenerationStats:
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)
    bucket: int = 0

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * float(np.median(self.decode_s)) if self.decode_s else float("nan")


def default_buckets(max_cache_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to, and always including, `max_cache_len`."""
    sizes, size = [], smallest
    while size < max_cache_len:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_cache_len,)


def check_positions(
    write_index: Sequence[int], steps: int, limit: int | None, kind: str, error: type[Exception] = GenerationError
) -> None:
    """Refuse, on the host and before anything runs, a step of `steps` tokens per row at
    `write_index` that would write past position `limit - 1` of a `kind` cache (None: no limit).
    A compiled graph or an exported program cannot raise on data, so every backend checks here."""
    if limit is None:
        return
    for row, start in enumerate(write_index):
        if int(start) + steps > limit:
            raise error(
                f"row {row} writes positions {int(start)}..{int(start) + steps - 1}, but this {kind} "
                f"cache holds positions 0..{limit - 1} (max_cache_len={limit}); build it with a larger "
                "max_cache_len"
            )


def validate_request(
    backend: StepBackend, prompts: Any, max_new_tokens: int, sampling: SamplingParams
) -> list[list[int]]:
    """Every check on a request, before the cache or the RNG is touched."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a non-empty list of token-id lists")
    if len(prompts) > backend.batch_size:
        raise GenerationError(
            f"{len(prompts)} prompts exceed max_batch_size={backend.batch_size}; "
            "split the batch or build the Generator with a larger max_batch_size"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens is {max_new_tokens!r}; it must be an int >= 1")
    sampling.validate()
    rows = []
    for r, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise GenerationError(f"prompt {r} is a {type(prompt).__name__}; pass a list of token ids")
        ids = [int(t) for t in prompt]
        if not ids:
            raise GenerationError(f"prompt {r} is empty; every row needs at least one token")
        bad = [t for t in ids if not 0 <= t < backend.vocab_size]
        if bad:
            raise GenerationError(
                f"prompt {r} holds token id(s) {bad[:5]} outside the vocabulary [0, {backend.vocab_size})"
            )
        limit = backend.max_sequence_len
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt {r} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, beyond max_cache_len={limit}; shorten the prompt, ask for "
                "fewer tokens or build the Generator with a larger max_cache_len"
            )
        if len(ids) > backend.buckets[-1]:
            raise GenerationError(
                f"prompt {r} has {len(ids)} tokens, beyond the largest prefill bucket {backend.buckets[-1]}; "
                "add a larger bucket"
            )
        rows.append(ids)
    return rows


def generate_tokens(
    backend: StepBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
    stream: StreamCallback | None = None,
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """Prefill every row in one bucket, then decode one token a step until each row has
    `max_new_tokens` or has emitted a stop token (kept in its output, as transformers does)."""
    rows = validate_request(backend, prompts, max_new_tokens, sampling)
    stats = stats if stats is not None else GenerationStats()
    batch, n_rows = backend.batch_size, len(rows)
    lengths = np.ones(batch, dtype=np.int64)  # rows beyond the request hold one dummy token
    lengths[:n_rows] = [len(r) for r in rows]
    bucket = next(b for b in backend.buckets if b >= lengths.max())
    input_ids = np.zeros((batch, bucket), dtype=np.int64)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = ids
    rng = np.random.default_rng(sampling.seed)

    def uniforms() -> np.ndarray | None:
        return rng.random(batch, dtype=np.float32) if sampling.do_sample else None

    backend.reset()
    stops = set(int(t) for t in stop_token_ids)
    out: list[list[int]] = [[] for _ in rows]
    done = [False] * n_rows
    write_index = np.zeros(batch, dtype=np.int64)
    ones = np.ones(batch, dtype=np.int64)

    start = time.perf_counter()
    next_ids = backend.step(input_ids, write_index, lengths, sampling, uniforms())
    stats.prefill_s, stats.bucket, stats.decode_s = time.perf_counter() - start, bucket, []
    write_index = lengths.copy()
    for step in range(max_new_tokens):
        for r in range(n_rows):
            if done[r]:
                continue
            token = int(next_ids[r])
            out[r].append(token)
            if stream is not None:
                stream(r, token)
            done[r] = token in stops
        if all(done) or step == max_new_tokens - 1:
            break
        start = time.perf_counter()
        next_ids = backend.step(next_ids.reshape(batch, 1), write_index, ones, sampling, uniforms())
        stats.decode_s.append(time.perf_counter() - start)
        write_index += 1
    return out


class Generator:
    """A model bound to a cache and a backend, for repeated generation with fixed shapes.

    `model` is a `Decoder` (from `staticrt.load_model`) or an already built `StepBackend`.
    `cache` is "static", "sliding" (every layer a rotating buffer of `window` slots), "hybrid"
    (rotating buffers for sliding layers only), "offloaded" (every layer's K/V in host memory,
    two device working buffers), "offloaded-hybrid" (a hybrid cache with its global layers
    offloaded) or "auto" (what the model's config implies); or a cache already built (e.g.
    `staticrt.build_cache(model.config, ...)`), whose spec then sets batch size, length and window.
    `window` defaults to the model's `sliding_window`; `max_batch_size` to 1. Building the torch
    backends imports torch; this module itself does not.
    """

    def __init__(
        self,
        model: Any,
        cache: Any = "static",
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
        backend: str = "eager",
        prefill_buckets: Sequence[int] | None = None,
        window: int | None = None,
    ) -> None:
        if hasattr(model, "step") and hasattr(model, "buckets"):
            self.backend: StepBackend = model
        else:
            from .backends import create_backend

            self.backend = create_backend(
                backend, model, cache=cache, max_batch_size=max_batch_size,
                max_cache_len=max_cache_len, prefill_buckets=prefill_buckets, window=window,
            )
        self.last_stats = GenerationStats()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        stream: StreamCallback | None = None,
    ) -> list[list[int]]:
        """New token ids per prompt; timings of the call land in `self.last_stats`."""
        sampling = SamplingParams(do_sample, temperature, top_k, top_p, seed)
        self.last_stats = GenerationStats()
        return generate_tokens(
            self.backend, prompts, max_new_tokens, sampling, stop_token_ids, stream, self.last_stats
        )
