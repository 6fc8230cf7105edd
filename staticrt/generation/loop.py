"""The one host-side generation loop, for every backend. It never imports torch.

It deals in token ids only (Python ints, NumPy arrays): each step hands the backend fixed-shape
`input_ids [B, T]`, `write_index [B]` and `num_new [B]` (T is 1 for decode and a bucket size
for prefill; prompts are right-padded) plus the sampling parameters and the uniforms drawn here
from the seeded generator. The backend returns the next token of each row `[B]`. That read is
the one device-to-host synchronisation per generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import GenerationError, as_int, as_real

StreamCallback = Callable[[int, int], None]  # (row, token id), called as each token is chosen
MAX_NEW_TOKENS = 32  # what a generation asks for when nobody says (the Python API and `staticrt run`)


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None

    def checked(self, vocab_size: int) -> SamplingParams:
        """These parameters as plain Python numbers, or a GenerationError naming the one at fault.
        Types are checked always, ranges when sampling; a top_k of the vocabulary or more keeps
        every token, so it becomes 0 (and never overflows a tensor)."""
        if not isinstance(self.do_sample, bool) and type(self.do_sample).__name__ != "bool_":
            raise GenerationError(f"do_sample is {self.do_sample!r}; it must be True or False")
        temperature = as_real(self.temperature, "temperature")
        top_k = as_int(self.top_k, "top_k", 0)
        top_p = as_real(self.top_p, "top_p")
        seed = None if self.seed is None else as_int(self.seed, "seed", 0)
        if self.do_sample:
            if not temperature > 0:
                raise GenerationError(f"temperature is {temperature}; it must be > 0 (use do_sample=False for greedy)")
            if not 0 < top_p <= 1:
                raise GenerationError(f"top_p is {top_p}; it must be in (0, 1]")
        return SamplingParams(bool(self.do_sample), temperature, 0 if top_k >= vocab_size else top_k, top_p, seed)


class StepBackend(Protocol):
    """What the loop needs of a backend; caches and graphs stay behind it."""

    name: str
    cache_kind: str  # the cache it runs: "static", "sliding", ...
    batch_size: int
    max_cache_len: int
    max_sequence_len: int | None  # positions a row can reach; None when the cache never runs out
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # the model's end-of-sequence ids, the default stop tokens
    row_positions: bool  # whether each row writes at its own position (False: one column for all rows, genai's)
    buckets: tuple[int, ...]

    def reset(self) -> None: ...

    def prepare(self, widths: Sequence[int], do_sample: bool, continuing: bool = False) -> float:
        """Build what steps of these widths need before the first one is timed (a compile, a CUDA
        graph capture), so that compile time is never counted as prefill; the seconds it took. May
        write anywhere in the cache: it runs before `reset`, when the cache holds nothing live.
        `continuing`: also multi-token steps of rows that hold tokens already (a server's chunked
        prompts, a prefill beside decoding rows), which run graphs of their own (`starts_fresh`)."""

    def unbuilt(self, widths: Sequence[int], do_sample: bool, continuing: bool = False) -> set[Hashable]:
        """The graphs `prepare` with these arguments would build, by a key of this backend's own: a
        start-up counts the union first (greedy and sampling steps may share a graph)."""

    def report(self) -> dict[str, Any]:
        """What a benchmark reads off the backend after its runs (cache bytes, graph GPU time)."""

    def remedy(self, limit: str) -> str:
        """How a user raises `limit` ("max_cache_len", "max_batch_size", "prefill_buckets") here."""

    def step(
        self,
        input_ids: np.ndarray,  # [B, T] int64
        write_index: np.ndarray,  # [B] int64
        num_new: np.ndarray,  # [B] int64, real tokens a row in this step
        sampling: SamplingParams,  # temperature, top_k, top_p: one for every row, or [B] (a server's rows)
        uniforms: np.ndarray | None,  # [B] float32 when sampling
    ) -> np.ndarray: ...  # [B] int64


@dataclass
class GenerationStats:
    compile_s: float = 0.0  # building the graphs this call used first (`StepBackend.prepare`), apart from prefill
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)
    bucket: int = 0

    @property
    def decode_ms_per_token(self) -> float | None:
        """Median decode step in ms; None when the call decoded nothing (one new token: prefill only)."""
        return 1000 * float(np.median(self.decode_s)) if self.decode_s else None


def per_row(value: Any, batch: int, dtype: Any) -> np.ndarray:
    """A sampling parameter as `[batch]` values: one number for every row, or already one a row."""
    return np.array(np.broadcast_to(np.asarray(value, dtype=dtype), (batch,)))  # a writable copy


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


@dataclass(frozen=True)
class Request:
    """A generation request after every check: plain Python values the loop can trust."""

    rows: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    stops: frozenset[int]


def _token_ids(value: Any, what: str) -> list[int]:
    """A row of token ids from a list, tuple or 1-D integer array; each id an int (never a float,
    a bool or a string, which would run as some other token)."""
    if hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise GenerationError(f"{what} is a {type(value).__name__}; pass a list of token ids")
    return [as_int(t, f"{what} token {i}") for i, t in enumerate(value)]


def validate_request(
    backend: StepBackend,
    prompts: Any,
    max_new_tokens: Any,
    sampling: SamplingParams,
    stop_token_ids: Any = (),
    stream: Any = None,
    chunked: bool = False,
) -> Request:
    """Every check on a request, before the cache or the RNG is touched. `chunked`: prompts longer
    than the largest bucket are allowed (a server prefills them a bucket at a time)."""
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 2:
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a non-empty list of token-id lists")
    if len(prompts) > backend.batch_size:
        raise GenerationError(
            f"{len(prompts)} prompts exceed max_batch_size={backend.batch_size}; "
            f"split the batch or {backend.remedy('max_batch_size')}"
        )
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", 1)
    sampling = sampling.checked(backend.vocab_size)
    stops = frozenset(() if stop_token_ids is None else _token_ids(stop_token_ids, "stop_token_ids"))
    if stream is not None and not callable(stream):
        raise GenerationError(f"stream is a {type(stream).__name__}; pass a function (row, token id) or None")
    rows = []
    for r, prompt in enumerate(prompts):
        ids = _token_ids(prompt, f"prompt {r}")
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
                f"fewer tokens or {backend.remedy('max_cache_len')}"
            )
        if len(ids) > backend.buckets[-1] and not chunked:
            raise GenerationError(
                f"prompt {r} has {len(ids)} tokens, beyond the largest prefill bucket {backend.buckets[-1]}; "
                f"shorten the prompt or {backend.remedy('prefill_buckets')}"
            )
        rows.append(ids)
    return Request(rows, max_new_tokens, sampling, stops)


def generate_tokens(
    backend: StepBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] | None = (),
    stream: StreamCallback | None = None,
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """Prefill every row in one bucket, then decode one token a step until each row has
    `max_new_tokens` or has emitted a stop token (kept in its output, as transformers does)."""
    request = validate_request(backend, prompts, max_new_tokens, sampling, stop_token_ids, stream)
    rows, max_new_tokens, sampling, stops = request.rows, request.max_new_tokens, request.sampling, request.stops
    stats = stats if stats is not None else GenerationStats()
    batch, n_rows = backend.batch_size, len(rows)
    lengths = np.ones(batch, dtype=np.int64)  # rows beyond the request hold one dummy token
    lengths[:n_rows] = [len(r) for r in rows]
    bucket = bucket_for(backend.buckets, int(lengths.max()))
    input_ids = np.zeros((batch, bucket), dtype=np.int64)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = ids
    # Row r draws from its own generator, seeded seed + r: a prompt's tokens do not depend on the
    # batch size or on its neighbours, and a server's request with seed s samples row 0's tokens.
    rngs = [np.random.default_rng(None if sampling.seed is None else sampling.seed + r) for r in range(batch)]

    def uniforms() -> np.ndarray | None:
        return np.array([g.random(dtype=np.float32) for g in rngs], dtype=np.float32) if sampling.do_sample else None

    stats.compile_s = backend.prepare((bucket, 1) if max_new_tokens > 1 else (bucket,), sampling.do_sample)
    backend.reset()
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
