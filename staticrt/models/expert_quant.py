"""A mixture of experts' stacked weights at int8 or int4 (`--quantize` on a MoE model): each stack
held as integer codes, dequantized after the gather, in the graph's own ops.

Why not the kernels the projections run (staticrt's a8 kernels, torchao's): each takes one matrix
`[N, K]`, where a decode step's experts are chosen by data, k of E a token (models/moe.py gathers
them by index). Gathering codes and dequantizing what was gathered keeps every shape static, reads
k of E experts' codes (1 byte a weight at int8, half a byte at int4, and their scales) where the
float stack reads 4, and is plain tensor arithmetic that every backend runs: compiled, torch.export
and AOTInductor, and the ONNX graph (Gather, Cast, Mul; BitwiseAnd and BitShift to unpack int4).
The float weights it makes are as wide as the step's k experts; a prefill's dense form dequantizes
each expert once a step. A kernel that multiplies the chosen experts' codes in place would read
only the codes (the next step for speed, not for memory).

Layouts, for a stack `[E, N, K]` (E experts of N outputs over K inputs):
- int8: `codes [E, N, K]` int8 and `scale [E, N]` float32, symmetric: w = scale * q with
  scale = max |w| / 127 over the row (the a8 kernels' int8 weights, one scale an output channel);
- int4: `codes [E, N, K / 2]` uint8, byte j of a row holding q[2j] (low nibble) and q[2j + 1]
  (high), and `scale`, `minimum [E, N, K / G]` float32: w = scale * q + minimum, q in 0..15, for
  each group of G inputs (llama.cpp's Q4_1 numbers; G 32 unless the spec names another group).
Worked, int4, G 32: input 37 of a row is group 1 (37 // 32), byte 18 (37 // 2), high nibble (37 odd).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .quant_spec import QuantSpec


class QuantizedStack(nn.Module):
    """One stacked expert weight `[E, N, K]` as codes (the module docstring's layouts)."""

    def __init__(self, weight: torch.Tensor, bits: int, group: int) -> None:
        super().__init__()
        self.bits, self.group, self.inputs = bits, group, weight.shape[-1]
        w = weight.detach().float()
        if bits == 8:
            scale = w.abs().amax(dim=-1) / 127  # [E, N]
            codes = torch.round(w / torch.where(scale > 0, scale, 1)[..., None]).clamp(-127, 127).to(torch.int8)
            self.codes, self.scale = nn.Parameter(codes, False), nn.Parameter(scale, False)
            return
        grouped = w.view(*w.shape[:-1], -1, group)  # [E, N, K / G, G]
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scale = (high - low) / 15
        q = torch.round((grouped - low[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).clamp(0, 15)
        q = q.to(torch.uint8).view(*w.shape[:-1], -1, 2)  # pairs of neighbouring inputs
        self.codes = nn.Parameter(q[..., 0] | (q[..., 1] << 4), False)  # [E, N, K / 2]
        self.scale, self.minimum = nn.Parameter(scale, False), nn.Parameter(low, False)

    def gather(self, index: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
        """The experts at `index` (any shape, or one expert) dequantized: `[*index, N, K]` in `dtype`."""
        codes = self.codes[index]
        if self.bits == 8:
            return codes.to(dtype) * self.scale[index].to(dtype)[..., None]
        q = torch.stack([codes & 15, codes >> 4], dim=-1)  # [..., N, K / 2, 2]: low nibble first
        q = q.view(*codes.shape[:-1], -1, self.group).to(dtype)  # [..., N, K / G, G]
        w = q * self.scale[index].to(dtype)[..., None] + self.minimum[index].to(dtype)[..., None]
        return w.view(*codes.shape[:-1], self.inputs)


def quantize_experts(model: nn.Module, spec: QuantSpec) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Every expert stack of `model` at `spec`'s width, in place (the routers and biases stay float:
    a router's choice is discrete, and llama.cpp keeps its `ffn_gate_inp` unquantized too); returns
    what it replaced, (experts, name, float stack), for `experts_quantized` to put back."""
    from .moe import Experts

    group, replaced = spec.group_size or 32, []
    for experts in [m for m in model.modules() if isinstance(m, Experts)]:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            delattr(experts, name)
            setattr(experts, name, QuantizedStack(weight, spec.bits, group))
            replaced.append((experts, name, weight))
    return replaced


@contextmanager
def experts_quantized(model: nn.Module, spec: QuantSpec | None) -> Iterator[None]:
    """`model`'s expert stacks at `spec` for the block, the float ones put back after: the ONNX
    exporter traces the float model and quantizes the graph's matrices itself (onnx_quantize.py),
    which cannot reach stacks a graph gathers from. No-op for `spec` None or a model without experts."""
    replaced = [] if spec is None else quantize_experts(model, spec)
    try:
        yield
    finally:
        for experts, name, weight in replaced:
            delattr(experts, name)
            setattr(experts, name, weight)


def check_experts(config: ModelConfig, spec: QuantSpec) -> None:
    """Refuse, before any weight changes, an int4 group that does not divide the experts' input sizes."""
    if not config.num_experts or spec.bits == 8:
        return
    sizes = sorted({config.hidden_size, config.moe_intermediate_size})
    group = spec.group_size or 32
    if any(size % group for size in sizes):
        raise ConfigError(
            f"quantize {spec.name!r}: int4 experts take groups of {group} inputs, and this {config.family} model's "
            f"experts read {sizes}; use --quantize int8"
        )
