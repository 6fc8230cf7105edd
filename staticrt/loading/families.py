"""The family table: what each transformers `model_type` adds to the one decoder.

A family is a row here, never a copy of the decoder: the `ModelConfig` switches it fixes (where
its norms sit, q/k norms, Granite's multipliers, ...), which layers slide when config.json does
not list `layer_types`, and how its checkpoint names tensors where that differs from Llama's.
hf_config.py reads the rest of config.json (sizes, rotary, windows) the same way for every row.

What each family is, read off transformers' modeling files (5.x):
- llama, mistral, qwen2 (q/k/v biases), gemma2 ((1 + w) norms, sandwich norms, soft caps);
- qwen3: RMSNorm over each head of q and k before the rotary, no biases;
- gemma3_text: Gemma 2 with q/k head norms, a second rotary for the sliding layers
  (`rope_local_base_freq`), no soft caps by default; `gemma3` checkpoints hold it as their
  `text_config` and `language_model` (the vision tower is left out);
- phi3 (Phi-3, 3.5, Phi-4-mini): q/k/v and gate/up fused in the checkpoint, a partial rotary,
  longrope; a window, where set, on every layer;
- smollm3: Llama with the rotary left out of the layers `no_rope_layers` marks 0;
- olmo2, olmo3: norms on the attention's and MLP's outputs, q/k RMSNorm over the whole projected
  width, weights multiplied in float32; olmo3 slides three layers in four;
- granite: embedding, attention, residual multipliers and logits scaling;
- ministral3: Mistral with yarn and queries scaled by position (`llama_4_scaling_beta`);
  `mistral3` checkpoints hold it as their `text_config`;
- mixtral, qwen3_moe, olmoe: Mistral, Qwen3 and OLMo-2-like attention with a mixture of experts
  for the MLP (models/moe.py), the checkpoint's per-expert tensors stacked;
- gpt_oss: attention sinks and biases, windows on every other layer, yarn, and experts with
  biases, a router that softmaxes its k best logits and a clamped SwiGLU;
- lfm2: gated short convolutions (models/short_conv.py) on the layers that do not attend, q/k
  head norms on those that do, its MLP's width derived from `block_*` fields;
- mamba2: Mamba2 layers alone (models/mamba2.py), each a norm and the mixer, no MLP, no rotary;
- granitemoehybrid (Granite 4.0-H): Mamba2 layers and attention (no rotary unless
  `position_embedding_type` is "rope"), Granite's multipliers, experts whose router softmaxes its
  k best logits beside a shared MLP (or that MLP alone);
- falcon_h1: a Mamba2 beside the attention in every layer, both on the layer's normed input and
  their outputs summed; µP multipliers on each branch, the Mamba2 projection's parts, the MLP's
  gate and output, the embeddings and the logits;
- qwen3_5_text (Qwen3.5): gated DeltaNet layers (models/gated_deltanet.py) and, one in four,
  attention whose output a per-head gate scales, q/k head norms, (1 + w) norms, a quarter rotary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import FAMILIES
from ..errors import ConfigError
from .checkpoint_layouts import (
    lay_out_gpt_oss,
    lay_out_granite_hybrid,
    rename_falcon_h1,
    rename_lfm2,
    rename_mamba2,
    split_phi3,
    stack_experts,
)
from .family_fields import (
    deltanet_fields,
    falcon_h1_fields,
    gpt_oss_experts,
    granite_experts,
    granite_hybrid_fields,
    lfm2_fields,
    mamba2_fields,
    mixtral_experts,
    qwen_experts,
)

LayerTypes = Callable[[dict[str, Any], int], tuple[str, ...]]
FULL, SLIDING = "full_attention", "sliding_attention"


def no_windows(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    return (FULL,) * layers


def every_layer(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Mistral's rule: a window, where config.json sets one, on every layer (its attention reads
    `sliding_window` alone, whatever `layer_types` says)."""
    return (SLIDING if cfg.get("sliding_window") else FULL,) * layers


def every_nth_full(default: int) -> LayerTypes:
    """Every layer slides but each n-th (`sliding_window_pattern`, Gemma's name; else `default`)."""

    def layer_types(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
        if cfg.get("layer_types"):
            return tuple(cfg["layer_types"])
        n = int(cfg.get("sliding_window_pattern") or default)
        return tuple(SLIDING if (i + 1) % n else FULL for i in range(layers))

    return layer_types


def qwen_windows(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Qwen2/3 and SmolLM3: no window unless `use_sliding_window`; then `layer_types`, or the
    layers from `max_window_layers` on (Qwen), or those without a rotary (SmolLM3)."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return (FULL,) * layers
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if "no_rope_layers" in cfg:
        return tuple(FULL if uses else SLIDING for uses in cfg["no_rope_layers"][:layers])
    first = int(cfg.get("max_window_layers", layers))
    return tuple(SLIDING if i >= first else FULL for i in range(layers))


def conv_or_full(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """LFM2: `layer_types` ("conv" or "full_attention"), else attention on `full_attn_idxs`."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    full = set(cfg.get("full_attn_idxs") or range(layers))
    return tuple(FULL if i in full else "conv" for i in range(layers))


def mamba_or_full(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Mamba2 and Granite 4.0-H: `layer_types` ("mamba" or "attention", transformers 5's
    "linear_attention" and "full_attention"), else Mamba2 layers only."""
    given = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    return tuple("mamba" if t in ("mamba", "linear_attention") else FULL if t == "attention" else t for t in given)


def mamba_beside_attention(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Falcon-H1: every layer a Mamba2 and an attention side by side, two cache layers each."""
    return ("mamba", FULL) * layers


def deltanet_or_full(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Qwen3.5: `layer_types` ("linear_attention" is a gated DeltaNet layer), else attention every
    `full_attention_interval`-th layer (4)."""
    if cfg.get("layer_types"):
        return tuple("deltanet" if t == "linear_attention" else t for t in cfg["layer_types"])
    n = int(cfg.get("full_attention_interval") or 4)
    return tuple(FULL if (i + 1) % n == 0 else "deltanet" for i in range(layers))


@dataclass(frozen=True)
class Family:
    switches: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family fixes
    layer_types: LayerTypes = no_windows
    gemma: bool = False  # gelu and a tied head by default; query_pre_attn_scalar and soft caps read
    granite: bool = False  # its four multipliers read
    rope_aliases: dict[str, str] = field(default_factory=dict)  # rope type names the family reads as others
    default_theta: float = 10000.0
    local_rope: bool = False  # its sliding layers take a rotary of their own (Gemma 3, OLMo 3)
    local_theta: float | None = None  # their base where config.json gives none (None: the full layers')
    split_checkpoint: Callable[[dict[str, Any], dict[str, int]], None] | None = None
    experts: Callable[[dict[str, Any], int], dict[str, Any]] | None = None  # its MoE fields from config.json
    own_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # fields config.json spells its own way
    defaults: dict[str, Any] = field(default_factory=dict)  # config.json fields it may lack (Mamba2: no attention)


_GEMMA = {"norm_offset": 1.0, "scale_embeddings": True, "sandwich_norms": True}
_OLMO = {"post_norms": True, "qk_norm": "width", "norm_weight_in_float32": True}

TABLE: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(layer_types=every_layer),
    "qwen2": Family({"qkv_bias": True}, qwen_windows),
    "gemma2": Family(_GEMMA, every_nth_full(2), gemma=True),
    "qwen3": Family({"qk_norm": "head"}, qwen_windows, default_theta=1e6),
    "gemma3_text": Family(
        {**_GEMMA, "qk_norm": "head"},
        every_nth_full(6),
        gemma=True,
        default_theta=1e6,
        local_rope=True,
        local_theta=1e4,
    ),
    "phi3": Family(
        layer_types=every_layer, rope_aliases={"su": "longrope", "yarn": "longrope"}, split_checkpoint=split_phi3
    ),
    "smollm3": Family(layer_types=qwen_windows, default_theta=2e6),
    "olmo2": Family(_OLMO),
    "olmo3": Family(_OLMO, every_nth_full(4), local_rope=True),
    "granite": Family(granite=True),
    "ministral3": Family(layer_types=every_layer, default_theta=1e6),
    "mixtral": Family(
        layer_types=every_layer,
        default_theta=1e6,
        split_checkpoint=stack_experts("block_sparse_moe", "w1", "w3", "w2"),
        experts=mixtral_experts,
    ),
    "qwen3_moe": Family(
        {"qk_norm": "head"},
        qwen_windows,
        default_theta=1e6,
        split_checkpoint=stack_experts("mlp", "gate_proj", "up_proj", "down_proj"),
        experts=qwen_experts,
    ),
    "olmoe": Family(
        {"qk_norm": "width"},
        split_checkpoint=stack_experts("mlp", "gate_proj", "up_proj", "down_proj"),
        experts=qwen_experts,
    ),
    "gpt_oss": Family(
        {"attention_sinks": True, "norm_weight_in_float32": True},
        every_nth_full(2),
        default_theta=150000.0,
        split_checkpoint=lay_out_gpt_oss,
        experts=gpt_oss_experts,
    ),
    "lfm2": Family(
        {"qk_norm": "head"}, conv_or_full, default_theta=1e6, split_checkpoint=rename_lfm2, own_fields=lfm2_fields
    ),
    "mamba2": Family(
        {"mixer_only": True},
        mamba_or_full,
        split_checkpoint=rename_mamba2,
        own_fields=mamba2_fields,
        defaults={"num_attention_heads": 1, "intermediate_size": 1},  # placeholders: no layer attends or has an MLP
    ),
    "granitemoehybrid": Family(
        layer_types=mamba_or_full,
        granite=True,
        split_checkpoint=lay_out_granite_hybrid,
        experts=granite_experts,
        own_fields=granite_hybrid_fields,
    ),
    "falcon_h1": Family(
        {"parallel_mamba": True},
        mamba_beside_attention,
        split_checkpoint=rename_falcon_h1,
        own_fields=falcon_h1_fields,
    ),
    "qwen3_5_text": Family(
        {"qk_norm": "head", "norm_offset": 1.0, "attention_output_gate": True},
        deltanet_or_full,
        own_fields=deltanet_fields,
        defaults={"partial_rotary_factor": 0.25},
    ),
}
assert tuple(TABLE) == FAMILIES, "a row for each family ModelConfig accepts"

# Checkpoints that hold a family's model inside another (a vision-language model's text half):
# model_type -> (the text config's key, its family, the prefix of its tensors once "model." is gone).
WRAPPERS = {
    "gemma3": ("text_config", "gemma3_text", "language_model."),
    "mistral3": ("text_config", "ministral3", "language_model."),
    "qwen3_5": ("text_config", "qwen3_5_text", "language_model."),
}


def family_of(cfg: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The family of a config.json dict and the dict that describes its decoder (a wrapper's text
    config, with the wrapper's fields it lacks); refused by name with the list of what runs."""
    model_type = cfg.get("model_type")
    if model_type in WRAPPERS:
        key, family, _ = WRAPPERS[model_type]
        inner = cfg.get(key)
        if not isinstance(inner, dict):
            raise ConfigError(f"{source}: a {model_type} config.json needs its {key}; restore config.json")
        outer = {k: v for k, v in cfg.items() if k not in (key, "model_type", "architectures")}
        return family, {**outer, **inner, "model_type": family}
    if model_type not in TABLE:
        runs = ", ".join([*FAMILIES, *WRAPPERS])
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; staticrt runs {runs} checkpoints")
    return model_type, cfg


def checkpoint_names(model_type: str | None, state: dict[str, Any], sizes: dict[str, int]) -> dict[str, Any]:
    """A checkpoint's tensors (their "model." prefix gone) under the decoder's names: a wrapper's
    text half unwrapped (the rest dropped), a family's fused tensors split (`Family.split_checkpoint`).
    `sizes`: q, kv and intermediate, the widths of the parts. `model_type`: the checkpoint's own."""
    if model_type in WRAPPERS:
        _, family, prefix = WRAPPERS[model_type]
        # "language_model.layers.0..." (transformers 5) or "language_model.model.layers.0..." (4.x)
        state = {
            name.removeprefix(prefix).removeprefix("model."): t
            for name, t in state.items()
            if name.startswith(prefix) or name == "lm_head.weight"
        }
        model_type = family
    split = TABLE[model_type].split_checkpoint if model_type in TABLE else None
    if split is not None:
        split(state, sizes)
    return state
