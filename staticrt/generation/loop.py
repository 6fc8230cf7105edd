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
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from .logit_bias import counting, row_biases, step_bias
from .logprobs import TokenLogprob, asking
from .params import SamplingParams
from .prefill import decoding, prefill_inputs, restart_width
from .prefix import Layouts, mark_cut_tails
from .request import validate_request
from .speculative import Speculation
from .speculator import Speculator, speculator_for

StreamCallback = Callable[[int, int], None]  # (row, token id), called as each token is chosen
MAX_NEW_TOKENS = 32  # what a generation asks for when nobody says (the Python API and `staticrt run`)


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
    rotating_layouts: Layouts  # the cache's rotating layers (prefix.py): where a row may continue from
    rope_restart: int | None  # where a sequence is computed again from 0 (LongRoPE: prefill.py), else None

    def reset(self) -> None: ...

    def prepare(self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True) -> float:
        """Build what steps of these widths need before the first one is timed (a compile, a CUDA
        graph capture), so that compile time is never counted as prefill; the seconds it took.
        Every row's cache holds what it held before (a row may be continued after it).
        `continuing`: also multi-token steps of rows that hold tokens already (a server's chunked
        prompts, a prefill beside decoding rows, a kept prefix), which run graphs of their own
        (`starts_fresh`); `fresh` False: only those, not the multi-token steps from position 0."""

    def unbuilt(
        self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True
    ) -> set[Hashable]:
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
    kept: list[int] = field(default_factory=list)  # prompt tokens each row kept in its cache (not prefilled)
    decode_tokens: float = 0.0  # tokens a row took from the steps after prefill (a mean over rows)
    verify_steps: int = 0  # of the decode steps, those that checked drafted tokens (speculative.py)
    drafted: int = 0  # draft tokens fed, over rows
    accepted: int = 0  # of them, those the model chose too

    @property
    def decode_ms_per_token(self) -> float | None:
        """Median decode step in ms, or with speculation the decode time over the tokens a row
        took; None when the call decoded nothing (one new token: prefill only)."""
        if self.verify_steps:
            return 1000 * sum(self.decode_s) / self.decode_tokens
        return 1000 * float(np.median(self.decode_s)) if self.decode_s else None

    @property
    def acceptance(self) -> float | None:
        """The share of draft tokens accepted; None without drafts."""
        return self.accepted / self.drafted if self.drafted else None


def _uniforms(rngs: list[np.random.Generator], shape: tuple[int, ...]) -> np.ndarray:
    """Uniform draws of `shape` a row, `[B, *shape]` float32, each from the row's own generator
    (its sampled tokens depend on its seed alone): one for a step, `(T, 2)` for a verify step."""
    return np.array([g.random(shape, dtype=np.float32) for g in rngs], dtype=np.float32)


def _tracked(backend: StepBackend, held: list[list[int]], n_rows: int, run: Callable[..., Any], *inputs: Any) -> Any:
    """`run(*inputs)` (a step of `backend`: ids, write_index, num_new, ...), and what the request's
    rows hold after it; on a failure nothing, where a rotating layer may have overwritten slots of
    held positions (linear layers write only past them)."""
    try:
        next_ids = run(*inputs)
    except BaseException:
        if backend.rotating_layouts:
            held[:] = [[] for _ in held]
        raise
    ids, num_new = inputs[0], inputs[2]
    for r in range(n_rows):
        held[r].extend(ids[r, : num_new[r]].tolist())
    return next_ids


def generate_tokens(
    backend: StepBackend,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] | None = (),
    stream: StreamCallback | None = None,
    stats: GenerationStats | None = None,
    held: list[list[int]] | None = None,
    reuse: bool = False,
    speculative: Speculation | None = None,
    logprobs: list[list[TokenLogprob]] | None = None,
) -> list[list[int]]:
    """Prefill every row in one bucket, then decode one token a step until each row has
    `max_new_tokens` or has emitted a stop token (kept in its output, as transformers does).

    `held [B]`: the ids each row's cache holds, kept true step by step (the Generator owns it).
    With `reuse`, a row keeps the prefix of its prompt that it already holds, where that is exact
    (prefix.py), and prefills only the rest: the tokens are a whole prefill's. With `speculative`,
    decode steps verify tokens drafted from each row's own, greedy or sampling (speculative.py).
    Where `sampling.logprobs` asks, `logprobs` gets each row's tokens' entries (logprobs.py)."""
    request = validate_request(backend, prompts, max_new_tokens, sampling, stop_token_ids, stream, chunked=reuse)
    rows, max_new_tokens, sampling, stops = request.rows, request.max_new_tokens, request.sampling, request.stops
    sampling, record = asking(sampling, speculative is not None, logprobs, len(rows))
    stats = stats if stats is not None else GenerationStats()
    batch, n_rows = backend.batch_size, len(rows)
    held = held if held is not None else [[] for _ in range(batch)]
    biased = row_biases(sampling.rule, n_rows, speculative is not None)
    speculator = speculator_for(backend, speculative, sampling.do_sample, held, n_rows)
    kept, input_ids, write_index, lengths = prefill_inputs(backend, rows, held, reuse)
    restart = restart_width(backend, [len(ids) for ids in rows], max_new_tokens)
    # Row r draws from its own generator, seeded seed + r: a prompt's tokens do not depend on the
    # batch size or on its neighbours, and a server's request with seed s samples row 0's tokens.
    rngs = [np.random.default_rng(None if sampling.seed is None else sampling.seed + r) for r in range(batch)]

    def step(ids: np.ndarray, num_new: np.ndarray, run: Callable = backend.step, shape: tuple = ()) -> np.ndarray:
        uniforms = _uniforms(rngs, shape) if sampling.do_sample else None
        params = replace(sampling, bias=step_bias(biased, batch, backend.vocab_size)) if biased else sampling
        return _tracked(backend, held, n_rows, run, ids, write_index, num_new, params, uniforms)

    continuing, bucket = any(kept), input_ids.shape[1]
    stats.compile_s = _prepare(backend, bucket, max_new_tokens, sampling.do_sample, continuing, restart)
    stats.compile_s += speculator.prepare(rows) if speculator and max_new_tokens > 1 else 0.0
    if not continuing:
        backend.reset()
    cut = [len(h) if continuing else 0 for h in held[:n_rows]]  # what a row held before it was cut back
    held[:] = [ids[:k] for ids, k in zip(rows, kept, strict=True)] + [[] for _ in range(batch - n_rows)]
    start = time.perf_counter()
    next_ids = step(input_ids, lengths)
    stats.prefill_s, stats.bucket, stats.decode_s, stats.kept = time.perf_counter() - start, bucket, [], list(kept)
    write_index += lengths

    def verify(ids: np.ndarray, num_new: np.ndarray) -> np.ndarray:
        return step(ids, num_new, backend.verify_step, (ids.shape[1], 2))

    steps = decoding(backend, step, restart, write_index, held, n_rows)
    emit = record(counting(biased, stream) if biased else stream)
    out = _decode(steps, next_ids, n_rows, max_new_tokens, stops, emit, write_index, stats, speculator, verify)
    mark_cut_tails(held, cut, kept, backend.rotating_layouts)
    return out


def _prepare(
    backend: StepBackend, bucket: int, max_new_tokens: int, do_sample: bool, continuing: bool, restart: int | None
) -> float:
    """Build a generation's graphs before its first step is timed (`StepBackend.prepare`): its
    prefill and decode steps, and LongRoPE's restart step of width `restart` where a row will need
    it (from position 0: one row, or all at once; beside decoding rows); the seconds it took."""
    widths = (bucket, 1) if max_new_tokens > 1 else (bucket,)
    spent = backend.prepare(widths, do_sample, continuing=continuing, fresh=not continuing)
    if restart is not None:
        spent += backend.prepare((restart,), do_sample, continuing=backend.batch_size > 1)
    return spent


def _decode(
    step: Callable[[np.ndarray], np.ndarray],
    next_ids: np.ndarray,
    n_rows: int,
    max_new_tokens: int,
    stops: frozenset[int],
    stream: StreamCallback | None,
    write_index: np.ndarray,
    stats: GenerationStats,
    speculator: Speculator | None = None,
    verify: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> list[list[int]]:
    """From the prefill's tokens `next_ids [B]`, a step at a time until each of the request's rows
    has `max_new_tokens` or a stop token; `write_index [B]` advances with the steps. A step is a
    decode step (one token a row), or with a `speculator` a verify step through `verify` where
    rows drafted tokens (speculative.py)."""
    out: list[list[int]] = [[] for _ in range(n_rows)]
    done = [False] * n_rows
    emitted = [[int(t)] for t in next_ids[:n_rows]]
    while True:
        for r in range(n_rows):
            for token in emitted[r]:
                if done[r]:
                    break
                out[r].append(token)
                if stream is not None:
                    stream(r, token)
                done[r] = token in stops or len(out[r]) == max_new_tokens
        if all(done):
            break
        start = time.perf_counter()
        drafts = speculator.drafts(next_ids, write_index, done) if speculator else None
        if drafts is None:
            next_ids = step(next_ids.reshape(len(next_ids), 1))
            write_index += 1
            emitted = [[int(t)] for t in next_ids[:n_rows]]
        else:
            next_ids, emitted = speculator.verify(drafts, next_ids, write_index, verify)
            stats.verify_steps += 1
            stats.drafted += sum(len(d) for d in drafts)
            stats.accepted += sum(len(e) - 1 for e, d in zip(emitted, done, strict=True) if not d)
        stats.decode_s.append(time.perf_counter() - start)
        if speculator:
            taken = None if drafts is None else [len(e) for e, d in zip(emitted, done, strict=True) if not d]
            speculator.policy.timed(stats.decode_s[-1], taken)
    if speculator:
        speculator.finish()
    stats.decode_tokens = (sum(len(o) for o in out) - n_rows) / n_rows
    return out
