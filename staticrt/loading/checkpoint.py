"""Hugging Face checkpoint folder -> `Decoder` (safetensors only) and its tokenizer.

Also builds the built-in presets: seeded random weights with no files, for the demo and tests.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..dtypes import resolve_dtype
from ..errors import CheckpointError, ConfigError
from ..models import gguf_blocks
from ..models.decoder import Decoder, init_random, use_column_major_weights
from ..models.packed_linear import pack, packs
from ..models.presets import PRESETS
from ..models.quant_spec import QuantSpec, parse_quantize
from ..models.quantize import kernels_for, quantize_weights, quantized_dtype
from ..text.generation_config import read_generation_defaults
from ..text.tokenizer import load_tokenizer
from . import mxfp4
from .gguf_folders import local_checkpoint
from .hf_config import load_hf_config
from .weight_files import read_weights

DEVICE_TYPES = ("cpu", "cuda")


def checked_device(device: str | torch.device) -> torch.device:
    """`device` as torch names it, refused with the way out before any weight is read: a CUDA device
    torch cannot reach would otherwise fail deep inside `.to()`, after the checkpoint was read."""
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError):
        checked = None
    if checked is None or checked.type not in DEVICE_TYPES:
        raise ConfigError(f"device {str(device)!r} is not one staticrt runs on; pass cpu, cuda or cuda:N")
    if checked.type == "cpu":
        return checked
    seen = torch.cuda.device_count()
    if (checked.index or 0) < seen:
        return checked
    way_out = (
        f"pass cuda:0 to cuda:{seen - 1}, or cpu"
        if seen
        else "pass cpu, or run on a machine with a GPU and torch's CUDA build (see the README)"
    )
    raise ConfigError(f"device {str(device)!r}: torch {torch.__version__} sees {seen} CUDA device(s); {way_out}")


def _head_of(config: ModelConfig, state: dict[str, torch.Tensor], source: str) -> ModelConfig:
    """The config the weights call for. With `tie_word_embeddings` a checkpoint may still hold its
    own `lm_head.weight`: the tied copy (dropped), or a head of its own, which transformers keeps
    (untied, with a warning), and so does staticrt."""
    head, embedding = state.get("lm_head.weight"), state.get("embed_tokens.weight")
    if not config.tie_word_embeddings or head is None:
        return config
    if embedding is not None and torch.equal(head, embedding):
        del state["lm_head.weight"]
        return config
    warnings.warn(
        f"{source}: config.json ties the output head to the embedding, but the checkpoint holds an "
        "lm_head.weight of its own; it is used untied, as transformers does. Set tie_word_embeddings "
        "to false in config.json to silence this",
        stacklevel=3,
    )
    return dataclasses.replace(config, tie_word_embeddings=False)


def load_state_dict_checked(model: Decoder, state: dict[str, torch.Tensor], source: str) -> None:
    """Assign `state` to `model`, refusing missing, unexpected or mis-shaped tensors by name.
    Consumes `state`: see `_assign_in_parts`."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: weights do not match the {model.config.family} architecture in config.json: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}"
            )
    _assign_in_parts(model, state)
    assert not state, f"tensors of no child module: {sorted(state)}"


def _assign_in_parts(module: nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Load one child (one layer of a list) at a time, its tensors popped from `state`: a fused
    projection is a new tensor (the parts concatenated), and the parts it replaces are freed
    layer by layer instead of living beside the whole fused model until loading ends."""
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            _assign_in_parts(child, state, f"{prefix}{name}.")
            continue
        head = f"{prefix}{name}."
        child.load_state_dict(
            {k.removeprefix(head): state.pop(k) for k in list(state) if k.startswith(head)}, assign=True
        )


def load_config(path_or_preset: str | Path) -> ModelConfig:
    """The architecture of a preset or a checkpoint folder, without reading any weights (what
    `inspect` needs for a checkpoint of any size). A `.gguf` file is converted once (gguf_folders.py)."""
    path_or_preset = local_checkpoint(path_or_preset)
    name = str(path_or_preset)
    if name in PRESETS:
        return PRESETS[name]
    if not Path(path_or_preset).is_dir():
        raise CheckpointError(f"model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder")
    config = load_hf_config(Path(path_or_preset))
    eos = read_generation_defaults(path_or_preset).eos_token_ids
    return dataclasses.replace(config, eos_token_ids=eos) if eos else config


def stored_quantization(path_or_preset: str | Path) -> QuantSpec | None:
    """The spec of a folder whose projections `staticrt convert --keep-quantized` kept as GGUF
    codes (gguf_blocks.py); None for float weights and presets. Other quantized checkpoints (GPTQ,
    AWQ, ...) are refused by name: their tensors are not weights staticrt can read. gpt-oss's MXFP4
    experts load dequantized (None: float weights)."""
    if str(path_or_preset) in PRESETS:
        return None
    folder = Path(path_or_preset)
    try:
        quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # load_config has already said what is wrong with config.json
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == mxfp4.QUANT_METHOD and load_config(folder).family == "gpt_oss":
        return None  # gpt-oss's experts, dequantized as they load (mxfp4.py)
    if method != gguf_blocks.QUANT_METHOD:
        raise CheckpointError(
            f"{folder}: config.json says its weights are quantized by {method!r}; staticrt reads float "
            "checkpoints (and quantizes them with --quantize) and GGUF codes kept by staticrt convert "
            "--keep-quantized: use the float checkpoint, or a GGUF of the model with staticrt convert"
        )
    return parse_quantize(quantization.get("weights"))


def load_model(
    path_or_preset: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    quantize: str | None = None,
    packed: bool = False,
) -> Decoder:
    """A preset name (`tiny-llama`, ...) or a Hugging Face checkpoint folder -> `Decoder` in
    inference mode. The folder's `tokenizer.json`, when present, is loaded as `model.tokenizer`.

    `quantize` ("int8", "int4", "int8-wo", "int4-g64", ...; see `staticrt.models.quantize`) stores
    the projections and head in fewer bytes: "int8" and "int4" in the kernels this device runs
    fastest (`quantize.kernels_for`: staticrt's int8-activation kernels on a CPU that has them,
    computing in float32; else torchao's), the others as they say; with torchao's the model computes
    in bfloat16 unless `dtype` says float16. `dtype` defaults to float32 for a float model.
    `device`: cpu, cuda or cuda:N. A `.gguf` file loads from the folder it converts into once
    (`staticrt.loading.gguf_folders`).
    `packed`: a float model whose CPU graphs read its weights packed for oneDNN (`packed_linear.packs`)
    holds them packed only, the float matrices let go: for a process that owns the model and
    runs it on the compiled backend alone (it then neither exports, quantizes nor saves).
    """
    device = checked_device(device)
    path_or_preset = local_checkpoint(path_or_preset)
    config = load_config(path_or_preset)
    spec, dtype = _quantization(path_or_preset, config, quantize, device, dtype)
    if str(path_or_preset) in PRESETS:
        model = init_random(Decoder(config), seed=0).to(dtype=dtype, device=device)
        model.tokenizer = None
        model.source = str(path_or_preset)
        return _ready(model, spec, packed=packed)
    folder = Path(path_or_preset)
    state = read_weights(folder, config)
    state, kept = gguf_blocks.split_state(state)
    # Kept codes are weights too: their exact values stand in until quantize_weights replaces them.
    state |= {name: gguf_blocks.dequantize(blocks) for name, blocks in kept.items()}
    for name, tensor in state.items():
        if not tensor.is_floating_point():  # an int8 or bool tensor cast to float would run as other weights
            raise CheckpointError(
                f"{folder}: {name} is {str(tensor.dtype).removeprefix('torch.')}, where a weight is floating "
                "point (float32, float16 or bfloat16); the file is not a float checkpoint: convert it again"
            )
        state[name] = tensor.to(dtype)  # one at a time: a float32 copy goes as its cast arrives
    config = _head_of(config, state, str(folder))
    with torch.device("meta"):
        model = Decoder(config)
    load_state_dict_checked(model, state, str(folder))
    model.reset_buffers()  # the RoPE tables and µP vectors are not in the checkpoint: the meta placeholders go
    model = model.to(device)
    model.tokenizer = load_tokenizer(folder)
    model.source = str(folder)
    return _ready(model, spec, kept, packed)


def _quantization(
    path_or_preset: str | Path,
    config: ModelConfig,
    quantize: str | None,
    device: torch.device,
    dtype: torch.dtype | str | None,
) -> tuple[QuantSpec | None, torch.dtype]:
    """The quantization `load_model` applies (what the folder keeps, or `quantize` with its kernels
    chosen for `device`: "int8" kept as int8-wo is the same weights) and the dtype it computes in."""
    spec = parse_quantize(quantize)
    stored = stored_quantization(path_or_preset)
    same_bits = spec is not None and stored is not None and spec.activations is None and spec.bits == stored.bits
    if stored is not None and spec not in (None, stored) and not same_bits:
        raise ConfigError(
            f"{path_or_preset} holds {stored.name} weights kept from a GGUF (staticrt convert --keep-quantized), "
            f"not quantize {spec.name!r}: leave quantize out (or pass {stored.name}), or convert the GGUF "
            "without --keep-quantized to quantize the float weights otherwise"
        )
    spec, asked = stored or spec, None if dtype is None else resolve_dtype(dtype)
    spec = spec and kernels_for(spec, device, asked, config)
    return spec, quantized_dtype(spec, asked)


def _ready(
    model: Decoder, spec: QuantSpec | None, kept: dict[str, gguf_blocks.Blocks] | None = None, packed: bool = False
) -> Decoder:
    """Inference mode, quantized weights if asked (with the GGUF codes `kept`, where the folder
    has them), and on CPU the layout that decodes fastest there: packed in place where asked and
    the model qualifies, else column-major."""
    model = model.eval().requires_grad_(False)
    if spec is not None:
        quantize_weights(model, spec, kept or {})
    if packed and packs(model):
        return pack(model, twin=False)
    if next(model.parameters()).device.type == "cpu":
        use_column_major_weights(model)
    return model
