"""onnxruntime-genai's genai_config.json for an artifact's ONNX graph: what genai reads to run it
as a decoder, and the slack it gives a rotating layer (onnx_export.py writes it beside the graph)."""

from __future__ import annotations

from typing import Any

from ..caches import KVCache

GENAI_CONFIG = "genai_config.json"
GENAI_SLACK = 16  # onnxruntime-genai's default cache_slack (extra slots of a rotating layer)


def genai_config(cache: KVCache, graph: str) -> dict[str, Any]:
    """onnxruntime-genai's description of the graph at `graph` (relative to the artifact): a
    `decoder` whose past and present share one buffer; `context_length` is the positions a row can
    reach (the model's for an all-rotating cache)."""
    c = cache.config
    context = cache.max_sequence_len or c.max_position_embeddings
    decoder: dict[str, Any] = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": graph,
        "head_size": c.head_dim,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_kv_heads,
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            "position_ids": "position_ids",
            "past_key_names": "past_key_values.%d.key",
            "past_value_names": "past_key_values.%d.value",
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": "present.%d.key",
            "present_value_names": "present.%d.value",
        },
    }
    if cache.window is not None:
        # Our rotating layers, described as genai's: a window plus slack slots, never slid or copied.
        decoder["sliding_window"] = {
            "window_size": c.sliding_window,
            "cache_slack": cache.window - c.sliding_window,
            "slide_key_value_cache": False,
            "slide_inputs": False,
            "layers": [i for i, r in enumerate(cache.rotating) if r],
        }
    eos = list(c.eos_token_ids)
    return {
        "model": {
            "type": "decoder",
            "context_length": context,
            "vocab_size": c.vocab_size,
            "decoder": decoder,
            "bos_token_id": c.bos_token_id if c.bos_token_id is not None else 0,
            "eos_token_id": eos[0] if len(eos) == 1 else eos or 0,
            "pad_token_id": c.pad_token_id if c.pad_token_id is not None else (eos[0] if eos else 0),
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": context,
            "min_length": 0,
            "past_present_share_buffer": True,
        },
    }
