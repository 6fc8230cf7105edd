"""gpt-oss's MXFP4 checkpoints (issue 64): experts stored as `*_blocks` and `*_scales`, as
openai/gpt-oss-20b ships them, load dequantized, as transformers loads them with
`Mxfp4Config(dequantize=True)`: the same values bit for bit, and the same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import build_hf_model

import staticrt
from staticrt.errors import CheckpointError
from staticrt.loading.mxfp4 import FP4_VALUES, dequantize_mxfp4

PROMPTS = [[5, 17, 99, 3, 200, 45, 8], list(range(10, 50))]
NEW_TOKENS = 30


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' float expert `[E, K, R]` (x @ W) -> MXFP4 `blocks [E, R, K/32, 16]` and
    `scales [E, R, K/32]`: each block of 32 inputs scaled by the power of two that brings its
    largest value within 6, each value the nearest of the 16 codes, two a byte, low nibble first."""
    rows = weight.float().transpose(1, 2)
    experts, width, inputs = rows.shape
    blocks = rows.reshape(experts, width, inputs // 32, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-12) / 6.0))
    scaled = blocks / torch.pow(2.0, exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | codes[..., 1::2] << 4).contiguous(), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny gpt-oss saved by transformers, its experts then rewritten as MXFP4 with the
    quantization_config gpt-oss-20b's config.json has."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    build_hf_model("gpt_oss").save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[f"{name}_blocks"], state[f"{name}_scales"] = quantize_mxfp4(state.pop(name))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    kept = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": kept}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dequantized_values_are_transformers_bit_for_bit():
    """Every code and every exponent a checkpoint can hold (2^-127 to 2^128, where bfloat16 runs out)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales = torch.arange(256, dtype=torch.uint8)[torch.randperm(60, generator=torch.Generator().manual_seed(1))]
    scales = scales.reshape(3, 5, 4)
    ours = dequantize_mxfp4(blocks, scales, "w")
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == theirs.shape == (3, 128, 5)
    assert torch.equal(ours, theirs)


def test_an_mxfp4_checkpoint_gives_transformers_tokens(mxfp4_checkpoint):
    import transformers
    from hf_models import hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_checkpoint, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    model = staticrt.load_model(mxfp4_checkpoint)
    assert model.config.family == "gpt_oss" and model.config.num_experts == 4
    got = staticrt.Generator(model, cache="hybrid", max_batch_size=2, max_cache_len=96).generate(PROMPTS, NEW_TOKENS)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_blocks_without_their_scales_are_named(mxfp4_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((mxfp4_checkpoint / "config.json").read_text())
    state = load_file(mxfp4_checkpoint / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        staticrt.load_model(folder)
    assert str(refused.value) == (
        f"{folder}: layers.1.mlp.experts.down_proj_blocks has no layers.1.mlp.experts.down_proj_scales beside it; "
        "restore the checkpoint's weights"
    )
