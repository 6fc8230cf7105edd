"""`staticrt bench --speculative ngram[:K]` (or `--draft MODEL[:K]`): decode speed with and without
speculation, side by side.

The prompts ship here: copy-heavy tasks (a paragraph to rewrite, code to edit, text to repeat),
where prompt lookup drafts well, and open-ended chat, where it drafts badly and the speculator
must step aside. Each prompt runs greedily without and with speculation in alternating rounds in
one process (the tokens must agree), and transformers' `generate` on the same weights without and
with its `prompt_lookup_num_tokens` (with a draft model: its assisted generation, `assistant_model`
on the draft model's weights) in the same run. Decode speed is decode tokens over decode time: the
first token (prefill) and compiling are left out of both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import GenerationError

PARAGRAPH = (
    "The old lighthouse stands at the end of a narrow stone pier. For more than a century its keepers climbed "
    "the hundred and twelve steps every evening to light the lamp, and ships passing the reef at night steered "
    "by its beam. Today the light is automatic, and the keeper's cottage has become a small museum where "
    "visitors can see the logbooks, the brass instruments and a photograph of the last keeper and his dog."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item.quantity > 0:
            total = total + item.price * item.quantity
    total = total + total * tax_rate
    return round(total, 2)
"""
TASKS = {
    "copy": (
        f"Rewrite this paragraph in the past tense, changing nothing else:\n\n{PARAGRAPH}",
        f"Rename the function total_price to order_total and return the whole code:\n\n{CODE}",
        f"Repeat this paragraph word for word:\n\n{PARAGRAPH}",
    ),
    "open": (
        "Write a short poem about the sea.",
        "Give me three tips for sleeping better.",
        "Tell me a story about a fox who learns to swim.",
    ),
}


def _decode_rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def _staticrt(gen: Any, prompt: list[int], new_tokens: int, speculative: str | None) -> tuple[list[int], float, Any]:
    tokens = gen.generate([prompt], new_tokens, stop_token_ids=gen.backend.eos_token_ids, speculative=speculative)
    stats = gen.last_stats
    return tokens[0], _decode_rate(stats.decode_tokens, sum(stats.decode_s)), stats


def _transformers(hf: Any, prompt: list[int], new_tokens: int, **speculation: Any) -> tuple[list[int], float | None]:
    """transformers' eager `generate` (its default dynamic cache, which prompt lookup and assisted
    generation need) with `speculation` (none, `prompt_lookup_num_tokens` or `assistant_model`),
    decode tokens over the time from the first token to the last."""
    from .hf import TokenClock

    ids = torch.tensor([prompt])
    clock = TokenClock()
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            streamer=clock,
            pad_token_id=0,
            **speculation,
        )
    end = time.perf_counter()
    tokens = out[0, len(prompt) :].tolist()
    return tokens, _decode_rate(len(tokens) - 1, end - clock.stamps[1]) if len(clock.stamps) > 1 else None


def _rounds(
    gen: Any, hf: Any, prompt: list[int], spec: Any, new_tokens: int, repeats: int, label: str, on_stage: Any
) -> dict[str, Any]:
    """One prompt: a warm-up, then `repeats` rounds of each way in turn; median decode tokens/s.
    `hf`: transformers' model and its speculation keywords (None: not measured)."""
    on_stage(f"{label}: warming up (compiling the graphs it needs, a draft model's included)")
    plain = _staticrt(gen, prompt, new_tokens, None)[0]
    _staticrt(gen, prompt, new_tokens, spec)
    rates: dict[str, list[float]] = {"plain": [], "speculative": [], "hf": [], "hf_speculative": []}
    for round_ in range(repeats):
        on_stage(f"{label}: round {round_ + 1} of {repeats}")
        tokens, rate_off, _ = _staticrt(gen, prompt, new_tokens, None)
        spec_tokens, rate_on, stats = _staticrt(gen, prompt, new_tokens, spec)
        if spec_tokens != plain or tokens != plain:
            raise GenerationError(f"{label}: speculation changed the greedy tokens")
        rates["plain"].append(rate_off)
        rates["speculative"].append(rate_on)
        if hf is not None:
            hf_tokens, rate = _transformers(hf[0], prompt, new_tokens)
            lookup_tokens, lookup_rate = _transformers(hf[0], prompt, new_tokens, **hf[1])
            rates["hf"].append(rate)
            rates["hf_speculative"].append(lookup_rate)
    row: dict[str, Any] = {"new_tokens": len(plain)}
    row |= {f"{name}_tok_s": statistics.median(r) if r else None for name, r in rates.items()}
    row |= {"verify_steps": stats.verify_steps, "decode_steps": len(stats.decode_s)}
    row |= {"drafted": stats.drafted, "accepted": stats.accepted}
    if hf is not None:
        row["hf_tokens_agree"] = hf_tokens == plain and lookup_tokens == hf_tokens
    row["speedup"] = row["speculative_tok_s"] / row["plain_tok_s"]
    return row


def speculative_bench(
    model_path: str,
    speculative: str | None,
    backend: str = "compiled",
    threads: int | None = None,
    new_tokens: int = 128,
    repeats: int = 3,
    with_hf: bool = True,
    on_stage: Callable[[str], None] = lambda _: None,
    draft: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The report: per prompt and per task kind, decode tokens/s without and with speculation
    (medians over `repeats` rounds), their ratio, the drafts' acceptance, and transformers'.
    `speculative` "ngram[:K]", or `draft` (a draft model's checkpoint folder, K) instead."""
    import staticrt

    from ..caches import CacheSpec
    from .contenders import exported_generator
    from .machine import machine

    if threads:
        torch.set_num_threads(threads)
    model = staticrt.load_model(model_path)
    if model.tokenizer is None:
        raise GenerationError(f"{model_path} has no tokenizer.json; the speculative bench sends chat prompts")
    prompts = {
        kind: [model.tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts]
        for kind, texts in TASKS.items()
    }
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_cache_len = 256 * -(-(longest + new_tokens) // 256)
    if backend == "onnx":  # ONNX Runtime over a temporary export of one row (its graph takes any width)
        gen = exported_generator(model, CacheSpec("static", 1, max_cache_len), 16, "onnx", None)[0]
    else:
        gen = staticrt.Generator(model, max_cache_len=max_cache_len, backend=backend)
    spec, hf = _contenders(model, gen, speculative, draft, with_hf)
    rows = []
    for kind, kind_prompts in prompts.items():
        for i, prompt in enumerate(kind_prompts):
            label = f"{kind} prompt {i + 1}"
            rows.append(
                {"kind": kind, "prompt": TASKS[kind][i][:60]}
                | _rounds(gen, hf, prompt, spec, new_tokens, repeats, label, on_stage)
            )
    summary = {}
    for kind in TASKS:
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {"speedup_geomean": statistics.geometric_mean([r["speedup"] for r in mine])}
        if hf is not None:
            summary[kind]["hf_speculative_speedup_geomean"] = statistics.geometric_mean(
                [r["hf_speculative_tok_s"] / r["hf_tok_s"] for r in mine]
            )
    settings = {"model": model_path, "speculative": speculative, "draft": draft and draft[0], "backend": backend}
    settings["threads"] = threads
    settings |= {"new_tokens": new_tokens, "repeats": repeats, "k": spec.k}
    return {"settings": settings, "machine": machine(), "prompts": rows, "summary": summary}


def _contenders(model: Any, gen: Any, speculative: str | None, draft: tuple[str, int] | None, with_hf: bool) -> Any:
    """staticrt's speculation, and transformers' model with its speculation keywords (None without
    `with_hf`): prompt lookup of K tokens; or, with `draft`, a draft model drafting up to K tokens
    a step on both sides (staticrt's Generator over it on `gen`'s backend and positions, and
    transformers' `assistant_model`), whose schedules both start at K (+2 on a clean step, -1 on a miss)."""
    import staticrt

    from ..generation.generator import MODEL_BACKENDS
    from ..generation.speculative import Speculation
    from .hf import hf_model_like

    if draft is None:
        spec = Speculation.parse(speculative)
        return spec, (hf_model_like(model), {"prompt_lookup_num_tokens": spec.k}) if with_hf else None
    draft_model = staticrt.load_model(draft[0])
    drafter = staticrt.Generator(  # an artifact's draft model runs eager, as run's does
        draft_model,
        max_cache_len=gen.backend.max_cache_len,
        backend=gen.backend.name if gen.backend.name in MODEL_BACKENDS else "eager",
    )
    spec = Speculation("model", draft[1], drafter=drafter)
    if not with_hf:
        return spec, None
    assistant = hf_model_like(draft_model)
    assistant.generation_config.num_assistant_tokens = draft[1]
    return spec, (hf_model_like(model), {"assistant_model": assistant})
