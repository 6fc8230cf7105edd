"""Eager torch backend: the model and cache run op by op. The compiled backend reuses all of it
and only swaps how a step function is obtained."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..caches import CacheSpec, KVCache, build_cache, default_max_cache_len
from ..generate import GenerationError, SamplingParams, default_buckets
from ..model import Decoder
from ..sampling import greedy, sample

StepFn = Callable[..., torch.Tensor]


def run_step(
    model: Decoder,
    cache: KVCache,
    input_ids: torch.Tensor,  # [B, T]
    write_index: torch.Tensor,  # [B]
    num_new: torch.Tensor,  # [B]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    uniform: torch.Tensor | None,  # [B], None for greedy
) -> torch.Tensor:
    """One model step plus token choice: the unit every torch backend runs (and compiles) whole."""
    logits = model(input_ids, write_index, cache, num_new)  # [B, V]
    if uniform is None:
        return greedy(logits)
    return sample(logits, temperature, top_k, top_p, uniform)


class EagerBackend:
    name = "eager"

    def __init__(
        self,
        model: Decoder,
        cache: str = "static",
        max_batch_size: int = 1,
        max_cache_len: int | None = None,
        prefill_buckets: Sequence[int] | None = None,
        window: int | None = None,
    ) -> None:
        config = model.config
        max_cache_len = max_cache_len or default_max_cache_len(config, cache)
        buckets = tuple(sorted(set(prefill_buckets))) if prefill_buckets else default_buckets(max_cache_len)
        if buckets[0] < 1 or buckets[-1] > max_cache_len:
            raise GenerationError(
                f"prefill buckets {list(buckets)} must lie in [1, max_cache_len={max_cache_len}]"
            )
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        spec = CacheSpec(cache, max_batch_size, max_cache_len, window)
        self.cache = build_cache(config, spec, param.dtype, param.device)
        self.batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.max_sequence_len = self.cache.max_sequence_len
        self.vocab_size = config.vocab_size
        self.buckets = buckets

    def step_function(self, steps: int, do_sample: bool) -> StepFn:
        """The callable that runs a step of `steps` tokens; eager runs `run_step` as it is."""
        return run_step

    def reset(self) -> None:
        self.cache.reset()

    def step(
        self,
        input_ids: np.ndarray,
        write_index: np.ndarray,
        num_new: np.ndarray,
        sampling: SamplingParams,
        uniforms: np.ndarray | None,
    ) -> np.ndarray:
        batch, steps = input_ids.shape
        self.cache.check_step(write_index, steps)
        dev = self.device
        full = lambda value, dtype: torch.full((batch,), value, dtype=dtype, device=dev)  # noqa: E731
        fn = self.step_function(steps, uniforms is not None)
        with torch.no_grad():
            next_ids = fn(
                self.model,
                self.cache,
                torch.from_numpy(input_ids).to(dev),
                torch.from_numpy(write_index).to(dev),
                torch.from_numpy(num_new).to(dev),
                full(sampling.temperature, torch.float32),
                full(sampling.top_k, torch.int64),
                full(sampling.top_p, torch.float32),
                None if uniforms is None else torch.from_numpy(uniforms).to(dev),
            )
        return next_ids.cpu().numpy()  # the step's one device-to-host read
