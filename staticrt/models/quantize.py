"""Weight-only int8 / int4 quantization of a loaded `Decoder`, with torchao (the `quant` extra).

Decode at small batch streams every weight once a token, so a weight stored in fewer bytes is a
faster token. torchao replaces each projection's weight with a quantized tensor subclass whose
`linear` runs torch's weight-only kernels: `_weight_int8pack_mm` (int8, one scale an output
channel) and `_weight_int4pack_mm_for_cpu` / tinygemm on CUDA (int4, an asymmetric scale and zero
a group of `group_size` inputs). Both kernels take bfloat16 activations: with float32 ones the
CPU kernels run at a third (int8) to a fifth (int4) of fp32 BLAS's speed (docs/measurements.md),
so a quantized model computes in bfloat16 (or float16 on CUDA) and refuses float32.

What is quantized: every projection (the fused q/k/v and gate/up, o, down) to `spec`, and the
head to int8 whatever `spec` says: at int4 the head alone raised SmolLM2-135M's perplexity by 5.6%,
at int8 by 0.3% (tests/test_real_model.py). A tied head gets its own quantized copy, since the head
is a fifth of a small model's bytes and is read in full every token, while the embedding table is
only gathered from, a row a token, and stays in the compute dtype.

"int8-a8" and "int4-a8" are not torchao's: int8 or int4 weights times int8 activations in
staticrt's own CPU kernels (a8_kernels.py; AVX512-VNNI or AVX2), computing in float32, faster than
torch's kernels; the head is int8 in both. "int8" and "int4" are those on a CPU that runs them and
torchao's elsewhere (`kernels_for`); torchao's by name are "int8-wo" and "int4-g32/g64/g128".
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .expert_quant import check_experts, quantize_experts
from .gguf_blocks import BLOCK, Blocks, codes_of
from .quant_spec import INT4_GROUP_SIZES, QuantSpec

QUANTIZED_DTYPES = (torch.bfloat16, torch.float16)


def quantized_dtype(spec: QuantSpec | None, dtype: torch.dtype | None) -> torch.dtype:
    """The compute dtype of a model loaded with `spec`: `dtype`, or by default float32 for a float
    model and bfloat16 for a quantized one; float32 with torchao's quantization is refused, and
    int8-a8 and int4-a8 (whose kernels take float32 activations) compute in float32 alone."""
    if spec is None:
        return dtype or torch.float32
    if spec.activations:  # staticrt's kernel takes float32 activations and quantizes them itself
        if dtype not in (None, torch.float32):
            raise ConfigError(
                f"quantize {spec.name!r} with dtype {str(dtype).removeprefix('torch.')}: its kernel takes float32 "
                f"activations; leave --dtype out (or pass float32), or use --quantize {spec.name[:4]} for bfloat16"
            )
        return torch.float32
    if dtype is None:
        return torch.bfloat16
    if dtype not in QUANTIZED_DTYPES:
        raise ConfigError(
            f"quantize {spec.name!r} with dtype {str(dtype).removeprefix('torch.')}: torch's int8/int4 weight "
            "kernels take bfloat16 (or float16) activations, and with float32 ones run slower than float32 "
            "weights; use --dtype bfloat16, or leave --dtype out (it then defaults to bfloat16)"
        )
    return dtype


def _input_sizes(config: ModelConfig) -> list[int]:
    """The input sizes of a model's matrices, what a quantization block must divide: q/k/v,
    gate/up and the head read the hidden size, o the heads' width, down the intermediate size."""
    return sorted({config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size})


def kernels_for(
    spec: QuantSpec, device: torch.device, dtype: torch.dtype | None, config: ModelConfig, build: bool = True
) -> QuantSpec:
    """`spec` with its kernels chosen where it leaves them to the device ("int8", "int4"): on a CPU
    that runs staticrt's int8-activation kernels, those (SmolLM2, 2 threads: int8 1.2-1.6x llama.cpp's
    Q8_0 speed and int4 1.6-1.9x its Q4_1's, where torchao's ran at 0.5x and 0.9x; docs/measurements.md),
    else torchao's weight-only kernels: on CUDA, with `dtype` bfloat16 or float16 (staticrt's take
    float32), where an input size is not a multiple of the bytes the kernels read a step, or where
    the kernels cannot be built here (said in a warning; `build` False, as for `inspect`, which
    only asks which kernels, does not try). A mixture of experts' stacks are quantized at the
    spec's width by expert_quant.py, whose decode runs staticrt's experts kernels where these run."""
    check_experts(config, spec)
    if spec.activations is not None:
        return spec
    from . import a8_kernels

    fits = all(size % a8_kernels.STEP == 0 for size in _input_sizes(config))
    a8 = device.type == "cpu" and dtype in (None, torch.float32) and fits
    chosen = dataclasses.replace(spec, activations=a8 and a8_kernels.unavailable() is None)
    if chosen.activations and build:
        try:
            a8_kernels.load(chosen.name)
        except ConfigError as err:
            chosen = dataclasses.replace(spec, activations=False)
            warnings.warn(
                f"{err}. Until then quantize {spec.name!r} runs torchao's kernels ({chosen.name})", stacklevel=2
            )
    return chosen


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Imports of torchao (directly, or through transformers) without their noise: torchao logs a
    line for each optional CUDA library it cannot load, and torch one for each of its enums; none
    of them is the user's concern."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree_log.setLevel(level)


def kernel_name(spec: QuantSpec, device: torch.device) -> str:
    """The matmul kernel a decode step of weights quantized by `spec` runs on `device` (what the
    bench reports beside each quantized run's speed); the head's int8 kernel is the same family."""
    if spec.activations:
        from .a8_kernels import isa

        return f"staticrt::int{spec.bits}_linear ({isa()}; int{spec.bits} weights x int8 activations, float32 out)"
    if spec.bits == 8:
        return "torch._weight_int8pack_mm (torchao Int8WeightOnly; bfloat16 activations)"
    if device.type == "cpu":
        return f"torch._weight_int4pack_mm_for_cpu (torchao int4, group {spec.group_size}; bfloat16 activations)"
    return f"tinygemm int4 (torchao, tile_packed_to_4d, group {spec.group_size})"


def _torchao_config(spec: QuantSpec, device: torch.device) -> object:
    """torchao's config for `spec` on `device`."""
    try:
        with quiet_imports():
            from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
            from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as err:
        raise ConfigError(
            f"quantize {spec.name!r} needs torchao ({err}); install it with: pip install 'staticrt[quant]'"
        ) from None
    # set_inductor_config=False: torchao would otherwise change inductor's global settings.
    if spec.bits == 8:
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if device.type == "cpu":
        return PrototypeInt4WeightOnlyConfig(group_size=spec.group_size, set_inductor_config=False)
    return Int4WeightOnlyConfig(
        group_size=spec.group_size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
    )


def quantize_weights(model: nn.Module, spec: QuantSpec, kept: dict[str, Blocks] | None = None) -> nn.Module:
    """Quantize `model`'s projections and head in place (see the module docstring); returns it.

    Every shape is checked before any weight changes: an int4 group must divide each projection's
    input size, or the model is refused with the sizes and the group sizes that fit.
    `kept`: GGUF codes by checkpoint weight name (gguf_blocks.py), which int4 projections on the
    CPU take as they are (`_keep_codes`); elsewhere torchao quantizes their exact values.
    """
    config = model.config
    weight = model.embed_tokens.weight
    spec = kernels_for(spec, weight.device, weight.dtype, config)  # "int8", "int4": the device's kernels
    quantized_dtype(spec, weight.dtype)  # refuses a model loaded in float32 for torchao's
    if spec.activations:
        return _int8_activation_kernels(model, spec)
    if spec.bits == 4:
        sizes = _input_sizes(config)
        fits = [g for g in INT4_GROUP_SIZES if all(size % g == 0 for size in sizes)]
        if spec.group_size not in fits:
            raise ConfigError(
                f"quantize {spec.name!r}: the group size {spec.group_size} must divide every projection's "
                f"input size, and this model's are {sizes}; "
                + (f"use {', '.join(f'int4-g{g}' for g in fits)}" if fits else "use int8")
            )
    body, head = _torchao_config(spec, weight.device), _torchao_config(QuantSpec(8), weight.device)
    if model.lm_head is None:  # a tied head: a quantized copy of its own, the embedding stays float
        model.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=weight.device)
        model.lm_head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    from torchao.quantization import quantize_

    # torchao's tensors give AOT autograd's cache no stable key, and torch says so once a tensor type;
    # inductor's graph cache still serves a second process (SmolLM2 int8: first token 70 s cold, 8.5 s warm).
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching", category=UserWarning)
    if kept and spec.bits == 4 and weight.device.type == "cpu":
        _keep_codes(model, kept)
    else:
        quantize_(model, body, filter_fn=lambda module, name: _projection(module, name) and name != "lm_head")
    quantize_(model, head, filter_fn=lambda _module, name: name == "lm_head")
    quantize_experts(model, spec)
    model.quantization = spec
    return model


def _int8_activation_kernels(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Every projection as `Int8Linear` (int8-a8) or `Int4Linear` (int4-a8) and the head (a tied
    one as a copy of its own) as `Int8Linear`, run by staticrt's kernels (a8_kernels.py); refused,
    before any weight changes, where the kernels cannot run or an input size is not a multiple of
    the 64 values they read a step."""
    from .a8_kernels import STEP, load
    from .a8_linear import Int4Linear, Int8Linear

    weight = model.embed_tokens.weight
    if weight.device.type != "cpu":
        raise ConfigError(
            f"quantize {spec.name!r} runs on the CPU (its kernel is AVX512-VNNI or AVX2); on {weight.device} use "
            f"{spec.name[:4]}"
        )
    linears = [(name, m) for name, m in model.layers.named_modules() if _projection(m, name)]
    sizes = _input_sizes(model.config)
    if any(size % STEP for size in sizes):
        raise ConfigError(
            f"quantize {spec.name!r} reads activations {STEP} bytes at a time, and this model's input sizes are "
            f"{sizes}, not all multiples of {STEP}; use --quantize {spec.name[:4]}"
        )
    load(spec.name)
    projection = Int8Linear if spec.bits == 8 else Int4Linear
    for name, linear in linears:
        owner, _, own = name.rpartition(".")
        parent = model.layers.get_submodule(owner) if owner else model.layers
        setattr(parent, own, projection(linear.weight, linear.bias, getattr(linear, "parts", None)))
    head = weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear(head)
    quantize_experts(model, spec)
    model.quantization = spec
    return model


def _projection(module: nn.Module, name: str) -> bool:
    """Whether `module` (at `name`) is a projection the kernels quantize: a linear layer but a
    mixture of experts' router (`mlp.gate`), which stays float (expert_quant.py says why)."""
    return isinstance(module, nn.Linear) and not name.endswith("mlp.gate")


def _keep_codes(model: nn.Module, kept: dict[str, Blocks]) -> None:
    """Quantize each projection to int4 with the GGUF's own codes, scales and minimums rather than
    torchao's choice from the float values: a Q4_0/Q4_1 block is one group of the CPU int4 kernel,
    whose weight is `(q - 8) * scale + zero`, so `scale = d` and `zero = m + 8 d` (rounded to the
    compute dtype)."""
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    for name, module in model.layers.named_modules(prefix="layers"):
        if not _projection(module, name):
            continue
        owner, _, own_name = name.rpartition(".")
        parts = [kept[f"{owner}.{part}.weight"] for part in getattr(module, "parts", {own_name: 0})]
        codes = torch.cat([codes_of(blocks) for blocks in parts]).to(torch.int32)  # [N, K] in 0..15
        scales = torch.cat([blocks["scales"] for blocks in parts]).float()  # [N, K/32]
        zeros = torch.cat([blocks["mins"] for blocks in parts]).float() + 8 * scales
        assert codes.shape == module.weight.shape and scales.shape[1] * BLOCK == codes.shape[1]
        dtype = module.weight.dtype
        module.weight = nn.Parameter(
            Int4OpaqueTensor(
                qdata=torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                scale_and_zero=pack_tinygemm_scales_and_zeros(scales.to(dtype), zeros.to(dtype), dtype),
                block_size=[1, BLOCK],
                shape=module.weight.shape,
            ),
            requires_grad=False,
        )


def plain_tensors(model: nn.Module) -> nn.Module:
    """A copy of the quantized `model` whose torchao weights are parametrizations over their plain
    inner tensors (int8 or packed int4 data, scales, zero points; torchao's `unwrap_tensor_subclass`).
    torch.export then traces the dequantizing matmul from plain constants, which the artifact's
    safetensors file can hold and AOTInductor loads by name, with no torchao at load time."""
    import copy

    from torchao.utils import unwrap_tensor_subclass

    return unwrap_tensor_subclass(copy.deepcopy(model))
