"""What `run` and `chat` share: a model or an artifact opened with its tokenizer and its
generation_config.json defaults, bound to a Generator, and the keywords each `generate` takes
from the command line (a flag given wins, then the checkpoint's file, then the library)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GenerationError
from ..text.generation_config import GenerationDefaults, read_generation_defaults


@dataclass
class Source:
    """A loaded model (`model`) or an artifact already bound to its cache (`artifact`)."""

    name: str
    model: Any
    artifact: Any
    tokenizer: Any
    defaults: GenerationDefaults


def open_source(args: argparse.Namespace) -> Source:
    """The --model or the ARTIFACT of the command line, with what its folder holds beside the weights."""
    from ..text.tokenizer import load_tokenizer

    if args.artifact is not None:
        from ..generation.generator import load_artifact

        if args.model:
            raise GenerationError("give an artifact folder or --model, not both")
        if args.device:
            raise GenerationError(
                "an artifact runs where it was built for: pt2 and aoti programs on the device they were exported "
                "on, onnx on CUDA where onnxruntime-gpu sees a GPU; drop --device"
            )
        if args.quantize not in (None, "none") or args.dtype:
            raise GenerationError(
                "an artifact's weights and dtype were fixed when it was exported; drop --quantize/--dtype, or "
                "export again with them: staticrt export --model ... --quantize ..."
            )
        folder = Path(args.artifact)
        tokenizer: list[Any] = []  # parsed while ONNX Runtime initializes the session

        def parse() -> None:
            tokenizer.append(load_tokenizer(folder))

        gen = load_artifact(folder, backend=args.backend, threads=args.threads, beside=parse)
        if args.threads and gen.backend.name != "onnx":  # ONNX Runtime took them; an ONNX artifact loads no torch
            _torch_threads(args.threads)
        return Source(str(folder), None, gen, tokenizer[0], read_generation_defaults(folder))
    if not args.model:
        raise GenerationError("say what to run: --model PRESET_OR_FOLDER, or an artifact folder")
    if args.threads:
        _torch_threads(args.threads)
    from ..loading.checkpoint import load_model
    from ..loading.gguf_folders import local_checkpoint
    from ..models.presets import PRESETS

    device = model_device(args.device, args.backend)
    folder = local_checkpoint(args.model)  # a .gguf file: the folder it converts into once
    # A compiled process owns its model: its graphs' packed weights are the only copy (load_model's `packed`).
    model = load_model(
        folder, dtype=args.dtype, device=device, quantize=args.quantize, packed=args.backend == "compiled"
    )
    defaults = GenerationDefaults() if args.model in PRESETS else read_generation_defaults(folder)
    return Source(args.model, model, None, model.tokenizer, defaults)


def model_device(device: str | None, backend: str | None) -> str:
    """Where --model loads: --device when given, else CUDA for the backends that exist for it
    (cudagraph, reduce-overhead) when torch sees a GPU, else the CPU, as from_pretrained does.
    Without this, `--backend cudagraph` on a GPU machine ran the compiled path on the CPU."""
    import torch

    from ..generation.generator import BACKENDS
    from ..loading.checkpoint import checked_device

    if device is not None:
        return str(checked_device(device))

    entry = BACKENDS.get(backend or "eager")
    return "cuda" if entry is not None and entry.cuda_only and torch.cuda.is_available() else "cpu"


SHAPE_STEP = 256  # positions


def bind(source: Source, args: argparse.Namespace, rows: int, needed: int | None, prefill_buckets: Any = None) -> Any:
    """A Generator for `rows` prompts of up to `needed` positions each (None: the model's context,
    at most 1024, as a conversation or a server needs); an artifact comes bound to the cache it was
    exported with."""
    if source.artifact is not None:
        return source.artifact
    from ..caches import resolve_max_cache_len
    from ..generation.generator import Generator

    config = source.model.config
    if needed is not None and args.backend not in (None, "eager"):
        # Whole steps of a compiled run's shape: the next prompt finds its graphs in the compile cache.
        needed = min(-(-needed // SHAPE_STEP) * SHAPE_STEP, max(needed, config.max_position_embeddings))
    return Generator(
        source.model,
        cache=args.cache,
        max_batch_size=rows,
        max_cache_len=resolve_max_cache_len(config, args.cache, args.max_cache_len, needed, args.window),
        backend=args.backend or "eager",
        prefill_buckets=prefill_buckets,
        window=args.window,
    )


def generate_options(args: argparse.Namespace, source: Source, gen: Any) -> dict[str, Any]:
    """`generate`'s keywords: sampling values given as flags, else generation_config.json's; stop
    ids given, else the model's eos ids."""
    stops = args.stop_ids if args.stop_ids is not None else gen.backend.eos_token_ids
    return {
        "do_sample": args.do_sample,
        "seed": args.seed,
        "stop_token_ids": stops,
        **source.defaults.sampling(args.temperature, args.top_k, args.top_p),
        **({"speculative": spec} if (spec := speculation(args, gen.backend)) is not None else {}),
    }


def speculation(args: argparse.Namespace, backend: Any) -> Any:
    """--speculative as given, or for --draft MODEL[:K] a Speculation whose drafter is a Generator
    over that model, loaded as --model is, on the same backend, with the rows and positions of `backend`."""
    if args.draft is None:
        return args.speculative
    from ..generation.generator import MODEL_BACKENDS, Generator
    from ..generation.speculative import Speculation, check_verifies, parse_draft
    from ..loading.checkpoint import load_model
    from ..loading.gguf_folders import local_checkpoint

    path, k = parse_draft(args.draft, args.speculative)
    check_verifies(backend)  # before the draft model loads
    model = load_model(local_checkpoint(path), dtype=args.dtype, device=model_device(args.device, args.backend))
    drafter = Generator(
        model,
        cache=args.cache,
        max_batch_size=backend.batch_size,
        max_cache_len=backend.max_cache_len,
        backend=args.backend if args.backend in MODEL_BACKENDS else "eager",  # an artifact's draft runs eager
        window=args.window,
    )
    return Speculation("model", k, drafter=drafter)


def _torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
