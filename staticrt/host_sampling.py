"""Token choice on the host with NumPy, for runners whose graph ends at the logits (ONNX Runtime).

The same arithmetic as sampling.py, from the same uniform per row, so a seed picks the same tokens
on every backend: a stable descending sort (ties keep vocabulary order), softmax, the top-k and
top-p cut, and inverse-CDF sampling. Imports no torch.
"""

from __future__ import annotations

import numpy as np


def greedy(logits: np.ndarray) -> np.ndarray:
    """logits `[B, V]` -> token ids `[B]` int64 (the first maximum, as torch.argmax)."""
    return np.argmax(logits, axis=-1).astype(np.int64)


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, uniform: np.ndarray) -> np.ndarray:
    """logits `[B, V]`, `uniform [B]` -> token ids `[B]` int64; `top_k` 0 keeps every token."""
    vocab = logits.shape[-1]
    scaled = logits.astype(np.float32) / np.float32(temperature)
    order = np.argsort(-scaled, axis=-1, kind="stable")  # [B, V] descending, ties in index order
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)
    exp = np.exp(sorted_logits - sorted_logits[:, :1])
    probs = exp / exp.sum(axis=-1, keepdims=True)
    rank = np.arange(vocab)[None, :]
    keep = (rank < (top_k if top_k > 0 else vocab)) & (np.cumsum(probs, axis=-1) - probs < np.float32(top_p))
    cdf = np.cumsum(probs * keep, axis=-1)
    target = uniform.astype(np.float32)[:, None] * cdf[:, -1:]
    choice = np.minimum((cdf <= target).sum(axis=-1), vocab - 1)
    return np.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(np.int64)
