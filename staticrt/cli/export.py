"""`staticrt export`: a model and its cache to an artifact folder, from a recipe or from options."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..artifacts.manifest import FORMATS
from ..errors import ArtifactError, ConfigError
from .console import console, progress

if TYPE_CHECKING:
    from ..models.decoder import Decoder
    from ..models.quant_spec import QuantSpec


def cmd_export(args: argparse.Namespace) -> int:
    from ..artifacts.write import check_target
    from ..caches import CacheSpec
    from ..exporters import check_exportable, export_artifact
    from ..loading.checkpoint import load_model, stored_quantization
    from ..loading.gguf_folders import local_checkpoint
    from ..models.quant_spec import parse_quantize

    recipe = _recipe(args)
    checkpoint = local_checkpoint(recipe.model)  # a .gguf file: the folder it converts into once
    # The torch formats export torchao's weights; the ONNX graph quantizes the float weights itself.
    onnx = "onnx" in recipe.formats
    stored = stored_quantization(checkpoint)
    if stored is not None and onnx:
        raise ConfigError(
            f"{recipe.model} holds {stored.name} codes kept from a GGUF (staticrt convert --keep-quantized), and "
            "an ONNX graph quantizes float weights itself (MatMulNBits): convert the GGUF without --keep-quantized "
            f"and export that folder with --format onnx --quantize {stored.name}, or export this one to pt2"
        )
    spec = parse_quantize(recipe.quantize) or stored
    check_exportable(spec and spec.name, recipe.formats)
    out = args.out or Path("artifacts") / recipe.name
    check_target(out)
    model = load_model(checkpoint, dtype=recipe.dtype, quantize=None if onnx else recipe.quantize)

    def copy_tokenizer(folder: Path) -> None:
        """What a client needs beside the programs: the tokenizer, its chat template, the eos ids."""
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            source = Path(checkpoint) / name
            if source.is_file():
                (folder / name).write_bytes(source.read_bytes())

    def stage(what: str, seconds: float) -> None:
        console.print(f"  [green]done[/] {what} ({seconds:.1f} s)")

    console.print(
        f"exporting {recipe.model} ({recipe.cache} cache, batch {recipe.batch_size}, max_cache_len "
        f"{recipe.max_cache_len}, prefill buckets {list(recipe.prefill_buckets)}"
        f"{f', {_weights_name(spec, model)} weights' if spec else ''}) to {out}"
    )
    start = time.perf_counter()
    with progress("tracing, lowering and compiling (AOTInductor takes tens of seconds a program)"):
        export_artifact(
            model,
            CacheSpec(recipe.cache, recipe.batch_size, recipe.max_cache_len, recipe.window),
            recipe.prefill_buckets,
            out,
            recipe.formats,
            {"recipe": recipe.to_dict()},
            stage,
            copy_tokenizer,
            spec,
        )
    console.print(
        f"wrote {out} in {time.perf_counter() - start:.1f} s; {_next_command(out)}",
        soft_wrap=True,  # one line: the command can be copied
    )
    return 0


def _next_command(artifact: Path) -> str:
    """What to try first with the artifact: a chat for a model with a chat template, text for one
    with a tokenizer, token ids for a preset (which has neither)."""
    from ..text.chat_template import read_chat_template

    if read_chat_template(artifact) is not None:
        return f"chat with it: staticrt chat {artifact}"
    if (artifact / "tokenizer.json").is_file():
        return f'run it with: staticrt run {artifact} --prompt "Hello"'
    return f"run it with: staticrt run {artifact} --prompt-ids 1,2,3"


def _recipe(args: argparse.Namespace) -> Any:
    """The recipe file (its formats overridden by --format), or one made of --model and its options."""
    from ..caches import resolve_max_cache_len
    from ..exporters.recipe import Recipe, read_recipe
    from ..loading.checkpoint import load_config

    formats = tuple(f.strip() for f in (args.format or "").split(",") if f.strip())
    if args.recipe is not None:
        recipe = read_recipe(args.recipe)
        return dataclasses.replace(recipe, formats=formats) if formats else recipe
    if not (args.model and args.out):
        raise ArtifactError("give a recipe (export/NAME.toml), or --model and --out")
    config = load_config(args.model)
    max_cache_len = resolve_max_cache_len(config, args.cache, args.max_cache_len, window=args.window)
    return Recipe(
        name=args.out.name,
        model=args.model,
        cache=args.cache,
        batch_size=args.batch_size,
        max_cache_len=max_cache_len,
        prefill_buckets=tuple(args.prefill_buckets or (max_cache_len,)),
        formats=formats or FORMATS,
        dtype=args.dtype,
        window=args.window,
        quantize=args.quantize,
    )


def _weights_name(spec: QuantSpec, model: Decoder) -> str:
    """What the banner calls the weights: the torch formats' as loaded ("int8" chose its kernels),
    an ONNX graph's by their grid (ONNX Runtime's kernels run it)."""
    return model.quantization.name if model.quantization is not None else spec.layout
