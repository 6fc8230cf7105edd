"""GGUF file -> Hugging Face checkpoint folder that staticrt (and transformers) loads.

transformers' GGUF loader is the well-kept path: it reads the metadata into a config, maps
llama.cpp's tensor names to transformers' (undoing the Q/K row permutation llama.cpp applies),
dequantizes every weight type the `gguf` library knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K, ...) and rebuilds the tokenizer with its chat template; a Mixtral, which it reads as a
dense Llama, gets its experts from gguf_mixtral.py. staticrt writes the result as plain
safetensors, since transformers refuses to save a model it loaded from GGUF. The folder is written
as an artifact is (`write_folder`): beside the target, swapped in whole, removed on failure or
SIGTERM. Needs the `gguf` extra (gguf, transformers, accelerate).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ..artifacts.write import check_place, write_folder
from ..errors import CheckpointError, first_line
from ..models import gguf_blocks
from .gguf_mixtral import dense_mlp_unreported, is_mixtral, mixtral_parts

EXTRA = "pip install 'staticrt[gguf]'"
# llama.cpp's architecture name -> the family transformers' GGUF reader loads it as, for the
# families staticrt runs (transformers reads these; it reads no GGUF of SmolLM3, OLMo, Granite or Ministral 3)
GGUF_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma2": "gemma2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "qwen3moe": "qwen3_moe",
    "lfm2": "lfm2",
}
Stage = Callable[[str], None]  # what is about to start


def _require_extra() -> None:
    missing = []
    for module in ("gguf", "transformers", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise CheckpointError(f"staticrt convert needs {', '.join(missing)} (the gguf extra): {EXTRA}")


def _check_gguf(source: Path) -> bool:
    """Refuse, before transformers reads it, a file that is not a whole GGUF: empty, another
    format, or cut short (its header names more tensor data than the file holds), or of an
    architecture transformers' reader does not give. True for a Mixtral (gguf_mixtral.py)."""
    import gguf

    with source.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(
            f"{source} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a llama.cpp .gguf file"
        )
    try:
        reader = gguf.GGUFReader(str(source))
    except Exception as err:  # gguf raises ValueError, struct.error, IndexError ... on a cut file
        raise CheckpointError(
            f"{source} cannot be read as GGUF ({type(err).__name__}: {first_line(err)}); the file is truncated "
            "or corrupt: download it again"
        ) from None
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if architecture not in GGUF_FAMILIES:
        raise CheckpointError(
            f"{source.name} holds a {architecture!r} model; staticrt convert reads GGUF through transformers, "
            f"whose reader gives staticrt the architectures {', '.join(GGUF_FAMILIES)}: convert the model's "
            "safetensors checkpoint folder instead (staticrt run --model FOLDER)"
        )
    return is_mixtral(reader, source)


def _kept_projections(source: Path) -> tuple[str, dict[str, Any]]:
    """The spec `source`'s projections load as when kept quantized, and the GGUF tensors to keep
    by the names transformers gives them: every projection, and the embedding and output head
    where they are in a kept type too (they load as float, in the compute dtype); refused, before
    any work, where the projections do not map."""
    import gguf

    projections, others = {}, {}
    for tensor in gguf.GGUFReader(str(source)).tensors:
        block, layer, kind, field = (tensor.name.split(".") + ["", "", ""])[:4]
        if block == "blk" and kind in gguf_blocks.PROJECTIONS and field == "weight":
            projections[f"model.layers.{layer}.{gguf_blocks.PROJECTIONS[kind]}.weight"] = tensor
        elif tensor.name in gguf_blocks.OTHERS and tensor.tensor_type.name in gguf_blocks.SPEC_OF:
            others[gguf_blocks.OTHERS[tensor.name]] = tensor
    types = Counter(t.tensor_type.name for t in projections.values())
    specs = {gguf_blocks.SPEC_OF.get(qtype) for qtype in types}
    if len(specs) != 1 or None in specs:
        found = ", ".join(f"{count} {qtype}" for qtype, count in types.items()) or "none"
        raise CheckpointError(
            f"--keep-quantized keeps projections that are all Q8_0 (as int8-wo) or all Q4_0/Q4_1 (as int4-g32); "
            f"{source.name}'s are {found}. Convert without --keep-quantized (float32 weights) and load with "
            "--quantize int8 or int4"
        )
    return specs.pop(), projections | others


def _kept_blocks(projections: dict[str, Any], state: dict[str, Any], source: str) -> dict[str, gguf_blocks.Blocks]:
    """Each projection's blocks in the rows of `state`'s float weight of the same name, which must
    hold exactly their dequantized values.

    transformers un-permutes the rows llama.cpp permuted (Q and K); the rows are matched to the
    float weights by their exact values rather than by re-implementing that, so the codes follow
    whatever row order transformers produces, and anything but a reordering is refused.
    """
    import numpy as np
    import torch

    kept = {}
    for name, tensor in projections.items():
        if name not in state and name == "lm_head.weight":
            continue  # a tied head: the embedding, kept under its own name
        blocks = gguf_blocks.read_blocks(np.asarray(tensor.data), tensor.tensor_type.name)
        exact = gguf_blocks.dequantize(blocks)  # [N, K] float32, in the GGUF's row order
        # + 0.0 makes -0.0 (Q4_0's d * 0 with d < 0) +0.0: rows equal in value hash alike
        row_of = {(row + 0.0).numpy().tobytes(): i for i, row in enumerate(exact)}
        rows = [row_of.get((row + 0.0).numpy().tobytes()) for row in state[name]] if name in state else [None]
        if None in rows:
            raise CheckpointError(
                f"{source}: {tensor.name} is not a reordering of the rows transformers dequantized for {name}; "
                "this architecture's projections cannot be kept quantized: convert without --keep-quantized"
            )
        kept[name] = gguf_blocks.take_rows(blocks, torch.tensor(rows))
    return kept


def convert_gguf(source: Path, target: Path, on_stage: Stage = lambda what: None, keep_quantized: bool = False) -> Path:
    """Write the checkpoint folder `target` (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and the chat template, generation_config.json) from the GGUF `source`.

    `keep_quantized`: the projections keep the GGUF's Q4_0/Q4_1/Q8_0 blocks (gguf_blocks.py)
    instead of being written as float32; the folder then loads quantized (int4-g32 or int8) with
    the quant extra, and transformers no longer reads it."""
    source, target = Path(source), Path(target)
    if not source.is_file() or source.suffix != ".gguf":
        raise CheckpointError(f"{source} is not a .gguf file; pass the path of one (e.g. model.Q4_K_M.gguf)")
    check_place(target, "the output", "choose a new output folder", CheckpointError)
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} exists and is not an empty folder; choose a new output folder")
    _require_extra()
    with _read_once():  # one parse of the file for every reader of it
        mixtral = _check_gguf(source)
        spec, projections = _kept_projections(source) if keep_quantized else (None, {})
        import torch
        import transformers
        from safetensors.torch import save_file

        folder, name = str(source.parent), source.name

        def build(work: Path) -> None:
            on_stage("tokenizer and chat template")
            transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(work)
            on_stage("dequantizing the weights")
            with dense_mlp_unreported() if mixtral else nullcontext():
                model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            if mixtral:
                on_stage("dequantizing the experts (transformers' reader reads a Llama without them)")
                config, state = mixtral_parts(source, model)
            else:
                config, state = model.config, model.state_dict()
            state = {k: v.contiguous() for k, v in state.items()}
            if config.tie_word_embeddings:
                state.pop("lm_head.weight", None)  # the embedding, shared
            if hasattr(config, "quantization_config"):
                del config.quantization_config  # the float weights written are plain float32
            if keep_quantized:
                on_stage(f"keeping the codes of {len(projections)} tensors (projections as {spec})")
                for weight, blocks in _kept_blocks(projections, state, name).items():
                    del state[weight]
                    state.update({f"{weight}.{field}": tensor for field, tensor in blocks.items()})
                config.quantization_config = {"quant_method": gguf_blocks.QUANT_METHOD, "weights": spec}
            on_stage("writing model.safetensors")
            save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(work)
            model.generation_config.save_pretrained(work)

        with _quiet():
            return write_folder(target, build, CheckpointError)


@contextmanager
def _read_once() -> Iterator[None]:
    """Every `gguf.GGUFReader` of a file made in the block is its first one. Ours and transformers'
    (config, tokenizer, weights) read the file five times, and a reader parses every metadata field
    on construction: SmolLM2's 49,152-piece vocabulary took 8.3 s a read on a 2-core EPYC, 42 s of
    a 65 s conversion. The readers only read."""
    import gguf

    original, made = gguf.GGUFReader, {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in made:
            made[key] = original(path, mode)
        return made[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' conversion without its tqdm bars (drawn mid-line under our stages) and
    torchao's import noise. Its GGUF reader calls tqdm itself, past transformers' switch for bars,
    and tqdm reads its environment once, at import: that reader's tqdm is swapped for the block."""
    import functools

    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from ..models.quantize import quiet_imports

    bars, reader_tqdm = transformers.utils.logging.is_progress_bar_enabled(), gguf_utils.tqdm
    transformers.utils.logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(reader_tqdm, disable=True)
    try:
        with quiet_imports():
            yield
    finally:
        gguf_utils.tqdm = reader_tqdm
        if bars:
            transformers.utils.logging.enable_progress_bar()
