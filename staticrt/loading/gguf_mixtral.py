"""llama.cpp's Mixtral: a "llama" GGUF whose layers hold experts (`ffn_gate_inp`, `ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`) in place of the dense MLP. transformers' GGUF reader reads it as a
dense Llama and drops the experts (the MLP it gives is newly initialised), so convert.py takes the
attention, norms, embedding and tokenizer from that reader, which undoes llama.cpp's Q/K row
permutation, and this module adds what it drops: the router and the experts, dequantized by the
`gguf` library, in the layout transformers saves a `MixtralForCausalLM` in, and the Mixtral config.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

# the dense MLP transformers' reader initialised, which a Mixtral layer does not have
DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _field(reader: Any, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def is_mixtral(reader: Any, source: Path) -> bool:
    """A "llama" GGUF with experts: how llama.cpp's converter writes a Mixtral. Refused, naming the
    first missing, where a layer lacks one of its expert tensors (before transformers reads it)."""
    experts = _field(reader, "llama.expert_count") or 0
    if _field(reader, "general.architecture") != "llama" or experts <= 0:
        return False
    names = {t.name for t in reader.tensors}
    for layer in range(int(_field(reader, "llama.block_count") or 0)):
        for kind in EXPERT_TENSORS:
            if f"blk.{layer}.{kind}.weight" not in names:
                raise CheckpointError(
                    f"{source.name} holds a Mixtral (a 'llama' GGUF with {experts} experts) without its tensor "
                    f"blk.{layer}.{kind}.weight; the file is incomplete or not llama.cpp's layout: download it again"
                )
    return True


@contextmanager
def dense_mlp_unreported() -> Iterator[None]:
    """transformers' reader without its report of the dense MLP it initialised: expected here,
    and that MLP is dropped (`mixtral_parts`)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def mixtral_parts(source: Path, llama: Any) -> tuple[Any, dict[str, Any]]:
    """The Mixtral config and the state dict for the GGUF `source`, given `llama`, the dense
    `LlamaForCausalLM` transformers' reader loaded from it: its state without the dense MLP, plus
    each layer's `mlp.gate.weight [E, H]`, `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up
    rows) and `mlp.experts.down_proj [E, H, I]`, all float32."""
    import gguf
    import numpy as np
    import torch
    import transformers
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    tensors = {t.name: t for t in reader.tensors}

    def weight(name: str) -> np.ndarray:  # numpy's shape is the GGUF's dims reversed: [E, I, H] for gate_exps
        tensor = tensors[name]
        return dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)

    state = {k: v for k, v in llama.state_dict().items() if not k.endswith(DENSE)}
    for layer in range(llama.config.num_hidden_layers):
        prefix, block = f"model.layers.{layer}.mlp", f"blk.{layer}"
        gate_up = np.concatenate([weight(f"{block}.ffn_gate_exps.weight"), weight(f"{block}.ffn_up_exps.weight")], 1)
        state[f"{prefix}.gate.weight"] = torch.from_numpy(weight(f"{block}.ffn_gate_inp.weight"))
        state[f"{prefix}.experts.gate_up_proj"] = torch.from_numpy(np.ascontiguousarray(gate_up))
        state[f"{prefix}.experts.down_proj"] = torch.from_numpy(weight(f"{block}.ffn_down_exps.weight"))
    fields = llama.config.to_dict()
    for name in ("model_type", "architectures", "mlp_bias", "pretraining_tp", "quantization_config"):
        fields.pop(name, None)
    config = transformers.MixtralConfig(
        **fields,
        num_local_experts=int(_field(reader, "llama.expert_count")),
        num_experts_per_tok=int(_field(reader, "llama.expert_used_count")),
        sliding_window=None,  # llama.cpp's Llama has no window
    )
    config.architectures = ["MixtralForCausalLM"]
    return config, state
