"""The config.json fields each family of the family table (families.py) spells its own way: an
LFM2 MLP's width, Mamba2 layers' sizes, and each mixture of experts' count, k and router."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def lfm2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's own spellings: its conv kernel, norm epsilon, tied head, and its MLP width, which
    transformers derives from `intermediate_size` (`block_ff_dim`) as Lfm2MLP does."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            width = int(cfg["block_ffn_dim_multiplier"] * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return {
        "conv_kernel": int(cfg.get("conv_L_cache", 3)),
        "conv_bias": bool(cfg.get("conv_bias", False)),
        "intermediate_size": width,
        "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))),
    }


def _time_step_limit(value: Any) -> tuple[float, float]:
    """(low, high); transformers 5 writes infinity as `{"__float__": "Infinity"}`."""
    low, high = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in (value or (0.0, "inf")))
    return low, high


def _mamba_fields(cfg: dict[str, Any], prefix: str, names: dict[str, str]) -> dict[str, Any]:
    """A Mamba2 layer's sizes from config.json, under the family's spellings (`names`: ours -> its
    suffix, read after `prefix`); the head width, where "auto", from expand * hidden / heads."""
    get = {ours: cfg.get(prefix + theirs) for ours, theirs in names.items()}
    heads, expand = int(get["heads"]), int(get["expand"] or 2)
    head_dim = get["head_dim"]
    return {
        "mamba_heads": heads,
        "mamba_head_dim": expand * int(cfg["hidden_size"]) // heads if head_dim in (None, "auto") else int(head_dim),
        "mamba_state": int(get["state"]),
        "mamba_groups": int(get["groups"] or 1),
        "mamba_chunk": int(get["chunk"] or 256),
        "conv_kernel": int(get["conv"] or 4),
        "conv_bias": bool(get["conv_bias"] if get["conv_bias"] is not None else True),
        "mamba_proj_bias": bool(get["proj_bias"] or False),
        "time_step_limit": _time_step_limit(cfg.get("time_step_limit")),
    }


_MAMBA2_NAMES = dict(
    heads="num_heads", head_dim="head_dim", expand="expand", state="state_size", groups="n_groups",
    chunk="chunk_size", conv="conv_kernel", conv_bias="use_conv_bias", proj_bias="use_bias",
)  # fmt: skip
_GRANITE_NAMES = dict(
    heads="n_heads", head_dim="d_head", expand="expand", state="d_state", groups="n_groups",
    chunk="chunk_size", conv="d_conv", conv_bias="conv_bias", proj_bias="proj_bias",
)  # fmt: skip


def mamba2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba2: its mixer's sizes, its norm epsilon, its untied head by default."""
    return _mamba_fields(cfg, "", _MAMBA2_NAMES) | {
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def granite_hybrid_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H: its mixer's sizes, its shared MLP's width as the dense MLP's, no rotary
    unless `position_embedding_type` says "rope"."""
    layers = int(cfg["num_hidden_layers"])
    nope = () if cfg.get("position_embedding_type") == "rope" else tuple(range(layers))
    width = int(cfg.get("shared_intermediate_size") or 1024)
    return _mamba_fields(cfg, "mamba_", _GRANITE_NAMES) | {"intermediate_size": width, "nope_layers": nope}


def falcon_h1_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1: its Mamba2 sizes (Granite's spellings; the mixer `mamba_d_ssm` wide where set),
    how its output meets the gate, and its µP multipliers."""
    fields = _mamba_fields(cfg, "mamba_", _GRANITE_NAMES)
    if cfg.get("mamba_d_ssm") and cfg.get("mamba_d_head") in (None, "auto"):
        fields["mamba_head_dim"] = int(cfg["mamba_d_ssm"]) // fields["mamba_heads"]
    if bool(cfg.get("projectors_bias", False)) != fields["mamba_proj_bias"]:
        raise ConfigError(
            "projectors_bias and mamba_proj_bias differ (a bias on the Mamba2 output projection but not its input, "
            "or the reverse); staticrt runs Falcon-H1 with both set alike, as the released checkpoints have them"
        )
    norm = (
        "none"
        if not cfg.get("mamba_rms_norm")
        else "gate_after"
        if cfg.get("mamba_norm_before_gate", True)
        else "gated"
    )
    get = lambda name: float(cfg.get(name, 1.0))  # noqa: E731
    names = ("attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
    return fields | {
        "mamba_norm": norm,
        "branch_multipliers": tuple(get(name) for name in names),
        "key_multiplier": get("key_multiplier"),
        "ssm_multipliers": tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5),
        "mlp_multipliers": tuple(float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0)),
        "logits_multiplier": get("lm_head_multiplier"),
        "embedding_multiplier": get("embedding_multiplier"),
    }


def deltanet_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's gated DeltaNet layers: their heads, widths and convolution."""
    return {
        "linear_key_heads": int(cfg.get("linear_num_key_heads") or 16),
        "linear_value_heads": int(cfg.get("linear_num_value_heads") or 32),
        "linear_key_dim": int(cfg.get("linear_key_head_dim") or 128),
        "linear_value_dim": int(cfg.get("linear_value_head_dim") or 128),
        "conv_kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
    }


def granite_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Experts `intermediate_size` wide on every layer, a softmax over the k best router logits,
    the shared MLP beside them; none where num_local_experts is 0 (Granite 4.0-H Micro)."""
    found = experts(cfg, 2)
    if not found["num_experts"]:
        return {"num_experts": 0, "experts_per_token": 0}
    return found | {
        "moe_intermediate_size": int(cfg["intermediate_size"]),
        "router_topk_first": True,
        "shared_expert": True,
    }


def experts(cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """E (under either name: transformers 5 writes num_local_experts where hub configs say
    num_experts) and k (`k` where config.json says none)."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return {"num_experts": experts, "experts_per_token": int(cfg.get("num_experts_per_tok") or k)}


def mixtral_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Mixtral: experts on every layer, softmax renormalised over the k, weights kept float32."""
    return experts(cfg, 2) | {"router_renormalizes": True, "router_weights_float32": True}


def qwen_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-MoE and OLMoE: `norm_topk_prob`; Qwen3-MoE's experts on every `decoder_sparse_step`-th
    layer but its `mlp_only_layers`, each `moe_intermediate_size` wide."""
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return experts(cfg, 8) | dict(
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        router_renormalizes=bool(cfg.get("norm_topk_prob", False)),
    )


def gpt_oss_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss: a softmax over the k best router logits, biases, the clamped SwiGLU."""
    return experts(cfg, 4) | dict(
        router_topk_first=True,
        moe_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
