"""Perplexity of a model over a text: the quality measure a quantized model is checked by against
its float original (the same text, the same windows, only the weights differ)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..caches import CacheSpec, build_cache
from ..errors import GenerationError
from ..models.decoder import Decoder


def perplexity(model: Decoder, token_ids: Sequence[int], chunk: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token after the first, given all before it.

    The text is fed `chunk` tokens a forward through one Static cache the length of the text, so
    every token sees its whole past (no sliding context windows), as one long prompt would.
    """
    ids = torch.tensor([list(token_ids)], dtype=torch.int64)  # [1, N]
    n = ids.shape[1]
    if n < 2 or n > model.config.max_position_embeddings:
        raise GenerationError(
            f"perplexity needs 2 to {model.config.max_position_embeddings} tokens (the model's context); got {n}"
        )
    param = model.embed_tokens.weight
    cache = build_cache(model.config, CacheSpec("static", 1, n), param.dtype, param.device)
    total = 0.0
    with torch.no_grad():
        for start in range(0, n - 1, chunk):
            piece = ids[:, start : min(start + chunk, n - 1)].to(param.device)  # [1, T]
            logits = model(piece, torch.tensor([start], device=param.device), cache, last_only=False)[0]  # [T, V]
            targets = ids[0, start + 1 : start + 1 + piece.shape[1]].to(param.device)  # [T]
            total += F.cross_entropy(logits.double(), targets, reduction="sum").item()
    return math.exp(total / (n - 1))
