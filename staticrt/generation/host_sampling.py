"""Token choice on the host with NumPy, for runners whose graph ends at the logits (ONNX Runtime).

The same arithmetic as sampling.py, from the same uniform per row, so a seed picks the same tokens
on every backend: a stable descending sort (ties keep vocabulary order), softmax, the top-k and
top-p cut, and inverse-CDF sampling. Imports no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .logprobs import host_logprobs


def choose(logits: np.ndarray, sampling: Any, uniforms: np.ndarray | None) -> np.ndarray:
    """A step's tokens `[B]` from its logits `[B, V]`: greedy without uniforms, else sampled with
    `sampling`'s temperature, top_k and top_p (one value, or one a row), after its logit bias; where
    the step was asked for log-probabilities, those of `logits` go to its sink (logprobs.py)."""
    scored = biased(logits, sampling)
    if uniforms is None:
        chosen = greedy(scored)
    else:
        chosen = sample(scored, sampling.temperature, sampling.top_k, sampling.top_p, uniforms)
    if sampling.logprobs_to is not None:
        sampling.logprobs_to.put(host_logprobs(logits, chosen))
    return chosen


def biased(logits: np.ndarray, sampling: Any) -> np.ndarray:
    """`logits [B, V]` or `[B, T, V]` plus the step's logit bias `[B, V]` (logit_bias.py) at every
    position, as `run_step` adds it in the torch graphs; as they are without one."""
    bias = getattr(sampling, "bias", None)
    if bias is None:
        return logits
    return logits.astype(np.float32) + (bias if logits.ndim == 2 else bias[:, None, :])


def greedy(logits: np.ndarray) -> np.ndarray:
    """logits `[B, V]` -> token ids `[B]` int64 (the first maximum, as torch.argmax)."""
    return np.argmax(logits, axis=-1).astype(np.int64)


def sample(logits: np.ndarray, temperature: Any, top_k: Any, top_p: Any, uniform: np.ndarray) -> np.ndarray:
    """logits `[B, V]`, `uniform [B]` -> token ids `[B]` int64. `temperature`, `top_k` (0 keeps every
    token) and `top_p` are one number for every row or one a row.

    A row with top_k 1 (a greedy or idle row of a server's step) keeps only the first of the stable
    order, which is the argmax of its scaled logits: it is not sorted. Sorting the vocabulary is the
    cost of sampling (SmolLM2's 49,152 ids: milliseconds a row on a CPU)."""
    batch = logits.shape[0]
    temperature = np.broadcast_to(np.asarray(temperature, dtype=np.float32), (batch,))
    top_k = np.broadcast_to(np.asarray(top_k, dtype=np.int64), (batch,))
    top_p = np.broadcast_to(np.asarray(top_p, dtype=np.float32), (batch,))
    scaled = logits.astype(np.float32) / temperature[:, None]
    chosen = greedy(scaled)
    rows = np.flatnonzero(top_k != 1)
    if rows.size:
        chosen[rows] = _sorted_pick(scaled[rows], top_k[rows], top_p[rows], uniform[rows])
    return chosen


def _sorted_pick(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Inverse-CDF pick over the stable descending order of `scaled [R, V]`, cut to top-k and top-p."""
    return _draw(*_nucleus(scaled, top_k, top_p), uniform)


def _nucleus(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of `scaled [N, V]` in stable descending order and their probabilities there,
    zero outside the top-k and the nucleus (not renormalised), both `[N, V]`."""
    vocab = scaled.shape[1]
    order = np.argsort(-scaled, axis=-1, kind="stable")  # [N, V] descending, ties in index order
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)
    exp = np.exp(sorted_logits - sorted_logits[:, :1])
    probs = exp / exp.sum(axis=-1, keepdims=True)
    rank = np.arange(vocab)[None, :]
    keep = (rank < np.where(top_k > 0, top_k, vocab)[:, None]) & (np.cumsum(probs, axis=-1) - probs < top_p[:, None])
    return order, probs * keep


def _draw(order: np.ndarray, weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """The token whose slice of the cumulative `weights [N, V]` (in `order`'s ids) holds `uniform [N]`
    times their sum: ids `[N]` int64."""
    cdf = np.cumsum(weights, axis=-1)
    target = uniform.astype(np.float32)[:, None] * cdf[:, -1:]
    choice = np.minimum((cdf <= target).sum(axis=-1), weights.shape[1] - 1)
    return np.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(np.int64)


def verify(logits: np.ndarray, input_ids: np.ndarray, num_new: np.ndarray, sampling: Any, uniforms: Any) -> np.ndarray:
    """A verify step's tokens `[B, T]` from its logits `[B, T, V]`: the token after each position,
    greedy without uniforms, else by speculative sampling's rule (`sampling.verify_sample`, whose
    docstring gives it) with `uniforms [B, T, 2]`. Row b fed `input_ids[b, :num_new[b]]`: its next
    token, then its draft, so the token drafted after position t is the one fed at t + 1."""
    logits = biased(logits, sampling)
    if uniforms is None:
        return greedy(logits)
    batch, width, vocab = logits.shape
    per_position = lambda value, dtype: np.repeat(np.broadcast_to(np.asarray(value, dtype), (batch,)), width)  # noqa: E731
    scaled = logits.reshape(-1, vocab).astype(np.float32) / per_position(sampling.temperature, np.float32)[:, None]
    order, weights = _nucleus(scaled, per_position(sampling.top_k, np.int64), per_position(sampling.top_p, np.float32))
    fed_after = np.arange(width)[None, :] + 1 < np.asarray(num_new)[:, None]
    drafted = np.where(fed_after, np.roll(input_ids, -1, axis=1), -1).reshape(-1, 1)  # [B*T, 1], -1: none
    is_draft = order == drafted
    p_draft = (weights * is_draft).sum(axis=-1) / weights.sum(axis=-1)
    flat = np.asarray(uniforms, dtype=np.float32).reshape(-1, 2)
    keep = (drafted[:, 0] >= 0) & (flat[:, 0] < p_draft)
    return np.where(keep, drafted[:, 0], _draw(order, weights * ~is_draft, flat[:, 1])).reshape(batch, width)
