"""The one step every torch backend runs, and compiles, whole: the model's forward over the cache
plus the token choice (`run_step`), and the names of its kinds of choice (`step_choice`), which
key a compiled or captured graph."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..caches import KVCache
from ..generation.sampling import beam_candidates, greedy, pick, sample, verify_sample
from ..models.decoder import Decoder

StepFn = Callable[..., Any]


def step_choice(do_sample: bool, candidates: int = 0, verify: bool = False) -> str:
    """How a step picks what it returns, and what its graph is called: "greedy", "sample",
    "beam{k}" (each row's k best continuations, for beam search), "verify" (the greedy token
    after every position, checking drafted tokens: `verify_step`) or "verify_sample" (speculative
    sampling's token after every position). A compiled backend may run greedy and sampling steps
    as one choice, "pick" (`CompiledBackend.graph_choice`)."""
    if verify:
        return VERIFY_SAMPLE if do_sample else VERIFY
    return f"beam{candidates}" if candidates else ("sample" if do_sample else "greedy")


VERIFY, VERIFY_SAMPLE = "verify", "verify_sample"


def verifies(choice: str) -> bool:
    """Whether a step of `choice` returns a token after every position (checks drafts)."""
    return choice in (VERIFY, VERIFY_SAMPLE)


def choice_candidates(choice: str) -> int:
    """The k of a "beam{k}" choice; 0 for a step that returns one token a row."""
    return int(choice[4:]) if choice.startswith("beam") else 0


def starts_fresh(write_index: np.ndarray, seq_len: int) -> bool:
    """Whether a step of `seq_len` tokens a row starts every row at position 0 (a first
    prefill): it then attends over its own K/V alone (`StepMetadata.fresh`), and a compiled
    backend keeps such a step in a graph of its own, as the host knows before it runs."""
    return seq_len > 1 and not write_index.any()


def run_step(
    model: Decoder,
    cache: KVCache,
    input_ids: torch.Tensor,  # [B, T]
    write_index: torch.Tensor,  # [B]
    num_new: torch.Tensor,  # [B]
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    uniform: torch.Tensor | None,  # [B], [B, T, 2] in a verify step that samples; None for greedy
    candidates: int = 0,
    fresh: bool = False,
    bias: torch.Tensor | None = None,  # [B, V] float32 added to the logits before the choice (logit_bias.py)
    *,
    layers_once: bool = False,
    either: bool = False,
    every_position: bool = False,
) -> Any:
    """One model step plus token choice: the unit every torch backend runs (and compiles) whole.
    Token ids `[B]`; with `candidates` k > 0 (a beam step), `beam_candidates`' `[B, k]` pair;
    with `every_position` (a verify step), the token after each position, `[B, T]`: greedy, or
    with `uniform` by speculative sampling's rule (`sampling.verify_sample`).
    `layers_once`: see `Decoder.forward`; `either`: the step serves greedy and sampling steps
    (`sampling.pick`, a uniform a row always given). A compiled graph's own copy sets these.
    `bias` is added at every position of a verify step: a row's bias is the same for each (a
    penalized row drafts nothing)."""
    if every_position:
        logits = model(input_ids, write_index, cache, num_new, last_only=False, fresh=fresh, layers_once=layers_once)
        if bias is not None:
            logits = logits.float() + bias[:, None, :]  # [B, T, V]
        if uniform is None:
            return greedy(logits)  # [B, T]
        # the token drafted after position i is the one fed at i + 1, where the row fed one
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        drafts = torch.where(positions + 1 < num_new[:, None], input_ids.roll(-1, dims=1), -1)  # [B, T]
        return verify_sample(logits, drafts, temperature, top_k, top_p, uniform)
    logits = model(input_ids, write_index, cache, num_new, fresh=fresh, layers_once=layers_once)  # [B, V]
    if bias is not None:
        logits = logits.float() + bias
    if candidates:
        return beam_candidates(logits, candidates)
    if either:
        return pick(logits, temperature, top_k, top_p, uniform)
    if uniform is None:
        return greedy(logits)
    return sample(logits, temperature, top_k, top_p, uniform)


def graph_name(seq_len: int, choice: str, fresh: bool) -> str:
    """What a graph is called in logs and in dynamo's code names: decode (greedy and sampling, the
    "pick" choice), prefill64_beam8 (rows from position 0, `starts_fresh`), chunk64 (rows that
    hold tokens already), decode_greedy (a CUDA graph's own choice), ..."""
    width = "decode" if seq_len == 1 else f"{'prefill' if fresh else 'chunk'}{seq_len}"
    return width if choice == "pick" else f"{width}_{choice}"


run_verify_step = functools.partial(run_step, every_position=True)  # a step returning a token after every position
