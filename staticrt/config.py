"""Model and cache configuration: one dataclass for every supported family.

A `ModelConfig` is read from a Hugging Face `config.json` or taken from the table of built-in
presets (gpt-fast style), so the model code never looks at a raw config dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, as_int, as_real, read_json_object

FAMILIES = ("llama", "mistral", "qwen2", "gemma2")
LAYER_KINDS = ("full_attention", "sliding_attention")
# The MLP activations models/decoder.py implements, by transformers' names: silu (and its alias swish), and
# the tanh approximation of gelu. Any other would silently run as one of these, so it is refused.
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh")
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters after normalising the old (`rope_scaling`) and new
    (`rope_parameters`) spellings of transformers' config.json."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            _check_positive(self, f"rope {name}", name)
        as_int(self.original_max_position_embeddings, "rope original_max_position_embeddings", 1, ConfigError)
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"rope high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor}): llama3 scaling blends between them; restore config.json"
            )


def _check_positive(owner: Any, label: str, name: str, zero: bool = False) -> None:
    """`owner.name` a finite number > 0 (>= 0 with `zero`), or a ConfigError naming it: a zero or
    negative rope theta, scale or norm epsilon decodes NaN logits, which run as token 0."""
    value = as_real(getattr(owner, name), label, ConfigError)
    if not (value >= 0 if zero else value > 0):
        raise ConfigError(
            f"{label} is {value}; it must be {'>= 0' if zero else '> 0'} (it would decode NaN logits): "
            "restore config.json"
        )


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama's `attention_bias`)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh
    # Gemma2 specifics; neutral values for the other families.
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): 1.0 for Gemma2
    scale_embeddings: bool = False
    sandwich_norms: bool = False  # post-attention and pre/post-feedforward norms
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model family {self.family!r} is not supported; staticrt runs {', '.join(FAMILIES)}")
        for name in SIZES:
            object.__setattr__(self, name, as_int(getattr(self, name), name, 1, ConfigError))
        _check_positive(self, "rms_norm_eps", "rms_norm_eps", zero=True)
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                _check_positive(self, name, name)
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act {self.hidden_act!r} is not implemented; staticrt runs {', '.join(ACTIVATIONS)}, and "
                "running another activation as one of these would give wrong tokens"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"layer_types holds {bad}; staticrt knows {list(LAYER_KINDS)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        data["rope"] = RopeConfig(**data.get("rope", {}))
        data["layer_types"] = tuple(data.get("layer_types", ()))
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        return cls(**data)


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(f"rope type {kind!r} is not supported; staticrt implements default, linear and llama3")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _layer_types_from_hf(family: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Which layers attend through a sliding window, as transformers decides it."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    window = cfg.get("sliding_window")
    if family == "gemma2":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))
    if family == "qwen2":
        if not cfg.get("use_sliding_window") or not window:
            return ("full_attention",) * num_layers
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    if family == "mistral" and window:
        return ("sliding_attention",) * num_layers
    return ("full_attention",) * num_layers


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate a transformers config.json dict; unknown architectures are refused by name."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"{source}: model_type {family!r} is not supported; staticrt runs {', '.join(FAMILIES)} checkpoints"
        )
    try:
        return _config_from_hf(family, cfg, source)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None
    except (TypeError, ValueError) as err:  # a field of the wrong JSON type (a string for a number, ...)
        raise ConfigError(f"{source}: a field has a value of the wrong type ({err}); restore config.json") from None


def _size(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    """A required (or defaulted) positive integer field of config.json, named as config.json names it."""
    if cfg.get(name) is None:
        if default is None:
            raise ConfigError(f"required field {name} is missing")
        return default
    return as_int(cfg[name], f"field {name}", 1, ConfigError)


def _config_from_hf(family: str, cfg: dict[str, Any], source: str) -> ModelConfig:
    hidden, heads = _size(cfg, "hidden_size"), _size(cfg, "num_attention_heads")
    layers = _size(cfg, "num_hidden_layers")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(t) for t in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    is_gemma = family == "gemma2"
    layer_types = _layer_types_from_hf(family, cfg, layers)
    uses_window = "sliding_attention" in layer_types
    # transformers' defaults: Gemma2 names it hidden_activation (gelu, tanh form), the others hidden_act (silu)
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if is_gemma else "silu")
    return ModelConfig(
        family=family,
        vocab_size=_size(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_size(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_size(cfg, "num_key_value_heads", heads),
        head_dim=_size(cfg, "head_dim", hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        max_position_embeddings=_size(cfg, "max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=family == "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=activation,
        norm_offset=1.0 if is_gemma else 0.0,
        scale_embeddings=is_gemma,
        sandwich_norms=is_gemma,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if is_gemma else None,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if is_gemma else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if is_gemma else None,
        sliding_window=_size(cfg, "sliding_window") if uses_window else None,
        layer_types=layer_types,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=cfg.get("pad_token_id"),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The transformers config.json that describes the same model: `config_from_hf`'s inverse, so
    presets run in transformers (the benchmark's `hf` backend)."""
    rope: dict[str, Any] = {"rope_type": config.rope.kind, "rope_theta": config.rope.theta}
    if config.rope.kind != "default":
        rope["factor"] = config.rope.factor
    if config.rope.kind == "llama3":
        rope.update(
            low_freq_factor=config.rope.low_freq_factor,
            high_freq_factor=config.rope.high_freq_factor,
            original_max_position_embeddings=config.rope.original_max_position_embeddings,
        )
    cfg = {
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    if config.sliding_window is not None:
        cfg["sliding_window"] = config.sliding_window
        if config.family != "mistral":  # Mistral windows every layer and takes no layer_types
            cfg["layer_types"] = list(config.layer_types)
    if config.family == "gemma2":
        cfg.update(
            hidden_activation=config.hidden_act,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            attn_logit_softcapping=config.attn_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
        )
    else:
        cfg["hidden_act"] = config.hidden_act
    if config.family == "qwen2":
        cfg["use_sliding_window"] = config.sliding_window is not None
    return cfg


def load_hf_config(folder: Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json; a Hugging Face checkpoint folder needs one")
    return config_from_hf(read_json_object(path, ConfigError, "restore its config.json"), source=str(path))
