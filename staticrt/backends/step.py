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
from ..generation.logprobs import LogprobSink, StepLogprobs
from ..generation.sampling import beam_candidates, greedy, pick, sample, token_logprobs, verify_sample
from ..models.decoder import Decoder

StepFn = Callable[..., Any]


def step_choice(do_sample: bool, candidates: int = 0, verify: bool = False, logprobs: bool = False) -> str:
    """How a step picks what it returns, and what its graph is called: "greedy", "sample",
    "beam{k}" (each row's k best continuations, for beam search), "verify" (the greedy token
    after every position, checking drafted tokens: `verify_step`) or "verify_sample" (speculative
    sampling's token after every position). A compiled backend may run greedy and sampling steps
    as one choice, "pick" (`CompiledBackend.graph_choice`). `logprobs`: a greedy or sampling step
    that also returns log-probabilities (`sampling.token_logprobs`), "greedy_logprobs", ..."""
    if verify:
        return VERIFY_SAMPLE if do_sample else VERIFY
    if candidates:
        return f"beam{candidates}"
    return ("sample" if do_sample else "greedy") + (LOGPROBS if logprobs else "")


VERIFY, VERIFY_SAMPLE, LOGPROBS = "verify", "verify_sample", "_logprobs"


def base_choice(choice: str) -> str:
    """How a step of `choice` picks its tokens: "greedy_logprobs" picks as "greedy"."""
    return choice.removesuffix(LOGPROBS)


def gives_logprobs(choice: str) -> bool:
    """Whether a step of `choice` also returns log-probabilities (`step_choice`)."""
    return choice.endswith(LOGPROBS)


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
    logprobs: bool = False,
) -> Any:
    """One model step plus token choice: the unit every torch backend runs (and compiles) whole.
    Token ids `[B]`; with `candidates` k > 0 (a beam step), `beam_candidates`' `[B, k]` pair;
    with `every_position` (a verify step), the token after each position, `[B, T]`: greedy, or
    with `uniform` by speculative sampling's rule (`sampling.verify_sample`).
    `layers_once`: see `Decoder.forward`; `either`: the step serves greedy and sampling steps
    (`sampling.pick`, a uniform a row always given); `logprobs`: the ids, then the log-probabilities
    of the logits before the bias (`sampling.token_logprobs`: `[B]`, `[B, K]`, `[B, K]`). A compiled
    graph's own copy sets these. `bias` is added at every position of a verify step: a row's bias
    is the same for each (a penalized row drafts nothing)."""
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
    raw = model(input_ids, write_index, cache, num_new, fresh=fresh, layers_once=layers_once)  # [B, V]
    logits = raw if bias is None else raw.float() + bias
    if candidates:
        return beam_candidates(logits, candidates)
    if either:
        chosen = pick(logits, temperature, top_k, top_p, uniform)
    elif uniform is None:
        chosen = greedy(logits)
    else:
        chosen = sample(logits, temperature, top_k, top_p, uniform)
    return (chosen, *token_logprobs(raw, chosen)) if logprobs else chosen


def graph_name(seq_len: int, choice: str, fresh: bool) -> str:
    """What a graph is called in logs and in dynamo's code names: decode (greedy and sampling, the
    "pick" choice), prefill64_beam8 (rows from position 0, `starts_fresh`), chunk64 (rows that
    hold tokens already), decode_greedy (a CUDA graph's own choice), ..."""
    width = "decode" if seq_len == 1 else f"{'prefill' if fresh else 'chunk'}{seq_len}"
    return width if choice == "pick" else f"{width}_{choice.removeprefix('pick_')}"


run_verify_step = functools.partial(run_step, every_position=True)  # a step returning a token after every position
run_logprobs_step = functools.partial(run_step, logprobs=True)  # a step returning its log-probabilities too


def host_ids(result: Any, sink: LogprobSink | None) -> np.ndarray:
    """A greedy or sampling step's ids `[B]` on the host from its `result` on the device; where
    it was asked for log-probabilities (`sink`), `result` holds them after the ids and they go there."""
    if sink is None:
        return result.cpu().numpy()
    put_logprobs(sink, result[1:])
    return result[0].cpu().numpy()


def put_logprobs(sink: LogprobSink, tensors: Any) -> None:
    """A step's log-probabilities (`run_step`'s outputs after the ids) on the host, into `sink`."""
    sink.put(StepLogprobs(*(t.cpu().numpy() for t in tensors)))
