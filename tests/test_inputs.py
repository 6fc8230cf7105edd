"""Bad inputs raise before any state changes, with messages naming the input and the limit."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import staticrt
from staticrt.errors import CheckpointError, ConfigError, GenerationError


@pytest.fixture(scope="module")
def warm_generator():
    """A generator that has already generated, so a refused call can be checked for side effects."""
    gen = staticrt.Generator(staticrt.load_model("tiny-llama"), max_batch_size=2, max_cache_len=32)
    gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
    return gen


def cache_snapshot(gen):
    return [b.clone() for b in gen.backend.cache.state_buffers()]


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        (
            [[1] * 30],
            {"max_new_tokens": 3},
            "prompt 0 has 30 tokens; with max_new_tokens=3 that is 33, beyond max_cache_len=32; shorten the "
            "prompt, ask for fewer tokens or build the Generator with a larger max_cache_len",
        ),
        (
            [[1], [2], [3]],
            {},
            "3 prompts exceed max_batch_size=2; split the batch or build the Generator with a larger max_batch_size",
        ),
        ([[1, 2], []], {}, "prompt 1 is empty; every row needs at least one token"),
        ([[1, 512, -1]], {}, "prompt 0 holds token id(s) [512, -1] outside the vocabulary [0, 512)"),
        ([], {}, "prompts must be a non-empty list of token-id lists"),
        (["hello"], {}, "prompt 0 is a str; pass a list of token ids"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens is 0; it must be an int >= 1"),
        ([[1]], {"do_sample": True, "top_p": 0.0}, "top_p is 0.0; it must be in (0, 1]"),
        (
            [[1]],
            {"do_sample": True, "temperature": 0.0},
            "temperature is 0.0; it must be > 0 (use do_sample=False for greedy)",
        ),
    ],
)
def test_bad_request_raises_before_state_changes(warm_generator, prompts, kwargs, message):
    before = cache_snapshot(warm_generator)
    with pytest.raises(GenerationError, match=re.escape(message)):
        warm_generator.generate(prompts, **{"max_new_tokens": 4, **kwargs})
    after = cache_snapshot(warm_generator)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("dtype", ["int64", "int8", "float8"])
def test_a_model_dtype_that_is_not_a_float_is_refused_by_name(dtype):
    """Manifests record int64 lengths and int8 K/V; a model computes in none of them."""
    from staticrt.errors import CheckpointError

    with pytest.raises(CheckpointError) as raised:
        staticrt.load_model("tiny-llama", dtype=dtype)
    assert str(raised.value) == (
        f"dtype {dtype!r} is not supported; choose one of float32, fp32, bfloat16, bf16, float16, fp16"
    )


def test_unknown_backend_and_cache_kind():
    model = staticrt.load_model("tiny-llama")
    with pytest.raises(
        GenerationError, match="^backend 'fast' is unknown; choose one of eager, compiled, cudagraph, reduce-overhead$"
    ):
        staticrt.Generator(model, backend="fast")
    with pytest.raises(
        GenerationError,
        match=r"^backend 'onnx' runs an exported artifact, not a model: export one "
        r"\(`staticrt export`, format onnx\) and load it with "
        r"staticrt.load_artifact\(path, backend='onnx'\) or `staticrt run "
        r"ARTIFACT --backend onnx`$",
    ):
        staticrt.Generator(model, backend="onnx")
    with pytest.raises(
        ValueError,
        match="cache kind 'paged' is unknown; choose one of static, sliding, hybrid, offloaded, offloaded-hybrid, "
        "sink, static-int8, sliding-int8, hybrid-int8, auto",
    ):
        staticrt.Generator(model, cache="paged")


@pytest.fixture()
def checkpoint(hf_checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"][0], folder)
    return folder


def test_unknown_model_type(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match="model_type 'gpt2' is not supported; staticrt runs llama, mistral, qwen2, gemma2"
    ):
        staticrt.load_model(checkpoint)


def test_missing_weight(checkpoint):
    state = load_file(checkpoint / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape("missing ['layers.1.mlp.up_proj.weight'], unexpected []")):
        staticrt.load_model(checkpoint)


def test_mismatched_weight_shape(checkpoint):
    state = load_file(checkpoint / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(state, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "tensor 'layers.0.self_attn.k_proj.weight' has shape (64, 64) but config.json implies (32, 64)"
        ),
    ):
        staticrt.load_model(checkpoint)


def test_pickle_checkpoint_refused_with_conversion_hint(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    torch.save({}, checkpoint / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError,
        match=r"holds pickle weights \['pytorch_model.bin'\]; staticrt loads safetensors only.*save_pretrained",
    ):
        staticrt.load_model(checkpoint)


def test_sharded_checkpoint_loads(hf_checkpoints, tmp_path):
    hf = hf_checkpoints["qwen2"][1]
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = staticrt.load_model(tmp_path)
    single = staticrt.load_model(hf_checkpoints["qwen2"][0])
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name


def test_unknown_preset_or_path():
    with pytest.raises(CheckpointError, match="model 'tiny-gpt' is neither a preset .* nor a checkpoint folder"):
        staticrt.load_model("tiny-gpt")


def test_dtype_is_applied(hf_checkpoints):
    model = staticrt.load_model(hf_checkpoints["gemma2"][0], dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
