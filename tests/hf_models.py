"""Tiny random-weight transformers checkpoints, one per family, written with `save_pretrained`.

They are the oracle: staticrt loads them through its own loader and must reproduce transformers'
eager forward and `generate`. Weights are redrawn wider than transformers' default init so that
logits are spread and greedy choices are not decided by rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def family_config(family: str, **overrides):
    import transformers as tf

    if family == "llama":
        cfg = tf.LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif family == "llama-linear-tied":
        cfg = tf.LlamaConfig(
            **{**COMMON, "num_key_value_heads": 1},
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    elif family == "mistral":
        cfg = tf.MistralConfig(**COMMON, sliding_window=None)
    elif family == "mistral-sw16":  # every layer attends through a window of 16
        cfg = tf.MistralConfig(**COMMON, sliding_window=16)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**COMMON, "num_key_value_heads": 1})
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**COMMON, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    elif family in NEW_FAMILIES:
        cfg = new_family_config(tf, family)
    elif family in MOE_FAMILIES:
        cfg = moe_config(tf, family)
    elif family in RECURRENT_FAMILIES:
        cfg = recurrent_config(tf, family)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# The families of issue 63, each varied where its real checkpoints vary: GQA and MQA, head sizes
# apart from hidden / heads (odd multiples of 4), tied and untied heads, its rotary kind and its
# layer pattern. Lengths past 32 cross each long-context rotary's pretraining length.
NEW_FAMILIES = ("qwen3", "gemma3_text", "phi3", "smollm3", "olmo2", "olmo3", "granite", "ministral3")
LONGROPE = dict(short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5], long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0])


def new_family_config(tf, family: str):
    common = {**COMMON, "max_position_embeddings": 128}  # yarn's and longrope's factor: 128 / 32
    if family == "qwen3":  # MQA, head_dim 24 (not hidden / heads), tied as Qwen3-0.6B
        return tf.Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=24, tie_word_embeddings=True)
    if family == "gemma3_text":  # sliding then full, a linear-scaled global rotary, a local base of its own
        return tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    if family == "phi3":  # Phi-4-mini's partial rotary (0.75 of 16: 12 dims) and longrope
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, **LONGROPE}
        return tf.Phi3Config(**common, original_max_position_embeddings=32, rope_parameters=rope)
    if family == "smollm3":  # layer 1 without a rotary
        return tf.SmolLM3Config(**common, no_rope_layers=[1, 0])
    if family == "olmo2":
        return tf.Olmo2Config(**{**common, "num_key_value_heads": 4})
    if family == "olmo3":  # sliding then full, yarn on the full layer
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        rope = {"full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
        layers = ["sliding_attention", "full_attention"]
        return tf.Olmo3Config(**common, sliding_window=16, layer_types=layers, rope_parameters=rope)
    if family == "granite":
        multipliers = dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22)
        return tf.GraniteConfig(**common, **multipliers, logits_scaling=8.0)
    if family == "ministral3":  # yarn with mscale and the position-scaled queries, head_dim 20
        rope = {
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        }
        return tf.Ministral3Config(**common, head_dim=20, rope_parameters=rope)
    raise ValueError(family)


# Recurrent state beside the KV cache (issue 65): LFM2's conv layers around an attention layer,
# its MLP width derived from block_* fields (128 * 2/3 = 85, * 1.5 = 127, rounded up to 32: 128);
# Mamba2 layers alone (8 heads of 16, a state of 16 in 2 groups), and Granite 4.0-H's two Mamba2
# layers around an attention layer without rotary, with 4 experts beside a shared MLP and
# Granite's multipliers; both scan in chunks of 16 positions, so prompts span several. Qwen3.5:
# three gated DeltaNet layers (2 key heads, 4 value heads) and gated attention, chunks of 64.
# Falcon-H1: a Mamba2 (8 heads of 16, mamba_d_ssm 128, 2 groups) beside the attention in each of 2
# layers, every µP multiplier away from 1, the Mamba2 output normed before its gate (the config's
# default); "falcon_h1-ungated-norm" is the same without that norm (mamba_rms_norm false).
RECURRENT_FAMILIES = ("lfm2", "mamba2", "granitemoehybrid", "falcon_h1", "falcon_h1-ungated-norm", "qwen3_5_text")
MAMBA = dict(conv_kernel=4, chunk_size=16)


def recurrent_config(tf, family: str):
    if family == "lfm2":
        return tf.Lfm2Config(
            **{**COMMON, "num_hidden_layers": 3, "max_position_embeddings": 512},
            full_attn_idxs=[1],
            block_multiple_of=32,
            block_ffn_dim_multiplier=1.5,
        )
    small = {k: COMMON[k] for k in ("vocab_size", "hidden_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    if family == "mamba2":
        return tf.Mamba2Config(
            **small, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2, **MAMBA
        )
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **{**COMMON, "intermediate_size": 32, "num_hidden_layers": 3},
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            embedding_multiplier=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=2.0,
        )
    if family.startswith("falcon_h1"):
        return tf.FalconH1Config(
            **{**COMMON, "num_hidden_layers": 2},
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            mamba_rms_norm=family == "falcon_h1",
            embedding_multiplier=1.5,
            lm_head_multiplier=0.7,
            mlp_multipliers=[0.8, 1.3],
            key_multiplier=0.6,
            attention_in_multiplier=0.9,
            attention_out_multiplier=1.1,
            ssm_multipliers=[1.2, 0.9, 0.8, 1.1, 0.7],
            ssm_in_multiplier=1.05,
            ssm_out_multiplier=0.95,
        )
    if family == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
    raise ValueError(family)


# Mixtures of experts (issue 64): E 4-8, k 1-2, each family's router and layer pattern.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


def moe_config(tf, family: str):
    common = {**COMMON, "max_position_embeddings": 128}
    if family == "mixtral":  # a window on every layer, softmax renormalised over k = 2 of 4
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    if family == "qwen3_moe":  # 8 experts, layer 1 dense, experts narrower than the dense MLP
        return tf.Qwen3MoeConfig(
            **common,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if family == "olmoe":  # k = 1, weights not renormalised
        return tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=1)
    if family == "gpt_oss":  # sinks, biases, sliding then full, yarn past 32
        yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        rope = {**yarn, "original_max_position_embeddings": 32, "rope_theta": 150000.0}
        return tf.GptOssConfig(  # a SwiGLU limit these small activations reach (the real one is 7)
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=16,
            rope_parameters=rope,
            swiglu_limit=0.3,
        )
    raise ValueError(family)


def build_hf_model(family: str, seed: int = 0, **overrides):
    import transformers as tf

    cfg = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(noise * 0.1 + (0.0 if cfg.model_type in ("gemma2", "gemma3_text") else 1.0))
            else:  # a small embedding keeps tied heads from just echoing the input token
                param.copy_(noise * (0.02 if "embed" in name else 0.15))
    return model


def save_hf_model(family: str, folder: Path, seed: int = 0, **overrides):
    model = build_hf_model(family, seed, **overrides)
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int, **options) -> list[int]:
    """transformers' eager `generate`, one unpadded row at a time: the reference each row of a
    staticrt batch must reproduce. `options` go to `generate` (num_beams, eos_token_id, ...)."""
    ids = torch.tensor([prompt])
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0) | options
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **settings)
    return out[0, len(prompt) :].tolist()
