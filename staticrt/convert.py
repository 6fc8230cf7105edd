"""GGUF file -> Hugging Face checkpoint folder that staticrt (and transformers) loads.

transformers' GGUF loader is the well-kept path: it reads the metadata into a config, maps
llama.cpp's tensor names to transformers' (undoing the Q/K row permutation llama.cpp applies),
dequantizes every weight type the `gguf` library knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K, ...) and rebuilds the tokenizer with its chat template. staticrt writes the result as plain
safetensors, since transformers refuses to save a model it loaded from GGUF. The folder is written
as an artifact is (`write_folder`): beside the target, swapped in whole, removed on failure or
SIGTERM. Needs the `gguf` extra (gguf, transformers, accelerate).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .artifact_write import write_folder
from .errors import CheckpointError

EXTRA = "pip install 'staticrt[gguf]'"
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


def convert_gguf(source: Path, target: Path, on_stage: Stage = lambda what: None) -> Path:
    """Write the checkpoint folder `target` (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and the chat template, generation_config.json) from the GGUF `source`."""
    source, target = Path(source), Path(target)
    if not source.is_file() or source.suffix != ".gguf":
        raise CheckpointError(f"{source} is not a .gguf file; pass the path of one (e.g. model.Q4_K_M.gguf)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target} exists and is not an empty folder; choose a new output folder")
    _require_extra()
    import torch
    import transformers
    from safetensors.torch import save_file

    folder, name = str(source.parent), source.name

    def build(work: Path) -> None:
        on_stage("tokenizer and chat template")
        transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(work)
        on_stage("dequantizing the weights")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        on_stage("writing model.safetensors")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding, shared
        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # the weights written are plain float32
        model.config.save_pretrained(work)
        model.generation_config.save_pretrained(work)

    return write_folder(target, build)
