"""gpt-oss's MXFP4 experts, dequantized as they load: its checkpoints (openai/gpt-oss-20b, -120b)
store each expert matrix as `NAME_blocks` and `NAME_scales` (config.json's `quantization_config`
is `{"quant_method": "mxfp4", ...}`), and staticrt reads them as the float `NAME` transformers
makes of them with `Mxfp4Config(dequantize=True)`. They become bfloat16, which holds every MXFP4
value exactly (a 2-bit mantissa times a power of two), then the model's dtype as any weight does.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

QUANT_METHOD = "mxfp4"
# e2m1: the low three bits index these magnitudes, the high one is the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """`blocks [E, R, G, 16]` uint8 (two 4-bit codes a byte, the low nibble first) and `scales
    [E, R, G]` uint8 (a block's power of two, biased by 127) -> `[E, G * 32, R]` bfloat16, the layout
    of transformers' float gpt-oss experts. Worked example: byte 0x2F with scale 128 is codes 0xF
    (-6.0) then 0x2 (1.0), each times 2^(128 - 127): -12.0, 2.0."""
    *lead, groups, half = blocks.shape
    paired = blocks.dtype == scales.dtype == torch.uint8 and half == 16 and list(scales.shape) == [*lead, groups]
    if not paired:
        raise CheckpointError(
            f"{name}: MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
            f"({scales.dtype}) do not pair as [..., G, 16] and [..., G] uint8; restore the checkpoint's weights"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # [E, R, G, 16, 2]
    values = torch.ldexp(values.reshape(*lead, groups, 32), scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*lead, groups * 32).transpose(-2, -1).contiguous()


def dequantize_state(state: dict[str, torch.Tensor], source: str) -> None:
    """Every `NAME_blocks` / `NAME_scales` pair of `state` (read from `source`) replaced by the float
    `NAME`, in place."""
    for name in [n for n in state if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        if f"{base}_scales" not in state:
            raise CheckpointError(f"{source}: {name} has no {base}_scales beside it; restore the checkpoint's weights")
        state[base] = dequantize_mxfp4(state.pop(name), state.pop(f"{base}_scales"), f"{source}: {base}")
