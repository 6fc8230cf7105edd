"""A checkpoint folder's safetensors, read into the decoder's tensor names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..errors import CheckpointError, first_line
from . import mxfp4
from .families import checkpoint_names

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of `folder`'s safetensors, named as the decoder names them (families.py: a
    wrapper's text half, a family's fused tensors split), as stored (dtype unchanged)."""
    state = _read_state_dict(_weight_files(folder))
    if _quant_method(folder) == mxfp4.QUANT_METHOD:
        mxfp4.dequantize_state(state, str(folder))
    return checkpoint_names(_model_type(folder), state, _part_sizes(config))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({folder / str(name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{index} is not a safetensors index (JSON with a weight_map of tensor -> shard file: {err!r}); "
                "restore it from the checkpoint"
            ) from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) {missing} that are not in the folder")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder}: holds pickle weights {pickles}; staticrt loads safetensors only (pickles can run "
            'code). Convert once with transformers: python -c "from transformers import '
            f"AutoModelForCausalLM as M; M.from_pretrained('{folder}').save_pretrained('{folder}')\""
        )
    raise CheckpointError(
        f"{folder}: no model.safetensors or model.safetensors.index.json; a checkpoint folder needs "
        "its weights in safetensors"
    )


def _read_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """Each tensor copied out of the file's map, the map closed after it. A tensor left on the map
    keeps every page of the file that was ever read resident beside the copies that loading makes
    (column-major layout, casts, quantization): SmolLM2's 517 MB twice, 1.35 GB peak RSS against
    0.84 GB so (docs/measurements.md)."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
            for key in keys:
                with safe_open(str(path), framework="pt") as f:
                    state[key.removeprefix("model.")] = f.get_tensor(key).clone()
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            reason = first_line(err)
            raise CheckpointError(
                f"{path} cannot be read as safetensors ({reason}); the file is truncated or corrupt: download it again"
            ) from None
    return state


def _model_type(folder: Path) -> str | None:
    """The checkpoint's own model_type (a wrapper's, such as gemma3, where the config's family is
    its text half's); load_config has already refused a config.json it cannot read."""
    return json.loads((folder / "config.json").read_text()).get("model_type")


def _quant_method(folder: Path) -> str | None:
    quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def _part_sizes(config: ModelConfig) -> dict[str, int]:
    """The widths of fused projections' parts, as families.checkpoint_names splits them."""
    heads = {"q": config.num_heads, "kv": config.num_kv_heads}
    return {name: n * config.head_dim for name, n in heads.items()} | {"intermediate": config.intermediate_size}
