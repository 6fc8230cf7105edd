"""Token choice as tensor ops that compile and export: no Python branches on data, no host RNG.

Sampling consumes one uniform number per row drawn on the host from the seeded generator, so
every backend (torch or ONNX Runtime with NumPy) picks the same token for the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logprobs import TOP_LOGPROBS

# The longest scan a CUDA graph holds. Inductor splits a scan over more elements into blocks
# when it has few rows (a SplitScan: fewer than 64 rows an SM, 8448 on an H100), and torch
# 2.11's Triton code generation fails on that kernel for the sampling step of a server's 8 rows
# over a 32000-token vocabulary ("list indices must be integers or slices, not NoneType" in
# `TritonSymbols.get_block_shape`). A scan of 32 or fewer is never split. On the CPU inductor
# scans a row in one loop.
SCAN_BLOCK = 32
SHORT_SCAN_DEVICES = frozenset({"cuda"})


def beam_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[B, V]` -> each row's `k` most likely next tokens: log-probabilities `[B, k]` float32
    (descending) and ids `[B, k]` int64. A beam step needs no more of the vocabulary: the best k
    continuations over all of an item's beams are among the best k of each beam."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probabilities a step returns where a row asked (logprobs.py): of the model's logits
    `[B, V]`, the chosen ids' `[B]` and the `TOP_LOGPROBS` most likely `[B, K]` (descending) with
    their ids `[B, K]`, float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, top_ids = logp.topk(min(TOP_LOGPROBS, logp.shape[-1]), dim=-1)
    return logp.gather(-1, chosen[:, None])[:, 0], top, top_ids


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
    order, weights = _nucleus(logits, temperature, top_k, top_p)
    return _draw(order, weights, uniform)


def _nucleus(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s distribution: the token ids in descending order of their scaled logits `[N, V]`
    and their probabilities there, zero outside the top-k and the nucleus `[N, V]` (not renormalised)."""
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)  # [N, V], descending
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    mass_before = running_sum(probs) - probs
    keep = (rank < k) & (mass_before < top_p[:, None])  # the top token is always kept
    return order, probs * keep


def _draw(order: torch.Tensor, weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose slice of the cumulative `weights [N, V]` (in `order`'s token ids) holds
    `uniform [N]` times their sum: ids `[N]`."""
    cdf = running_sum(weights)
    target = uniform[:, None] * cdf[:, -1:]
    choice = (cdf <= target).sum(dim=-1).clamp(max=weights.shape[-1] - 1)  # first index whose cdf passes u
    return order.gather(-1, choice[:, None])[:, 0]


def verify_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Speculative sampling's acceptance rule for drafts that are single tokens (prompt lookup:
    the draft distribution q is one-hot on the drafted token x), after every position at once.

    logits `[B, T, V]`; `drafts [B, T]`: the token drafted after each position, -1 where none (the
    last position, a row's padding); `uniform [B, T, 2]`. With p the position's `sample`
    distribution: x is kept with probability min(1, p(x) / q(x)) = p(x) (where `uniform[..., 0]` <
    p(x)); otherwise the token is drawn, with `uniform[..., 1]`, from the residual max(0, p - q)
    renormalised, that is p without x. A position without a draft draws from p. So each emitted
    token follows p (Leviathan et al. 2023, Chen et al. 2023), and a rejected position's token is
    never its draft: the host finds the first rejection as the first mismatch (`accepted`). A
    greedy row (`top_k` 1) keeps x exactly when it is the argmax, and draws the argmax otherwise.
    Returns ids `[B, T]` int64."""
    batch, width, vocab = logits.shape
    per_position = lambda value: value[:, None].expand(batch, width).reshape(-1)  # noqa: E731 - [B] -> [B*T]
    order, weights = _nucleus(
        logits.reshape(-1, vocab), per_position(temperature), per_position(top_k), per_position(top_p)
    )
    drafted = drafts.reshape(-1, 1)  # [B*T, 1]
    is_draft = order == drafted  # [B*T, V]: where the draft sits in the order; nowhere for -1
    p_draft = (weights * is_draft).sum(dim=-1) / weights.sum(dim=-1)
    flat_uniform = uniform.reshape(-1, 2)
    keep = (drafted[:, 0] >= 0) & (flat_uniform[:, 0] < p_draft)
    redrawn = _draw(order, weights * ~is_draft, flat_uniform[:, 1])
    return torch.where(keep, drafted[:, 0], redrawn).reshape(batch, width)


def running_sum(values: torch.Tensor) -> torch.Tensor:
    """The cumulative sum of `values [N, V]` over V. On the CPU one scan (sequential, as NumPy's
    on the host, so every CPU backend draws the same token); on CUDA, where a scan is parallel
    and so rounds differently anyway, scans of at most `SCAN_BLOCK`, which inductor compiles."""
    if values.device.type not in SHORT_SCAN_DEVICES:
        return torch.cumsum(values, dim=-1)
    return blocked_running_sum(values)


def blocked_running_sum(values: torch.Tensor) -> torch.Tensor:
    """`torch.cumsum(values, -1)` for `[N, V]` as scans of at most `SCAN_BLOCK` elements: the
    running sum within each block, plus the sum of the blocks before it, found the same way.
    With blocks of 2: [1, 2, 3, 4, 5] -> blocks [1, 2] [3, 4] [5, 0], sums within [1, 3] [3, 7]
    [5, 5], block totals [3, 7, 5], totals before each block [0, 3, 10] -> [1, 3, 6, 10, 15]."""
    rows, width = values.shape
    if width <= SCAN_BLOCK:
        return torch.cumsum(values, dim=-1)
    blocks = -(-width // SCAN_BLOCK)
    padded = F.pad(values, (0, blocks * SCAN_BLOCK - width)).view(rows, blocks, SCAN_BLOCK)
    within = torch.cumsum(padded, dim=-1)  # [N, blocks, SCAN_BLOCK]
    before = F.pad(blocked_running_sum(within[:, :, -1])[:, :-1], (1, 0))  # [N, blocks]
    return (within + before[:, :, None]).view(rows, blocks * SCAN_BLOCK)[:, :width]
