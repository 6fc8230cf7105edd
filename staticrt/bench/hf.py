"""transformers as a contender: its own static-cache `generate`, decode step compiled, on the very
weights staticrt runs, timed token by token; and beside an int8 cache, its QuantizedCache."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..loading.checkpoint_layouts import falcon_h1_names, granite_hybrid_names, lfm2_names
from ..loading.config_to_hf import config_to_hf
from ..models.decoder import Decoder
from .contenders import Contender
from .plan import QUANTO_CACHE
from .probes import stored_bytes


def hf_model_like(model: Decoder) -> Any:
    """A transformers model holding the very same weights as `model`."""
    import transformers

    dtype = next(model.parameters()).dtype
    cfg = transformers.AutoConfig.for_model(**config_to_hf(model.config))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ours = model.state_dict()
    names = {"lfm2": lfm2_names, "granitemoehybrid": granite_hybrid_names, "falcon_h1": falcon_h1_names}
    rename = names.get(model.config.family)
    if rename is not None:  # the families benched against transformers whose names differ
        ours = rename(ours)
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in ours.items()}
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)  # a name that does not match must not leave random weights
    return hf


class TokenClock:
    """A transformers streamer that timestamps every `put`: the prompt first, then each token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


# transformers' QuantizedCache on optimum-quanto, at its lowest-error setting (quanto takes 2 or 4
# bits, no 8): int4 in groups of 64 with a scale and shift each, the newest 128 entries kept in
# full precision and the whole cache re-quantized when they fill. It cannot be compiled.
QUANTO_CONFIG = {"backend": "quanto", "nbits": 4}


def hf_contender(model: Decoder, prompts: list[list[int]], new_tokens: int, cache: str = "static") -> Contender:
    """transformers' own static-cache `generate` with its decode step compiled by torch.compile
    (fullgraph, static shapes), or with `cache` QUANTO_CACHE its QuantizedCache (eager), on the
    same weights, timed token by token through a streamer. The quantized run reports the bytes
    its cache holds once generation ends (`cache_device_bytes`), measured on its tensors."""
    from transformers import CompileConfig

    device = next(model.parameters()).device
    hf = hf_model_like(model).to(device)
    ids = torch.tensor(prompts, device=device)
    kwargs: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    if cache == QUANTO_CACHE:
        kwargs.update(cache_implementation="quantized", cache_config=QUANTO_CONFIG)
    else:
        # Its sliding-window layers branch on a Python int length that grows every step: with
        # static shapes that is a recompile a token (and a hard failure under fullgraph), so
        # there dynamo may turn the int symbolic after the first recompile.
        dynamic = None if model.config.sliding_window else False
        compile_config = CompileConfig(fullgraph=True, dynamic=dynamic, mode="default")
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
        kwargs.update(cache_implementation="static", compile_config=compile_config)
    held: dict[str, Any] = {}

    def generate() -> tuple[float, float, list[list[int]]]:
        clock = TokenClock()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, streamer=clock, **kwargs)
        first = clock.stamps[1] if len(clock.stamps) > 1 else time.perf_counter()
        gaps = np.diff(clock.stamps[1:])
        if cache == QUANTO_CACHE:
            held.update(cache_device_bytes=cache_bytes(out.past_key_values), cache_host_bytes=0)
        return first - start, float(np.median(gaps)), out.sequences[:, ids.shape[1] :].tolist()

    start = time.perf_counter()
    _, _, tokens = generate()
    return Contender(lambda: generate()[:2], tokens, time.perf_counter() - start, lambda: dict(held))


def cache_bytes(cache: Any) -> int:
    """Bytes a transformers cache's layers hold in tensors (a quantized one's packed data, scales
    and shifts, and its full-precision residual)."""
    return sum(
        stored_bytes(value)
        for layer in cache.layers
        for value in vars(layer).values()
        if isinstance(value, torch.Tensor)
    )
