"""What every KV cache shares: fixed per-layer buffers, in-place writes, lengths in tensors.

Caches know nothing of backends. A cache is an `nn.Module` whose K/V tensors are registered
buffers allocated once and tagged with `mark_static_address`, so compiled graphs and CUDA graphs
keep their addresses; nothing here ever reassigns them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig


class CacheError(ValueError):
    """A cache request that cannot be met, naming the input, the limit and the way out."""


def default_max_cache_len(config: ModelConfig) -> int:
    """The cache length used when none is asked for: the model's context, capped so a default
    Static cache (which attends over every slot) stays small."""
    return min(config.max_position_embeddings, 1024)


@dataclass(frozen=True)
class CacheSpec:
    """The shape of a cache a Generator asks for; `kind` is one of `CACHE_KINDS`."""

    kind: str
    max_batch_size: int
    max_cache_len: int

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise CacheError(f"max_batch_size is {self.max_batch_size}; it must be at least 1")
        if self.max_cache_len < 1:
            raise CacheError(f"max_cache_len is {self.max_cache_len}; it must be at least 1")


class KVCache(nn.Module, ABC):
    """Per-layer K/V buffers `[B, H_kv, L_layer, D]` plus per-row lengths `[B]`; each kind says
    which position a slot holds (`attention_mask`) and where a write lands (`update`)."""

    kind = "base"

    def __init__(
        self,
        config: ModelConfig,
        spec: CacheSpec,
        layer_lengths: list[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        self.layer_lengths = tuple(layer_lengths)
        shape = (spec.max_batch_size, config.num_kv_heads)
        for i, length in enumerate(layer_lengths):
            for name in (f"key_{i}", f"value_{i}"):
                buf = torch.zeros(*shape, length, config.head_dim, dtype=dtype, device=device)
                self.register_buffer(name, buf)
                torch._dynamo.mark_static_address(buf)
        seq_lens = torch.zeros(spec.max_batch_size, dtype=torch.int64, device=device)
        self.register_buffer("seq_lens", seq_lens)
        torch._dynamo.mark_static_address(seq_lens)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"key_{layer_idx}"), getattr(self, f"value_{layer_idx}")

    def begin_step(self, write_index: torch.Tensor, num_new: torch.Tensor) -> None:
        """Record each row's length after this step (`write_index + num_new`, both `[B]`)."""
        self.seq_lens.copy_(write_index + num_new)

    @abstractmethod
    def attention_mask(self, layer_kind: str, positions: torch.Tensor) -> torch.Tensor:
        """Bool `[B, 1, T, L]`: which slots a query at `positions [B, T]` may attend to, computed
        in the graph from positions so no Python int specialises it."""

    @abstractmethod
    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, write_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key`/`value [B, H_kv, T, D]` in place and return the layer's whole buffers."""

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens held per row, `[B]` int64 (a tensor: the graph never specialises on it)."""
        return self.seq_lens

    def get_max_cache_shape(self) -> int:
        return self.spec.max_cache_len

    def state_buffers(self) -> list[torch.Tensor]:
        """The K/V buffers of every layer and the lengths; constant tables are not state."""
        kv = [buf for i in range(len(self.layer_lengths)) for buf in self.layer_buffers(i)]
        return kv + [self.seq_lens]

    def reset(self) -> None:
        """Zero the state in place; addresses stay valid for captured graphs."""
        for buf in self.state_buffers():
            buf.zero_()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Permute rows in place (beam search): row b takes the contents of row `beam_idx[b]`."""
        for buf in self.state_buffers():
            buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def device_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.state_buffers())
