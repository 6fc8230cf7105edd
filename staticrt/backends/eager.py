"""Eager torch backend: the model and cache run op by op. The compiled backend reuses all of it
and only swaps how a step function is obtained (`step_function`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ..caches import CacheSpec, KVCache, build_cache, resolve_max_cache_len
from ..caches.row_state import RowStash
from ..errors import CacheError, GenerationError, as_int
from ..generation.buckets import default_buckets
from ..generation.params import SamplingParams, per_row
from ..generation.prefix import Layouts, rotating_layouts
from ..models.decoder import Decoder
from .step import (
    StepFn,
    choice_candidates,
    gives_logprobs,
    host_ids,
    run_logprobs_step,
    run_step,
    run_verify_step,
    starts_fresh,
    step_choice,
    verifies,
)


def _check_cache(cache: KVCache, model: Decoder, param: torch.Tensor, **requested: int | None) -> None:
    """Refuse a prebuilt cache that does not fit the model, before anything runs on it."""
    if cache.device != param.device:
        raise CacheError(
            f"the {cache.kind} cache is on {cache.device}, the model on {param.device}; build the cache with "
            f"device={str(param.device)!r} (its working buffers must sit where the model computes)"
        )
    if cache.dtype != param.dtype:
        raise CacheError(
            f"the cache holds {cache.dtype}, the model computes in {param.dtype}; "
            f"build the cache with dtype={param.dtype}"
        )
    if cache.config != model.config:
        raise CacheError("the cache was built for another model config; build it from this model's `config`")
    for name, value in requested.items():
        held = getattr(cache.spec, name)
        if value is not None and value != held:
            raise CacheError(
                f"{name}={value} conflicts with the cache's {name}={held}; leave it unset when passing a cache"
            )


class EagerBackend(RowStash):
    name = "eager"
    row_positions = True

    def __init__(
        self,
        model: Decoder,
        cache: str | KVCache = "static",
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
        prefill_buckets: Sequence[int] | None = None,
        window: int | None = None,
    ) -> None:
        """`cache` is a kind name (built here on the model's device) or a cache already built,
        whose spec then decides batch size, length and window."""
        config = model.config
        param = next(model.parameters())
        if isinstance(cache, KVCache):
            _check_cache(cache, model, param, max_batch_size=max_batch_size, max_cache_len=max_cache_len, window=window)
            self.cache = cache
        else:
            max_cache_len = resolve_max_cache_len(config, cache, max_cache_len, window=window)
            spec = CacheSpec(cache, 1 if max_batch_size is None else max_batch_size, max_cache_len, window)
            self.cache = build_cache(config, spec, param.dtype, param.device)
        max_cache_len = self.cache.spec.max_cache_len
        if prefill_buckets is None:
            buckets = default_buckets(max_cache_len)
        else:
            buckets = tuple(sorted({as_int(b, "prefill bucket", 1) for b in prefill_buckets}))
            if not buckets:
                raise GenerationError("prefill_buckets is empty; give at least one width, or None for the default")
        if buckets[0] < 1 or buckets[-1] > max_cache_len:
            raise GenerationError(f"prefill buckets {list(buckets)} must lie in [1, max_cache_len={max_cache_len}]")
        self.model = model
        self.device = param.device
        self.batch_size = self.cache.spec.max_batch_size
        self.max_cache_len = max_cache_len
        self.max_sequence_len = self.cache.max_sequence_len
        self.vocab_size = config.vocab_size
        self.eos_token_ids = config.eos_token_ids
        self.rope_restart = config.rope_restart
        self.buckets = buckets
        self.live = False  # whether a row may hold tokens a later step continues: steps set it, `reset` clears it

    @property
    def cache_kind(self) -> str:
        return self.cache.kind

    @property
    def rotating_layouts(self) -> Layouts:
        cache, config = self.cache, self.model.config
        layouts = [cache.layer_layout(i) for i in range(len(cache.rotating))]
        return rotating_layouts(
            layouts, cache.layer_lengths, config.layer_types, config.sliding_window, config.conv_kernel
        )

    def step_function(self, seq_len: int, choice: str, fresh: bool) -> StepFn:
        """The callable that runs a step of `seq_len` tokens a row choosing as `choice` says
        (`step_choice`), from position 0 where `fresh` (`starts_fresh`); eager runs `run_step`
        as it is."""
        if verifies(choice):
            return run_verify_step
        return run_logprobs_step if gives_logprobs(choice) else run_step

    def reset(self) -> None:
        self.cache.reset()
        self.live = False

    def adopt_row(self, row: int, source: EagerBackend, source_row: int) -> None:
        """Row `row` of this cache takes `source`'s row `source_row` (a backend over the same
        model and cache layout, of any batch size): a prompt prefilled alone joins the batch."""
        self.cache.copy_row(source.cache, source_row, row)

    def narrowed(self, rows: int) -> EagerBackend | None:
        """A backend of this kind whose cache is this one's first `rows` rows (the same storage): a
        server's step over fewer busy rows than it has computes those alone. None where the cache
        cannot be viewed so (`leading_rows`)."""
        view = self.cache.leading_rows(rows)
        return None if view is None else type(self)(self.model, cache=view, prefill_buckets=self.buckets)

    def row_buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.cache.named_buffers())

    def prepare(
        self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True, **_: Any
    ) -> float:
        """Nothing to build: eager runs the step as it is."""
        return 0.0

    def unbuilt(
        self, widths: Sequence[int], do_sample: bool, continuing: bool = False, fresh: bool = True, **_: Any
    ) -> set[Hashable]:
        return set()

    def remedy(self, limit: str) -> str:
        """The Generator's own argument raises each limit."""
        return f"build the Generator with a larger {'bucket in ' if limit == 'prefill_buckets' else ''}{limit}"

    def report(self) -> dict[str, Any]:
        """The cache's bytes on the device and in host memory."""
        return {"cache_device_bytes": self.cache.device_bytes(), "cache_host_bytes": self.cache.host_bytes()}

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        sink = sampling.logprobs_to
        choice = step_choice(uniforms is not None, logprobs=sink is not None)
        self.live = True
        result = self.run(choice, input_ids, write_index, num_new, sampling, uniforms)
        return host_ids(result, sink)  # the step's one device-to-host read (and its log-probabilities, if asked)

    def beam_step(
        self, input_ids: np.ndarray, write_index: np.ndarray, num_new: np.ndarray, candidates: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A step of beam search: each row's `candidates` best next tokens, as log-probabilities
        `[B, k]` float32 (descending) and ids `[B, k]` int64 (`sampling.beam_candidates`)."""
        self.live = True
        scores, ids = self.run(step_choice(False, candidates), input_ids, write_index, num_new, SamplingParams(), None)
        return scores.cpu().numpy(), ids.cpu().numpy()

    def verify_step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams | None = None,
        uniforms: np.ndarray | None = None,
    ) -> np.ndarray:
        """A step that checks drafted tokens: row b feeds `input_ids[b, :num_new[b]]` (its next
        token, then its draft) and gets the token after each position, `[B, T]` int64: the greedy
        one, or with `uniforms [B, T, 2]` speculative sampling's (`sampling.verify_sample`)."""
        self.live = True
        choice = step_choice(uniforms is not None, verify=True)
        return self.run(choice, input_ids, write_index, num_new, sampling or SamplingParams(), uniforms).cpu().numpy()

    def reorder_rows(self, rows: np.ndarray) -> None:
        """Row b of the cache takes row `rows[b]`'s contents (`rows [B]` int64), in place: beam
        search keeps the beams it continues. Every buffer keeps its address."""
        with torch.no_grad():
            self.cache.reorder_cache(torch.from_numpy(rows).to(self.device))

    def run(
        self,
        choice: str,
        input_ids: np.ndarray,  # [B, T]
        write_index: np.ndarray,  # [B]
        num_new: np.ndarray,  # [B]
        sampling: SamplingParams,
        uniforms: np.ndarray | None,  # [B] when sampling ([B, T, 2] in a verify step)
    ) -> Any:
        """Run one step on the device and return what `choice` asks for, still on the device."""
        batch, seq_len = input_ids.shape
        self.cache.check_step(write_index, seq_len)
        dev = self.device
        full = lambda value, dtype: torch.from_numpy(per_row(value, batch, dtype)).to(dev)  # noqa: E731
        fresh = starts_fresh(write_index, seq_len)
        fn = self.step_function(seq_len, choice, fresh)
        with torch.no_grad():
            return fn(
                self.model,
                self.cache,
                torch.from_numpy(input_ids).to(dev),
                torch.from_numpy(write_index).to(dev),
                torch.from_numpy(num_new).to(dev),
                full(sampling.temperature, np.float32),
                full(sampling.top_k, np.int64),
                full(sampling.top_p, np.float32),
                None if uniforms is None else torch.from_numpy(uniforms).to(dev),
                choice_candidates(choice),
                fresh,
                bias=self.bias_input(sampling.bias, batch),
            )

    def bias_input(self, bias: np.ndarray | None, batch: int) -> torch.Tensor | None:
        """The step's logit bias `[B, V]` on the device (`run_step`'s `bias`), or None for none:
        eager adds nothing then."""
        return None if bias is None else torch.from_numpy(bias).to(self.device)
