"""The one registry: every backend name, what it runs (a model or an artifact), and how it is built.

Backends are imported only when built, by module name, so a deploy path that needs no torch (an
ONNX artifact) never imports it; this module imports no torch itself. `Generator` is the public
face over any of them: a model (or an artifact) bound to a cache and a backend.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts.manifest import FORMATS, read_manifest, require_format, verify_files
from ..errors import ArtifactError, GenerationError, as_int
from .beam_search import BeamParams, beam_search_tokens
from .grammar import Grammar
from .logit_bias import bias_rule
from .logprobs import TokenLogprob
from .loop import MAX_NEW_TOKENS, GenerationStats, StepBackend, StreamCallback, generate_tokens
from .params import SamplingParams
from .speculative import Speculation


@dataclass(frozen=True)
class BackendEntry:
    """One backend: `runs` "model" (a loaded `Decoder`) or "artifact" (a folder of format `name`);
    built by `module.cls`; `cuda_only` ones run the compiled path, with a warning, without CUDA."""

    name: str
    runs: str
    module: str
    cls: str
    cuda_only: bool = False

    def build(self, *args: Any, **options: Any) -> StepBackend:
        return getattr(importlib.import_module(f"staticrt.backends.{self.module}"), self.cls)(*args, **options)


BACKENDS = {
    entry.name: entry
    for entry in (
        BackendEntry("eager", "model", "eager", "EagerBackend"),
        BackendEntry("compiled", "model", "compiled", "CompiledBackend"),
        BackendEntry("cudagraph", "model", "cudagraph", "CudaGraphBackend", cuda_only=True),
        BackendEntry("reduce-overhead", "model", "reduce_overhead", "ReduceOverheadBackend", cuda_only=True),
        # artifact backends, in the order a default is picked (FORMATS' order)
        BackendEntry("aoti", "artifact", "exported", "ExportedBackend"),
        BackendEntry("pt2", "artifact", "exported", "ExportedBackend"),
        BackendEntry("onnx", "artifact", "onnx", "OnnxBackend"),
    )
}
MODEL_BACKENDS = tuple(name for name, entry in BACKENDS.items() if entry.runs == "model")
ARTIFACT_BACKENDS = tuple(name for name, entry in BACKENDS.items() if entry.runs == "artifact")
assert ARTIFACT_BACKENDS == FORMATS, "each artifact format has the backend of its name"


def create_backend(name: str, model: Any, **options: Any) -> StepBackend:
    """The model backend `name` over `model` (options: cache, max_batch_size, max_cache_len, ...)."""
    entry = BACKENDS.get(name)
    if entry is None:
        raise GenerationError(f"backend {name!r} is unknown; choose one of {', '.join(MODEL_BACKENDS)}")
    if entry.runs == "artifact":
        raise GenerationError(
            f"backend {name!r} runs an exported artifact, not a model: export one (`staticrt export`, "
            f"format {name}) and load it with staticrt.load_artifact(path, backend={name!r}) or "
            f"`staticrt run ARTIFACT --backend {name}`"
        )
    return entry.build(model, **options)


def load_artifact(
    path: str | Path,
    backend: str | None = None,
    threads: int | None = None,
    beside: Callable[[], Any] | None = None,
) -> Generator:
    """A `Generator` over the artifact in `path`, checked before it is returned: its manifest first,
    its files' hashes before a torch program loads or beside ONNX Runtime's session.

    `backend` picks what runs: "aoti" (AOTInductor packages), "pt2" (torch.export programs) or
    "onnx" (ONNX Runtime; imports neither torch nor the model code); by default the first of those
    the artifact holds. `threads` sets ONNX Runtime's intra-op threads (torch's are torch's).
    `beside()` is work for this thread while ONNX Runtime initializes the session (`run` parses
    the tokenizer there); it runs after the load for a torch program.
    """
    folder = Path(path)
    threads = None if threads is None else as_int(threads, "threads", 1, ArtifactError)
    manifest = read_manifest(folder, verify=False)
    backend = backend or next((b for b in ARTIFACT_BACKENDS if b in manifest["formats"]), None)
    require_format(folder, manifest, backend)
    if backend != "onnx":  # a program's native code is loaded only from files that passed their hashes
        verify_files(folder, manifest["files"])
        gen = Generator(BACKENDS[backend].build(folder, backend, manifest))
        if beside is not None:
            beside()
        return gen
    # ONNX Runtime parses and checks what it reads, so its session is made in a worker thread while
    # this one takes the files' hashes (hashlib releases the GIL: SmolLM2's 106 MB int4 artifact
    # hashes in 0.08 s), checked before the backend is returned; the backend waits for them before
    # it writes anything from the files (`verified`). A file that fails its hash is the error heard
    # first. ONNX Runtime holds the GIL only while it loads the graph, which the hashes outlast, so
    # `beside()` (the tokenizers library holds the GIL throughout its parse) overlaps the session's
    # initialization rather than stalling its load.
    hashed: Future[None] = Future()
    with ThreadPoolExecutor(1) as pool:
        options = {"threads": threads, "verified": hashed.result}
        building = pool.submit(BACKENDS[backend].build, folder, backend, manifest, **options)
        try:
            verify_files(folder, manifest["files"])
            hashed.set_result(None)
            if beside is not None:
                beside()
        except BaseException as err:
            if not hashed.done():
                hashed.set_exception(err)
            wait([building])
            raise
        return Generator(building.result())


def _call_options(
    num_beams: Any,
    length_penalty: Any,
    early_stopping: Any,
    sampling: SamplingParams,
    stream: Any,
    speculative: Any,
    reuse_prefix: Any,
) -> BeamParams | None:
    """A `generate` call's options checked before anything runs; the beam search it asks for (None: one beam)."""
    if not isinstance(reuse_prefix, bool):
        raise GenerationError(f"reuse_prefix is {reuse_prefix!r}; it must be True or False")
    params = BeamParams(num_beams, length_penalty, early_stopping).checked()
    if params.num_beams == 1:
        return None
    if sampling.do_sample:
        raise GenerationError(
            f"num_beams={params.num_beams} with do_sample=True (beam sampling) is not supported; pass "
            "do_sample=False for beam search, or num_beams=1 to sample"
        )
    if stream is not None:
        raise GenerationError(
            "beam search cannot stream: which beam wins is known only at the end; pass stream=None, "
            "or num_beams=1 to stream tokens as they come"
        )
    if speculative is not None:
        raise GenerationError("beam search does not speculate; pass num_beams=1 or speculative=None")
    if sampling.rule is not None:
        raise GenerationError(
            "beam search takes no logit_bias, penalties or grammar yet; pass num_beams=1 for them, or leave them out"
        )
    if sampling.logprobs is not None:
        raise GenerationError("beam search returns no logprobs; pass num_beams=1 for them, or logprobs=None")
    return params


class Generator:
    """A model bound to a cache and a backend, for repeated generation with fixed shapes.

    `model` is a `Decoder` (from `staticrt.load_model`) or an already built `StepBackend`.
    `cache` is "static", "sliding" (every layer a rotating buffer of `window` slots), "hybrid"
    (rotating buffers for sliding layers only), "offloaded" (every layer's K/V in host memory,
    two device working buffers), "offloaded-hybrid" (a hybrid cache with its global layers
    offloaded) or "auto" (what the model's config implies); or a cache already built (e.g.
    `staticrt.build_cache(model.config, ...)`), whose spec then sets batch size, length and window.
    `window` defaults to the model's `sliding_window`; `max_batch_size` to 1. Building the torch
    backends imports torch; this module itself does not.

    A Generator may be shared between threads: its one cache holds one generation at a time, so
    concurrent `generate` calls are serialised (each waits for the one under way). A `stream`
    callback that calls `generate` on the same Generator is refused, since it would overwrite the
    cache of the generation that called it.
    """

    def __init__(
        self,
        model: Any,
        cache: Any = "static",
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
        backend: str = "eager",
        prefill_buckets: Sequence[int] | None = None,
        window: int | None = None,
    ) -> None:
        if hasattr(model, "step") and hasattr(model, "buckets"):
            self.backend: StepBackend = model
        else:
            self.backend = create_backend(
                backend,
                model,
                cache=cache,
                max_batch_size=max_batch_size,
                max_cache_len=max_cache_len,
                prefill_buckets=prefill_buckets,
                window=window,
            )
        self.last_stats = GenerationStats()
        self.last_logprobs: list[list[TokenLogprob]] | None = None  # the last call's, where it asked (`generate`)
        # The ids each row's cache holds, as fed (prefix.py): what `reuse_prefix` continues from.
        self.held: list[list[int]] = [[] for _ in range(self.backend.batch_size)]
        self._lock = threading.Lock()
        self._running_in: int | None = None  # the thread whose `generate` holds the cache

    def _refuse_reentry(self) -> None:
        """A `stream` callback that calls `generate` would overwrite its caller's cache."""
        if self._running_in == threading.get_ident():
            raise GenerationError(
                "generate was called again while this thread's generate is under way (from its stream "
                "callback?); the Generator's one cache holds one generation at a time: collect the tokens in "
                "the callback and call generate after it returns, or use a second Generator"
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = MAX_NEW_TOKENS,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = (),
        stream: StreamCallback | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        reuse_prefix: bool = False,
        speculative: str | Speculation | None = None,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
    ) -> list[list[int]]:
        """New token ids per prompt; timings of the call land in `self.last_stats`.

        `num_beams` > 1 runs beam search as transformers' `generate(num_beams=N, do_sample=False)`
        does (`length_penalty`, `early_stopping` as there): each prompt takes N rows of the cache,
        so prompts x num_beams must fit in max_batch_size; it returns each prompt's best beam.

        `reuse_prefix`: prompt r continues row r of the cache from the longest prefix it shares
        with what the row holds (`self.held[r]`: the previous call's prompt and the tokens fed
        after it) and prefills only the rest, where that is exact (generation/prefix.py); a chat's
        next turn passes the whole conversation and pays for the new turn alone. The tokens are
        those of a whole prefill; `last_stats.kept` says how many each row kept.

        `speculative` "ngram[:K]": a step may verify K tokens drafted from the row's own, greedy or
        sampling (generation/speculative.py); `last_stats` counts verify steps and accepted drafts.

        `logit_bias` {token id: bias in [-100, 100]}, `presence_penalty` and `frequency_penalty` ([-2, 2],
        vLLM's definition) and a `grammar` (`staticrt.json_schema_grammar`, `text_grammar`; stop at the eos
        ids) bias each row's logits before its choice (generation/logit_bias.py, grammar.py). With
        `logprobs` k (0 to 20), `self.last_logprobs` holds each row's `TokenLogprob`s, the model's own
        (generation/logprobs.py), each with its k most likely tokens'; None where not asked."""
        self._refuse_reentry()
        rule = bias_rule(logit_bias, presence_penalty, frequency_penalty, grammar)
        sampling = SamplingParams(do_sample, temperature, top_k, top_p, seed, rule, logprobs=logprobs)
        beams = _call_options(num_beams, length_penalty, early_stopping, sampling, stream, speculative, reuse_prefix)
        with self._lock:
            self._running_in = threading.get_ident()
            try:
                stats, found = GenerationStats(), [] if logprobs is not None else None
                if beams is None:
                    asked = (prompts, max_new_tokens, sampling, stop_token_ids, stream, stats, self.held, reuse_prefix)
                    tokens = generate_tokens(self.backend, *asked, speculative, found)
                else:
                    self.held[:] = [[] for _ in self.held]  # beams reorder and overwrite rows
                    tokens = beam_search_tokens(self.backend, prompts, max_new_tokens, beams, stop_token_ids, stats)
                self.last_stats, self.last_logprobs = stats, found
                return tokens
            finally:
                self._running_in = None
