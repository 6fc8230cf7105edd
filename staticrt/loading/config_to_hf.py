"""`ModelConfig` -> the transformers config.json that describes the same model: hf_config.py's
reading inverted, so presets and staticrt-loaded models run in transformers (the bench's `hf`
contender, bench/hf.py)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..rope_config import RopeConfig
from .families import FULL, SLIDING, TABLE, every_layer, qwen_windows
from .hf_config import granite_fields


def _rope_to_hf(rope: RopeConfig, rotary_fraction: float) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rotary_fraction != 1.0:
        out["partial_rotary_factor"] = rotary_fraction
    if rope.kind != "default":
        out["factor"] = rope.factor
    if rope.kind in ("llama3", "yarn", "longrope"):
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    if rope.kind == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.kind == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
    if rope.kind == "longrope":
        out.update(short_factor=list(rope.short_factor), long_factor=list(rope.long_factor))
    if rope.kind in ("yarn", "longrope"):
        out["attention_factor"] = rope.attention_factor
    if rope.query_scale_beta is not None:
        out["llama_4_scaling_beta"] = rope.query_scale_beta
    return out


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The transformers config.json that describes the same model: `config_from_hf`'s inverse, so
    presets run in transformers (the benchmark's `hf` backend)."""
    c, family = config, TABLE[config.family]
    fraction = c.rotary_dim / c.head_dim
    rope = _rope_to_hf(c.rope, fraction)
    if family.local_rope:  # nested by layer type, as transformers 5 writes these families
        rope = {FULL: rope, SLIDING: _rope_to_hf(c.rope_local or c.rope, fraction)}
    cfg: dict[str, Any] = {
        "model_type": c.family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
        "hidden_activation" if family.gemma else "hidden_act": c.hidden_act,
    }
    if c.rope.kind == "longrope":
        cfg["original_max_position_embeddings"] = c.rope.original_max_position_embeddings
    if c.sliding_window is not None:
        cfg["sliding_window"] = c.sliding_window
        if family.layer_types is not every_layer:  # Mistral's kind windows every layer, listing none
            cfg["layer_types"] = list(c.layer_types)
    if family.layer_types is qwen_windows:
        cfg["use_sliding_window"] = c.sliding_window is not None
    if family.gemma:
        cfg.update(
            query_pre_attn_scalar=c.query_pre_attn_scalar,
            attn_logit_softcapping=c.attn_logit_softcapping,
            final_logit_softcapping=c.final_logit_softcapping,
        )
    if family.granite:
        cfg.update({name: getattr(c, name) for name in granite_fields({})})
    cfg.update(_family_fields_to_hf(c))
    return cfg


def _family_fields_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The fields a family spells its own way (family_fields.py's readers), back in its spelling."""
    cfg: dict[str, Any] = {}
    if c.family == "smollm3":
        cfg["no_rope_layers"] = [int(i not in c.nope_layers) for i in range(c.num_layers)]
    if c.num_experts:
        cfg.update(_experts_to_hf(c))
    if c.family == "granitemoehybrid":  # family_fields.py's readers, inverted
        cfg.update(
            _mamba_to_hf(c),
            layer_types=["mamba" if t == "mamba" else "attention" for t in c.layer_types],
            shared_intermediate_size=c.intermediate_size,
            position_embedding_type=None if c.nope_layers else "rope",
            mamba_expand=c.mamba_heads * c.mamba_head_dim // c.hidden_size,
            num_local_experts=c.num_experts,
        )
    if c.family == "falcon_h1":
        attention_in, attention_out, ssm_in, ssm_out = c.branch_multipliers
        cfg.update(
            _mamba_to_hf(c),
            mamba_d_ssm=c.mamba_heads * c.mamba_head_dim,
            projectors_bias=c.mamba_proj_bias,
            mamba_rms_norm=c.mamba_norm != "none",
            mamba_norm_before_gate=c.mamba_norm == "gate_after",
            attention_in_multiplier=attention_in,
            attention_out_multiplier=attention_out,
            ssm_in_multiplier=ssm_in,
            ssm_out_multiplier=ssm_out,
            key_multiplier=c.key_multiplier,
            ssm_multipliers=list(c.ssm_multipliers or (1.0,) * 5),
            mlp_multipliers=list(c.mlp_multipliers),
            lm_head_multiplier=c.logits_multiplier,
            embedding_multiplier=c.embedding_multiplier,
        )
    if c.family == "lfm2":  # its own spellings (family_fields.py's lfm2_fields), the MLP width as it is
        cfg.update(
            layer_types=list(c.layer_types),
            conv_L_cache=c.conv_kernel,
            conv_bias=c.conv_bias,
            norm_eps=c.rms_norm_eps,
            block_auto_adjust_ff_dim=False,
        )
    return cfg


def _mamba_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A Mamba2 layer's sizes in Granite's and Falcon-H1's spelling (family_fields.py's `_GRANITE_NAMES`)."""
    return dict(
        mamba_n_heads=c.mamba_heads,
        mamba_d_head=c.mamba_head_dim,
        mamba_d_state=c.mamba_state,
        mamba_n_groups=c.mamba_groups,
        mamba_chunk_size=c.mamba_chunk,
        mamba_d_conv=c.conv_kernel,
        mamba_conv_bias=c.conv_bias,
        mamba_proj_bias=c.mamba_proj_bias,
    )


def _experts_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A mixture of experts' fields in its family's names (the inverse of families.py's readers)."""
    if c.family == "mixtral":
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.experts_per_token}
    if c.family == "granitemoehybrid":
        return {"num_experts_per_tok": c.experts_per_token, "intermediate_size": c.moe_intermediate_size}
    if c.family == "gpt_oss":
        return {
            "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.experts_per_token,
            "swiglu_limit": c.swiglu_limit,
            "swiglu_alpha": c.swiglu_alpha,
        }
    return {  # qwen3_moe, olmoe
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.experts_per_token,
        "moe_intermediate_size": c.moe_intermediate_size,
        "norm_topk_prob": c.router_renormalizes,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(c.num_layers) if i not in c.moe_layers],
    }
