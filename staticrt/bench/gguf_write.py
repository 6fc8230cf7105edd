"""A Llama- or Qwen3-family `Decoder` written as a GGUF file llama.cpp runs, so `bench --gguf Q4_0`
can time llama.cpp on the very weights staticrt runs (a preset has no GGUF of its own).

The layout is llama.cpp's own converter's (convert_hf_to_gguf.py, `LlamaModel` and `Qwen3Model`):
its tensor names, Llama's Q and K rows permuted for its interleaved RoPE (Qwen's rotate in halves,
as transformers does, and keep their order), Qwen3's q/k norms, the projections in the asked block type
(quantized by the gguf library, llama.cpp's reference code in NumPy), the embedding and head in
Q8_0 as 8-bit companions, norms in F32. Presets have no tokenizer: the vocabulary is placeholder
pieces (byte pieces where they fit), since the bench feeds token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BenchError
from ..models.decoder import Decoder
from ..models.gguf_blocks import PROJECTIONS
from .plan import GGUF_TYPES  # what `bench --gguf` writes; F32 too, for an exact comparison

# checkpoint name inside a layer -> llama.cpp's: the projections as convert reads them, and the norms
PARTS = {hf: short for short, hf in PROJECTIONS.items()} | {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
ARCHITECTURES = ("llama", "qwen3")  # the families written; llama.cpp's architecture of the same name


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two rotated halves interleaved (`[H*D, C]` in and out)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def check_writable(model: Decoder, qtype: str) -> None:
    """Refuse, naming what, a model or type this writer cannot produce a faithful GGUF of."""
    c = model.config
    unsupported = [
        what
        for what, present in (
            (f"family {c.family!r}", c.family not in ARCHITECTURES),
            ("biases", c.attention_bias or c.qkv_bias or c.mlp_bias),
            (f"rope {c.rope.kind!r}", c.rope.kind != "default"),
            ("quantized weights", model.quantization is not None),
        )
        if present
    ]
    if unsupported or qtype not in (*GGUF_TYPES, "F32"):
        raise BenchError(
            f"--gguf {qtype}: writes a float Llama or Qwen3 model (no biases, default RoPE) as "
            f"{', '.join(GGUF_TYPES)}; this model has {', '.join(unsupported) or 'no such type'}: pass a GGUF "
            "file of it instead"
        )


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


def write_gguf(model: Decoder, path: str | Path, qtype: str) -> Path:
    """Write `model` to `path` with its projections in `qtype` ("Q8_0", "Q4_0", "Q4_1"; "F32" keeps
    every tensor float, for an exact comparison)."""
    import gguf
    from gguf.quants import quantize

    check_writable(model, qtype)
    c = model.config
    writer = gguf.GGUFWriter(str(path), c.family)
    writer.add_name("staticrt bench model")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    _add_vocabulary(writer, c.vocab_size)

    def add(name: str, values: np.ndarray, kind: str) -> None:
        if kind == "F32" or values.ndim == 1:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(
                name, quantize(values, gguf.GGMLQuantizationType[kind]), raw_dtype=gguf.GGMLQuantizationType[kind]
            )

    # row-major [out, in] float32, as checkpoints hold it
    state = {name: t.detach().float().contiguous().numpy() for name, t in model.state_dict().items()}
    companion = "F32" if qtype == "F32" else "Q8_0"
    add("token_embd.weight", state["embed_tokens.weight"], companion)
    for i in range(c.num_layers):
        for part, short in PARTS.items() | (QK_NORMS.items() if c.qk_norm else {}.items()):
            weight = state[f"layers.{i}.{part}.weight"]
            if short in ("attn_q", "attn_k") and c.family == "llama":
                heads = c.num_heads if short == "attn_q" else c.num_kv_heads
                weight = _permute(weight, heads)
            add(f"blk.{i}.{short}.weight", weight, qtype)
    add("output_norm.weight", state["norm.weight"], "F32")
    if "lm_head.weight" in state:  # a tied head is the embedding, which llama.cpp reads when `output` is absent
        add("output.weight", state["lm_head.weight"], companion)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
