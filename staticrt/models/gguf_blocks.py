"""GGUF's block-quantized projections, kept as their codes in a checkpoint folder.

llama.cpp's Q4_0, Q4_1 and Q8_0 store a weight row in blocks of 32 inputs, each with a float16
scale `d` (and for Q4_1 a float16 minimum `m`): Q4_0 is `d * (q - 8)`, Q4_1 `d * q + m` with 4-bit
`q`, Q8_0 `d * q` with int8 `q`. A 4-bit block is exactly one group of torch's int4 kernel (an
asymmetric scale and zero a group of 32 inputs), so Q4_0/Q4_1 load as `int4-g32` with every
code the GGUF holds. Q8_0 has a scale a block, torch's int8 kernel one a channel: its weights
load as `int8` quantized per channel from their exact values (torchao's per-group int8 runs at a
third of the per-channel kernel's speed, docs/measurements.md).

In the folder `staticrt convert --keep-quantized` writes, each projection `P.weight` is stored as
  P.weight.codes   uint8 [N, K/2] (4-bit, two a byte, input 2j in the low nibble) or int8 [N, K]
  P.weight.scales  float16 [N, K/32]
  P.weight.mins    float16 [N, K/32] (4-bit only; Q4_0's is -8 d, exact)
(the embedding and an untied head likewise where the GGUF quantized them, loaded as float: the
embedding is only gathered from, and the head is quantized to int8 as for any model), and
config.json's `quantization_config` is `{"quant_method": "staticrt_gguf", "weights": SPEC}`.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
QUANT_METHOD = "staticrt_gguf"
SPEC_OF = {"Q4_0": "int4-g32", "Q4_1": "int4-g32", "Q8_0": "int8-wo"}  # GGUF type -> what it loads as
FIELDS = ("codes", "scales", "mins")
# llama.cpp's projection names -> transformers' (the same in the Llama, Mistral, Qwen2, Gemma2 files)
PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# The GGUF's other matrices that are kept where quantized; they load as float (in the compute dtype).
OTHERS = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}

Blocks = dict[str, torch.Tensor]  # "codes", "scales" and (4-bit) "mins" of one weight


def read_blocks(data: np.ndarray, qtype: str) -> Blocks:
    """GGUF tensor bytes `data` uint8 [N, K/32 * block bytes] of type `qtype` -> its `Blocks`."""
    rows = data.shape[0]
    four_bit = qtype != "Q8_0"
    header = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype]
    blocks = data.reshape(rows, -1, header + (BLOCK // 2 if four_bit else BLOCK))  # [N, K/32, bytes]
    scales = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    payload = blocks[:, :, header:]
    if not four_bit:
        codes = payload.copy().view(np.int8).reshape(rows, -1)  # [N, K]
        return {"codes": torch.from_numpy(codes), "scales": torch.from_numpy(scales)}
    # A block's 16 bytes hold inputs j (low nibble) and j + 16 (high nibble).
    codes = np.concatenate([payload & 0x0F, payload >> 4], axis=2).reshape(rows, -1)  # [N, K] in 0..15
    if qtype == "Q4_1":
        mins = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    else:  # Q4_0's d * (q - 8) is d * q + (-8 d), exact in float16
        mins = (scales.astype(np.float32) * -8).astype(np.float16)
    return {
        "codes": pack_nibbles(torch.from_numpy(codes)),
        "scales": torch.from_numpy(scales),
        "mins": torch.from_numpy(mins),
    }


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in 0..15 -> uint8 [N, K/2], input 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] in 0..15 (`pack_nibbles` undone)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def codes_of(blocks: Blocks) -> torch.Tensor:
    """The weight's codes, one an input: uint8 0..15 or int8, [N, K]."""
    codes = blocks["codes"]
    return unpack_nibbles(codes) if "mins" in blocks else codes


def dequantize(blocks: Blocks) -> torch.Tensor:
    """float32 [N, K] as llama.cpp computes it: `d * q (+ m)` a block, in float32."""
    codes = codes_of(blocks).float()
    rows, inputs = codes.shape
    scales = blocks["scales"].float().repeat_interleave(BLOCK, dim=1)
    weight = codes * scales
    if "mins" in blocks:
        weight = weight + blocks["mins"].float().repeat_interleave(BLOCK, dim=1)
    assert weight.shape == (rows, inputs)
    return weight


def take_rows(blocks: Blocks, rows: torch.Tensor) -> Blocks:
    """`blocks` with its output rows reordered: codes, scales and mins alike."""
    return {field: tensor[rows] for field, tensor in blocks.items()}


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Blocks]]:
    """A kept-quantized folder's tensors -> (the float ones, the blocks of each `P.weight`)."""
    plain: dict[str, torch.Tensor] = {}
    kept: dict[str, Blocks] = {}
    for key, tensor in state.items():
        weight, _, field = key.rpartition(".")
        if field in FIELDS and weight.endswith(".weight"):
            kept.setdefault(weight, {})[field] = tensor
        else:
            plain[key] = tensor
    return plain, kept
