"""A Llama, Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3 or LFM2 `Decoder` written as a GGUF file
llama.cpp runs, so `bench --gguf Q4_0` can time llama.cpp on the very weights staticrt runs (a
preset has no GGUF of its own), and the tests can convert each family's GGUF back through transformers' reader.

The layout is llama.cpp's own converter's (convert_hf_to_gguf.py: `LlamaModel` (Mixtral's too), `Qwen3Model`,
`Gemma3Model`, `Phi3MiniModel`, `LFM2Model`): its tensor names, Llama's Q and K rows permuted for its interleaved
RoPE (the others rotate in halves, as transformers does, and keep their order), Gemma's norms stored
as 1 + w, Phi-3's fused q/k/v and gate/up, the projections in the asked block type
(quantized by the gguf library, llama.cpp's reference code in NumPy), the embedding and head in
Q8_0 as 8-bit companions, norms in F32. Presets have no tokenizer: the vocabulary is placeholder
pieces (byte pieces where they fit), since the bench feeds token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import BenchError
from ..models.decoder import Decoder
from ..models.gguf_blocks import PROJECTIONS
from .plan import GGUF_TYPES  # what `bench --gguf` writes (F32: the float model, as staticrt runs it)

NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
SPLIT = {hf: short for short, hf in PROJECTIONS.items()}  # q, k, v, o, gate, up, down apart
# a mixture of experts: the router, and each stacked projection as llama.cpp's 3-D tensor (`_expert_tensors`)
EXPERTS = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
# family -> (llama.cpp's architecture, each layer tensor's name there by the decoder's: a parameter
# of the decoder where llama.cpp fuses it too, Phi-3's q/k/v and gate/up), as its convert_hf_to_gguf.py writes them
ARCHITECTURES = {
    "llama": ("llama", SPLIT | NORMS),
    "qwen3": ("qwen3", SPLIT | NORMS | QK_NORMS),
    "gemma3_text": (
        "gemma3",
        SPLIT
        | QK_NORMS
        | {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        },
    ),
    "qwen3_moe": ("qwen3moe", SPLIT | NORMS | QK_NORMS | EXPERTS),
    "mixtral": ("llama", SPLIT | NORMS | EXPERTS),  # llama.cpp's Mixtral: a Llama with experts
    # LFM2: its conv layers' tensors (the conv `[C, 1, K]` as llama.cpp's `[C, K]`), its final norm as token_embd_norm
    "lfm2": (
        "lfm2",
        SPLIT
        | NORMS
        | QK_NORMS
        | {"conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"},
    ),
    "phi3": (
        "phi3",
        {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up"}
        | {"mlp.down_proj": "ffn_down"}
        | NORMS,
    ),
}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two rotated halves interleaved (`[H*D, C]` in and out)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def check_writable(model: Decoder, qtype: str) -> None:
    """Refuse, naming what, a model or type this writer cannot produce a faithful GGUF of: one that
    llama.cpp and transformers' GGUF reader (`staticrt convert`) both read as this model. The reader
    takes Gemma 3's query_pre_attn_scalar, local base and layer pattern, and Phi-3's rotary width,
    from its config class's defaults, which the model must then have."""
    c = model.config
    gemma3 = c.family == "gemma3_text"
    unsupported = [
        what
        for what, present in (
            (f"family {c.family!r}", c.family not in ARCHITECTURES),
            ("biases", c.attention_bias or c.qkv_bias or c.mlp_bias),
            (f"rope {c.rope.kind!r}", c.rope.kind != "default"),
            ("a partial rotary", c.rotary_dim != c.head_dim),
            ("quantized weights", model.quantization is not None),
            ("a Mixtral's sliding window, which llama.cpp's Llama lacks", c.family == "mixtral" and c.sliding_window),
            (
                "Gemma 3 settings other than its defaults (query_pre_attn_scalar 256, local base 10000, 5:1 layers)",
                gemma3 and not _gemma3_defaults(c),
            ),
        )
        if present
    ]
    if unsupported or qtype not in GGUF_TYPES:
        raise BenchError(
            f"--gguf {qtype}: writes a float Llama, Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3 or LFM2 model (no "
            f"biases, default RoPE) as {', '.join(GGUF_TYPES)}; this model has "
            f"{', '.join(unsupported) or 'no such type'}: pass a GGUF file of it instead"
        )


def _gemma3_defaults(c: Any) -> bool:
    local = c.rope_local or c.rope
    pattern = tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(c.num_layers))
    return c.query_pre_attn_scalar == 256 and local.theta == 10000.0 and c.layer_types == pattern


def _add_vocabulary(writer: Any, size: int) -> None:
    """Placeholder pieces: 0 unknown, 1 and 2 control (bos, eos), then byte pieces, then the rest."""
    import gguf

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))][:size]
    pieces += [f"<t{i}>" for i in range(len(pieces), size)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    kinds += [gguf.TokenType.BYTE if p.startswith("<0x") else gguf.TokenType.NORMAL for p in pieces[3:]]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types([int(kind) for kind in kinds])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # else transformers' reader keeps a config class's default (Phi-3's 32000)


def _add_hyperparameters(writer: Any, c: ModelConfig) -> None:
    """The keys llama.cpp's loader reads for the architecture's shapes, rope and experts."""
    writer.add_name("staticrt bench model")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    # LFM2 marks its conv layers by 0 K/V heads, as llama.cpp's converter writes them
    kv_heads = [0 if kind == "conv" else c.num_kv_heads for kind in c.layer_types]
    writer.add_head_count_kv(kv_heads if "conv" in c.layer_types else c.num_kv_heads)
    if c.conv_kernel:
        writer.add_shortconv_l_cache(c.conv_kernel)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.rotary_dim)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    if c.num_experts:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.experts_per_token)
        if c.moe_intermediate_size:  # Mixtral's experts are feed_forward_length wide
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        if c.family != "mixtral":  # llama.cpp renormalises a Llama's k weights always
            writer.add_expert_weights_norm(c.router_renormalizes)  # Qwen3-MoE's norm_topk_prob


def write_gguf(model: Decoder, path: str | Path, qtype: str) -> Path:
    """Write `model` to `path` with its projections in `qtype` ("Q8_0", "Q4_0", "Q4_1"; "F32" keeps
    every tensor float, for an exact comparison)."""
    import gguf
    from gguf.quants import quantize

    check_writable(model, qtype)
    c = model.config
    architecture, layer_names = ARCHITECTURES[c.family]
    writer = gguf.GGUFWriter(str(path), architecture)
    _add_hyperparameters(writer, c)
    _add_vocabulary(writer, c.vocab_size)

    def add(name: str, values: np.ndarray, kind: str) -> None:
        if name.endswith("norm.weight") and c.norm_offset:
            values = values + c.norm_offset  # llama.cpp stores Gemma's (1 + w) whole
        if kind == "F32" or values.ndim == 1:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(
                name, quantize(values, gguf.GGMLQuantizationType[kind]), raw_dtype=gguf.GGMLQuantizationType[kind]
            )

    # row-major [out, in] float32, as checkpoints hold it; a fused projection under its own name too
    fused = {
        name: t for name, t in model.named_parameters() if name.endswith(("qkv_proj.weight", "gate_up_proj.weight"))
    }
    state = {name: t.detach().float().contiguous().numpy() for name, t in (model.state_dict() | fused).items()}
    companion = "F32" if qtype == "F32" else "Q8_0"
    add("token_embd.weight", state["embed_tokens.weight"], companion)
    for i in range(c.num_layers):
        for part, short in layer_names.items():
            name = next((n for n in (f"layers.{i}.{part}.weight", f"layers.{i}.{part}") if n in state), None)
            if name is None:  # the other kind of MLP: a MoE model's dense layer, or its experts' names on one
                continue
            weight = state[name]
            if short in ("attn_q", "attn_k") and architecture == "llama":
                heads = c.num_heads if short == "attn_q" else c.num_kv_heads
                weight = _permute(weight, heads)
            if short == "ffn_gate_up_exps":  # llama.cpp keeps the experts' gate and up apart, [E, I, H] each
                gate, up = np.split(weight, 2, axis=1)
                add(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate), qtype)
                add(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(up), qtype)
                continue
            if short == "shortconv.conv":  # [C, 1, K] -> [C, K], float as llama.cpp keeps it
                weight = weight.squeeze(1)
            float_kept = weight.ndim == 1 or short in ("ffn_gate_inp", "shortconv.conv")
            add(f"blk.{i}.{short}.weight", weight, "F32" if float_kept else qtype)
    add(f"{'token_embd_norm' if architecture == 'lfm2' else 'output_norm'}.weight", state["norm.weight"], "F32")
    if "lm_head.weight" in state:  # a tied head is the embedding, which llama.cpp reads when `output` is absent
        add("output.weight", state["lm_head.weight"], companion)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
