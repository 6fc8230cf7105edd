"""llama.cpp as a contender (llama-cpp-python, the `llamacpp` extra; it builds llama.cpp from
source): the GGUF it runs, greedy, timed token by token with the bench's thread count. Its
weights are its own quantization of the model, so its tokens are reported, not compared."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BenchError
from .contenders import Contender


def llamacpp_contender(
    gguf: str | Path, prompts: list[list[int]], new_tokens: int, source: str | None = None
) -> Contender:
    """llama.cpp's decode of `gguf` on the first prompt, batch 1, after one warm-up generation.
    `source`: where the file came from when it is not the user's (the report names it instead)."""
    try:
        import llama_cpp
    except ImportError:
        raise BenchError(
            "--gguf runs llama.cpp through llama-cpp-python: pip install 'staticrt[llamacpp]' (builds from source)"
        ) from None
    prompt = prompts[0]
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        str(gguf),
        n_ctx=len(prompt) + new_tokens,
        n_batch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:  # [V], the last evaluated token's (llama.cpp keeps no others)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))

    def generate() -> tuple[list[int], float, list[float]]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - start
        tokens, steps = [], []
        for _ in range(new_tokens):
            token = int(np.argmax(last_logits()))
            tokens.append(token)
            start = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - start)
        return tokens, prefill_s, steps

    start = time.perf_counter()
    tokens, _, _ = generate()
    warmup_s = time.perf_counter() - start

    def run() -> tuple[float, float]:
        _, prefill_s, steps = generate()
        return prefill_s, statistics.median(steps)

    size = Path(gguf).stat().st_size

    def report() -> dict[str, Any]:
        return {"gguf": source or str(gguf), "gguf_bytes": size}

    return Contender(run, [tokens], warmup_s, report)
