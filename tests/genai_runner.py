"""onnxruntime-genai's own generation loop over an exported artifact: the client the ONNX format is for."""

from __future__ import annotations

from typing import Any


def genai_greedy(og: Any, model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from onnxruntime-genai's `Generator` (it stops early at the model's eos)."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
