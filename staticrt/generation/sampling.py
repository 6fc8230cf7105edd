"""Token choice as tensor ops that compile and export: no Python branches on data, no host RNG.

Sampling consumes one uniform number per row drawn on the host from the seeded generator, so
every backend (torch or ONNX Runtime with NumPy) picks the same token for the same seed.
"""

from __future__ import annotations

import torch


def beam_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[B, V]` -> each row's `k` most likely next tokens: log-probabilities `[B, k]` float32
    (descending) and ids `[B, k]` int64. A beam step needs no more of the vocabulary: the best k
    continuations over all of an item's beams are among the best k of each beam."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]` int64."""
    return torch.argmax(logits, dim=-1)


def pick(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """`sample`, with its arguments, in a graph that also serves greedy steps: where every row's
    `top_k` is 1 (greedy rows are written so) the step takes the argmax of the scaled logits and
    skips the sort, which costs ~5 ms a row on a 49k vocabulary. One graph then serves both, so a
    process compiles, and a frozen graph packs its weights, once. The argmax is `sample`'s token
    for such rows: a stable descending sort puts the first maximum first, as argmax returns it;
    at temperature 1 (greedy rows) it is `greedy`'s token."""

    def top_one(logits, temperature, top_k, top_p, uniform):
        return greedy(logits.float() / temperature[:, None])

    return torch.cond((top_k == 1).all(), top_one, sample, (logits, temperature, top_k, top_p, uniform))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Inverse-CDF sampling from temperature-scaled logits `[B, V]` restricted to the top-k
    (`top_k [B]`, 0 = all) and the top-p nucleus (`top_p [B]`). `temperature`, `uniform` are `[B]`.

    Sorting is stable so ties resolve the same way in every implementation.
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V], descending
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = (rank < k) & (mass_before < top_p[:, None])  # the top token is always kept
    cdf = torch.cumsum(probs * keep, dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    choice = (cdf <= target).sum(dim=-1).clamp(max=vocab - 1)  # first index whose cdf passes u
    return order.gather(-1, choice[:, None])[:, 0]
