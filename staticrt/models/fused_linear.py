"""Projections of one input held as one matrix (q/k/v, gate/up), named apart as checkpoints name them."""

from __future__ import annotations

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """Projections of one input held as one matrix, so that a decode step reads it with one
    matrix-vector product instead of several: on CPU each BLAS call has a fixed cost, large next to
    the small matrices of a small model (docs/measurements.md), and on GPU each is a kernel launch. `parts` maps each
    part's checkpoint name to its output size, in order; `forward` returns the parts' outputs.

    Checkpoints name the parts apart (`q_proj`, `k_proj`, ...): the owning module translates with
    `name_fused_parts_apart`, so `state_dict()` and `load_state_dict` speak the checkpoint's names.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [..., in] -> one [..., size] a part
        return super().forward(x).split(list(self.parts.values()), dim=-1)


def _fused_children(module: nn.Module, prefix: str) -> dict[str, FusedLinear]:
    """`prefix + name` -> each FusedLinear child of `module`."""
    return {f"{prefix}{name}": child for name, child in module.named_children() if isinstance(child, FusedLinear)}


def _split_fused(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: each fused weight and bias become their parts (views), in place and
    in checkpoint order (each part's weight, then its bias, where the fused weight stood)."""
    fused = _fused_children(module, prefix)
    items = dict(state_dict)
    state_dict.clear()
    for key, value in items.items():
        owner, _, field = key.rpartition(".")
        child = fused.get(owner)
        if child is None:
            state_dict[key] = value
        elif field == "weight":
            sizes = list(child.parts.values())
            biases = items[f"{owner}.bias"].split(sizes) if child.bias is not None else [None] * len(sizes)
            for part, weight, bias in zip(child.parts, value.split(sizes), biases):
                state_dict[f"{prefix}{part}.weight"] = weight
                if bias is not None:
                    state_dict[f"{prefix}{part}.bias"] = bias


def _join_fused(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: object) -> None:
    """load_state_dict pre-hook: parts given under their checkpoint names are concatenated into
    the fused tensor; a checkpoint missing a part is left for the strict check to name."""
    for owner, child in _fused_children(module, prefix).items():
        for field in ("weight", "bias") if child.bias is not None else ("weight",):
            names = [f"{prefix}{part}.{field}" for part in child.parts]
            if all(name in state_dict for name in names):
                state_dict[f"{owner}.{field}"] = torch.cat([state_dict.pop(name) for name in names])


def name_fused_parts_apart(module: nn.Module) -> None:
    """Make `module`'s state_dict and load_state_dict use its FusedLinear children's part names."""
    module.register_state_dict_post_hook(_split_fused)
    module.register_load_state_dict_pre_hook(_join_fused)
