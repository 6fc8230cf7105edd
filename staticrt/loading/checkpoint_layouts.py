"""How a family's checkpoint lays its tensors out where that differs from the decoder's names and
shapes (Llama's): each function but `lfm2_names` rewrites a checkpoint's state dict in place,
before loading, and is a family's `split_checkpoint` in the family table (families.py);
`lfm2_names` goes the other way, for the bench's transformers contender."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch


def split_phi3(state: dict[str, Any], sizes: dict[str, int]) -> None:
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


def stack_experts(owner: str, gate: str, up: str, down: str) -> Callable[[dict[str, Any], dict[str, int]], None]:
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


def lay_out_gpt_oss(state: dict[str, Any], sizes: dict[str, int]) -> None:
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


# LFM2's names -> the decoder's: its norms, attention and MLP are Llama's under other names.
_LFM2_NAMES = {
    "operator_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "self_attn.out_proj": "self_attn.o_proj",
    "self_attn.q_layernorm": "self_attn.q_norm",
    "self_attn.k_layernorm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def _renamer(layer_names: dict[str, str], whole: dict[str, str]) -> Callable[[str], str]:
    """One tensor name -> another: a layer's `layers.N.PART.x` by `layer_names` (PART -> part), a
    model-wide tensor by `whole`, any other as it is."""
    pattern = re.compile(rf"(layers\.\d+\.)({'|'.join(map(re.escape, layer_names))})((?:\.\w+)+)")

    def rename(name: str) -> str:
        match = pattern.fullmatch(name)
        return f"{match[1]}{layer_names[match[2]]}{match[3]}" if match else whole.get(name, name)

    return rename


# its final norm, `embedding_norm`, is the decoder's `norm`
_TO_DECODER = _renamer(_LFM2_NAMES, {"embedding_norm.weight": "norm.weight"})
_TO_LFM2 = _renamer({ours: theirs for theirs, ours in _LFM2_NAMES.items()}, {"norm.weight": "embedding_norm.weight"})


def lfm2_names(state: dict[str, Any]) -> dict[str, Any]:
    """The decoder's state dict under LFM2's checkpoint names: `rename_lfm2`'s inverse, for a
    transformers model of the same weights (the bench's contender)."""
    return {_TO_LFM2(name): tensor for name, tensor in state.items()}


def _renaming(rename: Callable[[str], str]) -> Callable[[dict[str, Any], dict[str, int]], None]:
    """A family's `split_checkpoint` that renames its tensors in place, each by `rename`."""

    def split(state: dict[str, Any], sizes: dict[str, int]) -> None:
        for name in list(state):
            if (ours := rename(name)) != name:
                state[ours] = state.pop(name)

    return split


# LFM2's conv layers' `conv.in_proj`, `conv.conv`, `conv.out_proj` are the decoder's own (models/short_conv.py)
rename_lfm2 = _renaming(_TO_DECODER)
# Falcon-H1's MLP is `feed_forward`, its norm before it `pre_ff_layernorm`, its final one `final_layernorm`
_FALCON_H1_NAMES = {"feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm"}
rename_falcon_h1 = _renaming(_renamer(_FALCON_H1_NAMES, {"final_layernorm.weight": "norm.weight"}))
_TO_FALCON_H1 = _renamer(
    {ours: theirs for theirs, ours in _FALCON_H1_NAMES.items()}, {"norm.weight": "final_layernorm.weight"}
)


def falcon_h1_names(state: dict[str, Any]) -> dict[str, Any]:
    """The decoder's state dict under Falcon-H1's names (`rename_falcon_h1` inverted), for the bench's contender."""
    return {_TO_FALCON_H1(name): tensor for name, tensor in state.items()}


# Mamba2's names -> the decoder's: its blocks are a norm and a mixer (`mamba`, as Granite names it)
_MAMBA2_TO_DECODER = _renamer(
    {"norm": "input_layernorm", "mixer": "mamba"},
    {
        "embeddings.weight": "embed_tokens.weight",
        "embedding.weight": "embed_tokens.weight",
        "norm_f.weight": "norm.weight",
    },
)


def rename_mamba2(state: dict[str, Any], sizes: dict[str, int]) -> None:
    """A Mamba2 checkpoint's `backbone.*` tensors under the decoder's names, in place."""
    for name in [n for n in state if n.startswith("backbone.")]:
        state[_MAMBA2_TO_DECODER(name.removeprefix("backbone."))] = state.pop(name)


def lay_out_granite_hybrid(state: dict[str, Any], sizes: dict[str, int]) -> None:
    """Granite 4.0-H's feed-forward as the decoder holds it, in place: its experts' `input_linear
    [E, 2I, H]` (gate rows, then up rows) and `output_linear [E, H, I]` are `mlp.experts`' own
    layout, `router.layer` is `mlp.gate`; its `shared_mlp.input_linear [2I, H]` is split into gate
    and up, under `shared_mlp` beside experts, as the layer's `mlp` where there are none."""
    moe = {
        "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
        "block_sparse_moe.experts.gate_up_proj": "mlp.experts.gate_up_proj",
        "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
        "block_sparse_moe.experts.down_proj": "mlp.experts.down_proj",
        "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
        "block_sparse_moe.router.weight": "mlp.gate.weight",
    }
    for name in list(state):
        layer, _, rest = name.partition(".block_sparse_moe.")
        if rest and (ours := moe.get(f"block_sparse_moe.{rest}")):
            state[f"{layer}.{ours}"] = state.pop(name)
    for name in [n for n in state if n.endswith(".shared_mlp.input_linear.weight")]:
        layer = name.removesuffix(".shared_mlp.input_linear.weight")
        owner = f"{layer}.{'shared_mlp' if f'{layer}.mlp.gate.weight' in state else 'mlp'}"
        state[f"{owner}.gate_proj.weight"], state[f"{owner}.up_proj.weight"] = state.pop(name).chunk(2)
        state[f"{owner}.down_proj.weight"] = state.pop(f"{layer}.shared_mlp.output_linear.weight")


def granite_hybrid_names(state: dict[str, Any]) -> dict[str, Any]:
    """The decoder's state dict under the module names of transformers' own Granite 4.0-H model
    (`lay_out_granite_hybrid` reads those too): its inverse, for the bench's transformers
    contender. The shared MLP (the layer's `mlp` without experts, `shared_mlp` beside them) goes
    back to one `input_linear` of gate rows, then up rows."""
    experts = {
        "mlp.experts.gate_up_proj": "block_sparse_moe.experts.gate_up_proj",
        "mlp.experts.down_proj": "block_sparse_moe.experts.down_proj",
        "mlp.gate.weight": "block_sparse_moe.router.weight",
    }
    dense = re.compile(r"(layers\.\d+)\.(mlp|shared_mlp)\.(gate_proj|up_proj|down_proj)\.weight")
    out = {}
    for name, tensor in state.items():
        in_layer = re.fullmatch(r"(layers\.\d+\.)(.+)", name)
        if in_layer is not None and in_layer[2] in experts:
            out[in_layer[1] + experts[in_layer[2]]] = tensor
        elif (match := dense.fullmatch(name)) is None:
            out[name] = tensor
        elif match[3] == "gate_proj":
            owner = f"{match[1]}.{match[2]}"
            gate_up = torch.cat([tensor, state[f"{owner}.up_proj.weight"]])
            out[f"{match[1]}.shared_mlp.input_linear.weight"] = gate_up
            out[f"{match[1]}.shared_mlp.output_linear.weight"] = state[f"{owner}.down_proj.weight"]
    return out
