"""transformers' config.json <-> `ModelConfig`, one reading for every family of the family table
(families.py), the rotary embeddings included: each rope kind's numbers resolved here as
transformers' modeling_rope_utils resolves them, so the model computes tables, never configs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..errors import ConfigError, as_int, read_json_object
from ..rope_config import RopeConfig
from .families import FULL, SLIDING, TABLE, Family, family_of


def _given(value: Any, default: Any) -> Any:
    """`value` where config.json gives one (a 0 too, which RopeConfig then refuses by name), else `default`."""
    return default if value is None else value


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope(params: dict[str, Any], cfg: dict[str, Any], family: Family, theta: float) -> RopeConfig:
    """One rotary embedding from its `rope_parameters` dict (`rope_scaling` merged in), with the
    attention factor and the longrope/yarn defaults transformers derives from the rest."""
    kind = params.get("rope_type") or params.get("type") or "default"
    kind = family.rope_aliases.get(kind, kind)
    max_len = int(cfg.get("max_position_embeddings", 8192))
    # Phi-3 keeps the pretraining length beside rope_parameters, and transformers prefers it there
    original = int(
        cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_len
    )
    factor = params.get("factor")
    attention = params.get("attention_factor")
    if kind == "yarn":
        factor = float(_given(factor, max_len / original))
        if attention is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    elif kind == "longrope":
        factor = float(_given(factor, max_len / original))
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=float(_given(params.get("rope_theta"), theta)),
        kind=kind,
        factor=float(_given(factor, 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original if kind in ("llama3", "yarn", "longrope") else max_len,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(params.get("short_factor") or ()),
        long_factor=tuple(params.get("long_factor") or ()),
        attention_factor=float(attention if attention is not None else 1.0),
        query_scale_beta=params.get("llama_4_scaling_beta"),
    )


def _ropes(cfg: dict[str, Any], family: Family) -> tuple[RopeConfig, RopeConfig | None, float]:
    """(the full-attention layers' rope, the sliding layers' where it differs, the partial rotary
    factor). transformers 5 nests `rope_parameters` by layer type for Gemma 3 and OLMo 3; older
    configs give `rope_theta`, `rope_scaling` (the full layers') and Gemma 3's `rope_local_base_freq`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(_given(cfg.get("rope_theta"), family.default_theta))
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        local.setdefault("rope_theta", _given(cfg.get("rope_local_base_freq"), theta))
    else:  # the scaling is the full layers'; the sliding ones keep the plain rotary, at their own base
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = (
            {"rope_theta": _given(cfg.get("rope_local_base_freq"), family.local_theta or theta)}
            if family.local_rope
            else None
        )
    partial = float(full.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rope = _rope(full, cfg, family, theta)
    local_rope = None if local is None else _rope(local, cfg, family, theta)
    return rope, (None if local_rope == rope else local_rope), partial


def _size(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    """A required (or defaulted) positive integer field of config.json, named as config.json names it."""
    if cfg.get(name) is None:
        if default is None:
            raise ConfigError(f"required field {name} is missing")
        return default
    return as_int(cfg[name], f"field {name}", 1, ConfigError)


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate a transformers config.json dict; unknown architectures are refused by name."""
    family, cfg = family_of(cfg, source)
    try:
        return _config_from_hf(family, cfg)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None
    except (TypeError, ValueError) as err:  # a field of the wrong JSON type (a string for a number, ...)
        raise ConfigError(f"{source}: a field has a value of the wrong type ({err}); restore config.json") from None


def _config_from_hf(name: str, cfg: dict[str, Any]) -> ModelConfig:
    family = TABLE[name]
    cfg = {**family.defaults, **cfg}
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention is set: this is an encoder (an embedding model), not a decoder "
            "that generates; staticrt runs causal decoders"
        )
    hidden, heads = _size(cfg, "hidden_size"), _size(cfg, "num_attention_heads")
    layers = _size(cfg, "num_hidden_layers")
    head_dim = _size(cfg, "head_dim", hidden // heads)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(t) for t in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    layer_types = family.layer_types(cfg, layers)
    rope, rope_local, partial = _ropes(cfg, family)
    # transformers' defaults: Gemma names it hidden_activation (gelu, tanh form), the others hidden_act (silu)
    default_act = "gelu_pytorch_tanh" if family.gemma else "silu"
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act
    gemma, granite = family.gemma, family.granite
    no_rope = cfg.get("no_rope_layers") if name == "smollm3" else None
    return ModelConfig(
        **{
            **dict(
                family=name,
                vocab_size=_size(cfg, "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_size(cfg, "intermediate_size"),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=_size(cfg, "num_key_value_heads", heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                rope_local=rope_local,
                rotary_dim=int(head_dim * partial),
                max_position_embeddings=_size(cfg, "max_position_embeddings", 8192),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma or name == "smollm3")),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                hidden_act=activation,
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
                final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
                sliding_window=_size(cfg, "sliding_window") if SLIDING in layer_types else None,
                layer_types=layer_types,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=cfg.get("pad_token_id"),
                nope_layers=() if no_rope is None else tuple(i for i, uses in enumerate(no_rope[:layers]) if not uses),
            ),
            **(granite_fields(cfg) if granite else {}),
            **(family.experts(cfg, layers) if family.experts else {}),
            **(family.own_fields(cfg) if family.own_fields else {}),
            **family.switches,
        }
    )


def granite_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


def load_hf_config(folder: Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json; a Hugging Face checkpoint folder needs one")
    return config_from_hf(read_json_object(path, ConfigError, "restore its config.json"), source=str(path))
