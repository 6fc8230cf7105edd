"""Built-in presets, gpt-fast style: a table of named model shapes with seeded random weights and no
files. The tiny ones serve the demo and the tests; `bench-llama` is the Llama shape the CPU
benchmark is defined on; `bench-1b` is a Llama-3.2-1B shape (1.24e9 parameters) for the CUDA one;
`bench-qwen3` is Qwen3-0.6B's shape (0.6e9 parameters, 0.44e9 without the tied embedding; head_dim
128 apart from hidden / heads, q/k norms), the CPU benchmark of the families of 2026;
`bench-qwen3-moe` is Qwen3-30B-A3B's kind scaled to a CPU (8 layers, 32 experts of which a token
reads 4: 0.50e9 parameters, 0.23e9 of them a decode step reads); `bench-lfm2` is LFM2-1.2B's shape
(1.17e9 parameters: 16 layers, of which 10 gated short convolutions and 6 attention)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..rope_config import RopeConfig


def _tiny(family: str, **overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        family=family,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_ids=(),
    )
    base.update(overrides)
    return ModelConfig(**base)


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": _tiny("llama"),
    "tiny-mistral": _tiny("mistral", sliding_window=64, layer_types=("sliding_attention",) * 2),
    "tiny-qwen2": _tiny("qwen2", qkv_bias=True),
    "tiny-gemma2": _tiny(
        "gemma2",
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        norm_offset=1.0,
        scale_embeddings=True,
        sandwich_norms=True,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=64,
        layer_types=("sliding_attention", "full_attention"),
    ),
    "bench-llama": ModelConfig(
        family="llama",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0),
    ),
    "bench-1b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope=RopeConfig(theta=500000.0),
    ),
    "bench-qwen3": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm="head",
        rope=RopeConfig(theta=1000000.0),
    ),
    "bench-qwen3-moe": ModelConfig(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm="head",
        rope=RopeConfig(theta=1000000.0),
        num_experts=32,
        experts_per_token=4,
        moe_intermediate_size=384,
        router_renormalizes=True,
    ),
    "bench-lfm2": ModelConfig(
        family="lfm2",
        vocab_size=65536,
        hidden_size=2048,
        intermediate_size=8192,  # its block_ff_dim 12288, auto-adjusted as transformers does (2/3, multiple of 256)
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=128000,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qk_norm="head",
        rope=RopeConfig(theta=1000000.0),
        layer_types=tuple("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)),
        conv_kernel=3,
    ),
}
