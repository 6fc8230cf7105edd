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
  biases, a router that softmaxes its k best logits and a clamped SwiGLU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import FAMILIES
from ..errors import ConfigError

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


def _split_phi3(state: dict[str, Any], sizes: dict[str, int]) -> None:
    """Phi-3's fused `qkv_proj` and `gate_up_proj` as the parts the decoder's checkpoint names
    (q, k, v; gate, up), in place: the decoder fuses them again on load (`FusedLinear`)."""
    q, kv, ff = sizes["q"], sizes["kv"], sizes["intermediate"]
    for name in [n for n in state if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        fused, owner = state.pop(name), name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), fused.split([q, kv, kv])))
        else:
            parts = dict(zip(("gate_proj", "up_proj"), fused.split([ff, ff])))
        state.update({f"{owner}.{part}.weight": tensor for part, tensor in parts.items()})


def _stack_experts(owner: str, gate: str, up: str, down: str) -> Callable[[dict[str, Any], dict[str, int]], None]:
    """A checkpoint's per-expert tensors (`layers.L.OWNER.experts.E.GATE.weight`, ...) as the
    decoder's stacked `layers.L.mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`, and
    the router as `layers.L.mlp.gate`, in place. A layer missing an expert's tensor keeps its
    tensors as they are, for the loader to name what is missing."""
    pattern = re.compile(rf"layers\.(\d+)\.{owner}\.experts\.(\d+)\.({gate}|{up}|{down})\.weight")

    def stack(state: dict[str, Any], sizes: dict[str, int]) -> None:
        found: dict[int, dict[str, dict[int, str]]] = {}
        for name in state:
            if match := pattern.fullmatch(name):
                layer, expert, part = match.groups()
                found.setdefault(int(layer), {}).setdefault(part, {})[int(expert)] = name
        for layer, parts in found.items():
            count = len(parts.get(gate, {}))
            if any(sorted(parts.get(p, {})) != list(range(count)) for p in (gate, up, down)):
                continue
            names = [[parts[p][e] for p in (gate, up, down)] for e in range(count)]
            pairs = [torch.cat([state.pop(g), state.pop(u)]) for g, u, _ in names]
            state[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(pairs)
            state[f"layers.{layer}.mlp.experts.down_proj"] = torch.stack([state.pop(d) for _, _, d in names])
            router = f"layers.{layer}.{owner}.gate.weight"
            if router in state:
                state[f"layers.{layer}.mlp.gate.weight"] = state.pop(router)

    return stack


def _experts(cfg: dict[str, Any], k: int) -> dict[str, Any]:
    """E (under either name: transformers 5 writes num_local_experts where hub configs say
    num_experts) and k (`k` where config.json says none)."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return {"num_experts": experts, "experts_per_token": int(cfg.get("num_experts_per_tok") or k)}


def _mixtral_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Mixtral: experts on every layer, softmax renormalised over the k, weights kept float32."""
    return _experts(cfg, 2) | {"router_renormalizes": True, "router_weights_float32": True}


def _qwen_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-MoE and OLMoE: `norm_topk_prob`; Qwen3-MoE's experts on every `decoder_sparse_step`-th
    layer but its `mlp_only_layers`, each `moe_intermediate_size` wide."""
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return _experts(cfg, 8) | dict(
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        router_renormalizes=bool(cfg.get("norm_topk_prob", False)),
    )


def _gpt_oss_experts(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss: a softmax over the k best router logits, biases, the clamped SwiGLU."""
    return _experts(cfg, 4) | dict(
        router_topk_first=True,
        moe_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def _lay_out_gpt_oss(state: dict[str, Any], sizes: dict[str, int]) -> None:
    """gpt-oss's experts as the decoder holds them, in place: its `gate_up_proj [E, H, 2I]`, gate
    and up interleaved column by column (x @ W), as `[E, 2I, H]` gate rows then up rows; its
    `down_proj [E, I, H]` as `[E, H, I]`; its biases alike; its `router` as `gate`."""
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        weight, bias = state.pop(name).transpose(1, 2), state.pop(f"{name}_bias")
        if name.endswith("gate_up_proj"):
            weight = torch.cat([weight[:, 0::2], weight[:, 1::2]], dim=1)
            bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
        state[name], state[f"{name}_bias"] = weight.contiguous(), bias
    for name in [n for n in state if ".mlp.router." in n]:
        state[name.replace(".mlp.router.", ".mlp.gate.")] = state.pop(name)


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
        layer_types=every_layer, rope_aliases={"su": "longrope", "yarn": "longrope"}, split_checkpoint=_split_phi3
    ),
    "smollm3": Family(layer_types=qwen_windows, default_theta=2e6),
    "olmo2": Family(_OLMO),
    "olmo3": Family(_OLMO, every_nth_full(4), local_rope=True),
    "granite": Family(granite=True),
    "ministral3": Family(layer_types=every_layer, default_theta=1e6),
    "mixtral": Family(
        layer_types=every_layer,
        default_theta=1e6,
        split_checkpoint=_stack_experts("block_sparse_moe", "w1", "w3", "w2"),
        experts=_mixtral_experts,
    ),
    "qwen3_moe": Family(
        {"qk_norm": "head"},
        qwen_windows,
        default_theta=1e6,
        split_checkpoint=_stack_experts("mlp", "gate_proj", "up_proj", "down_proj"),
        experts=_qwen_experts,
    ),
    "olmoe": Family(
        {"qk_norm": "width"},
        split_checkpoint=_stack_experts("mlp", "gate_proj", "up_proj", "down_proj"),
        experts=_qwen_experts,
    ),
    "gpt_oss": Family(
        {"attention_sinks": True, "norm_weight_in_float32": True},
        every_nth_full(2),
        default_theta=150000.0,
        split_checkpoint=_lay_out_gpt_oss,
        experts=_gpt_oss_experts,
    ),
}
assert tuple(TABLE) == FAMILIES, "a row for each family ModelConfig accepts"

# Checkpoints that hold a family's model inside another (a vision-language model's text half):
# model_type -> (the text config's key, its family, the prefix of its tensors once "model." is gone).
WRAPPERS = {
    "gemma3": ("text_config", "gemma3_text", "language_model."),
    "mistral3": ("text_config", "ministral3", "language_model."),
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
