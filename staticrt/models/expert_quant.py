"""A mixture of experts' stacked weights at int8 or int4 (`--quantize` on a MoE model), held as the
a8 kernels' integer codes (a8_linear.py), an expert's rows after another.

A decode step's experts are chosen by data, k of E a token (models/moe.py), and the kernels the
projections run take one matrix. Two ways keep every shape static:

- with staticrt's kernels ("int8-a8", "int4-a8", the CPU default): `int8_experts` / `int4_experts`
  run each (token, chosen expert) row through that expert's codes in place, reading k of E
  experts' codes, a byte (half a byte) a weight, and nothing else (a8_source.py);
- otherwise (torchao's specs, the ONNX graph, a prefill's dense form) the step gathers the
  chosen experts' codes and dequantizes them in plain tensor ops, which every backend runs (ONNX:
  Gather, Cast, Mul; BitwiseAnd and BitShift to unpack int4). It writes the k experts' float
  weights and reads them again: memory saved, decode slower than float (docs/measurements.md).

Layouts, for a stack `[E, N, K]` (E experts of N outputs over K inputs): int8 `codes [E, N, K]`
with `scales [E, N]` (w = scale * q, scale = max |w| / 127 of the row); int4 `codes [E, N, K / 2]`
with float16 `dm [E, N, K / 32, 2]` (w = d * q + m a block of 32, llama.cpp's Q4_1 numbers, packed
8 weights to 4 bytes as `a8_linear.int4_blocks` says). On the kernels each expert's codes are in
its linear's groups of 16 channels (`int8_groups`, `int4_groups`). Worked, int8: expert 3's row 5
is `codes[3, 5]`; on the kernel, `codes[3, 0, :, 5]`, channel 5 of expert 3's first group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .a8_kernels import STEP
from .a8_linear import int4_blocks, int4_groups, int4_ungrouped, int4_weight, int8_codes, int8_groups
from .channel_groups import channel_ungrouped
from .moe import expert_rows
from .quant_spec import QuantSpec


class QuantizedStack(nn.Module):
    """One stacked expert weight `[E, N, K]` as codes (a8_linear.py's `int8_codes`, `int4_blocks`):
    int8 `codes [E, N, K]` and `scales [E, N]`, one an output row; int4 `codes [E, N, K / 2]` and
    float16 `dm [E, N, K / 32, 2]`, a scale and minimum a block of 32. `kernel`: on staticrt's CPU
    kernels (`int8_experts`, `int4_experts`: quantize "int8-a8", "int4-a8"), which multiply the
    chosen experts' codes in place, each expert's in its linear's groups (`int8_groups`:
    `[E, G, K / 4, 16, 4]`; `int4_groups`); otherwise what a step gathers is dequantized."""

    def __init__(self, weight: torch.Tensor, bits: int, kernel: bool) -> None:
        super().__init__()
        experts, outputs, inputs = weight.shape
        self.bits, self.kernel, self.shape = bits, kernel, (outputs, inputs)
        if bits == 8:
            codes, scales = int8_codes(weight.detach().float().reshape(experts * outputs, inputs))
            codes, scales = codes.view(experts, outputs, inputs), scales.view(experts, outputs)
            self.register_buffer("codes", int8_groups(codes) if kernel else codes)
            self.register_buffer("scales", scales)
        else:
            codes, dm = int4_blocks(weight.detach().float())
            codes, dm = int4_groups(codes, dm) if kernel else (codes, dm)
            self.register_buffer("codes", codes)
            self.register_buffer("dm", dm)

    def gather(self, index: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
        """The experts at `index` (any shape, or one expert) dequantized: `[*index, N, K]` in `dtype`."""
        if self.bits == 8:
            codes = self.codes[index]
            codes = channel_ungrouped(codes, self.shape[0]) if self.kernel else codes
            return codes.to(dtype) * self.scales[index].to(dtype)[..., None]
        codes, dm = self.codes[index], self.dm[index]
        codes, dm = int4_ungrouped(codes, dm, self.shape[0]) if self.kernel else (codes, dm)
        return int4_weight(codes, dm).to(dtype)

    def project(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """`x [T, K]` (a token's input to each of its experts) or `[T, k, K]` (one a chosen expert)
        through the experts `chosen [T, k]`, on the kernels (`int8_experts`, `int4_experts`): `[T, k, N]`."""
        tokens, k = chosen.shape
        rows = expert_rows(x, chosen)  # [T * k, K]
        if self.bits == 8:
            out = torch.ops.staticrt.int8_experts(rows, self.codes, self.scales, chosen.reshape(-1))
        else:
            out = torch.ops.staticrt.int4_experts(rows, self.codes, self.dm, chosen.reshape(-1), self.shape[0])
        return out.view(tokens, k, -1)


def quantize_experts(model: nn.Module, spec: QuantSpec) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Every expert stack of `model` at `spec`'s width, in place (the routers and biases stay float:
    a router's choice is discrete, and llama.cpp keeps its `ffn_gate_inp` unquantized too); returns
    what it replaced, (experts, name, float stack), for `experts_quantized` to put back."""
    from .moe import Experts

    replaced = []
    for experts in [m for m in model.modules() if isinstance(m, Experts)]:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            kernel = bool(spec.activations) and weight.shape[-1] % STEP == 0  # staticrt's kernels run the spec
            delattr(experts, name)
            setattr(experts, name, QuantizedStack(weight, spec.bits, kernel))
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
    """Refuse, before any weight changes, int4 experts whose input sizes are not whole steps of 64
    (the int4 layout packs 64 weights to 32 bytes)."""
    sizes = sorted({config.hidden_size, config.moe_intermediate_size})
    if config.num_experts and spec.bits == 4 and any(size % STEP for size in sizes):
        raise ConfigError(
            f"quantize {spec.name!r}: int4 experts are packed {STEP} inputs at a time, and this {config.family} "
            f"model's experts read {sizes}; use --quantize int8"
        )
