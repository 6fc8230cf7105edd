"""Tiny random-weight transformers checkpoints, one per family, written with `save_pretrained`.

They are the oracle: staticrt loads them through its own loader and must reproduce transformers'
eager forward and `generate`. Weights are redrawn wider than transformers' default init so that
logits are spread and greedy choices are not decided by rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def family_config(family: str, **overrides):
    import transformers as tf

    if family == "llama":
        cfg = tf.LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif family == "llama-linear-tied":
        cfg = tf.LlamaConfig(
            **{**COMMON, "num_key_value_heads": 1},
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        )
    elif family == "mistral":
        cfg = tf.MistralConfig(**COMMON, sliding_window=None)
    elif family == "mistral-sw16":  # every layer attends through a window of 16
        cfg = tf.MistralConfig(**COMMON, sliding_window=16)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**COMMON, "num_key_value_heads": 1})
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**COMMON, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_hf_model(family: str, seed: int = 0, **overrides):
    import transformers as tf

    cfg = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(noise * 0.1 + (0.0 if cfg.model_type == "gemma2" else 1.0))
            else:  # a small embedding keeps tied heads from just echoing the input token
                param.copy_(noise * (0.02 if "embed" in name else 0.15))
    return model


def save_hf_model(family: str, folder: Path, seed: int = 0, **overrides):
    model = build_hf_model(family, seed, **overrides)
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int, **options) -> list[int]:
    """transformers' eager `generate`, one unpadded row at a time: the reference each row of a
    staticrt batch must reproduce. `options` go to `generate` (num_beams, eos_token_id, ...)."""
    ids = torch.tensor([prompt])
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0) | options
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **settings)
    return out[0, len(prompt) :].tolist()
