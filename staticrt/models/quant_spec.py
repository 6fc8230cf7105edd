"""What `--quantize` / `quantize=` names, torch-free (the CLI parses it before torch loads)."""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128)
A8_CHOICES = ("int8-a8", "int4-a8")  # int8 activations too, in staticrt's own CPU kernels
# The layout of the codes an artifact's programs hand staticrt's kernels (manifest field "a8_layout"):
# 1 (no field) before int4's codes went into 16-channel groups; int8's are the same in both.
A8_LAYOUT = 2
QUANTIZE_CHOICES = ("int8", "int8-a8", "int8-wo", "int4", "int4-a8", *(f"int4-g{g}" for g in INT4_GROUP_SIZES))


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """`bits` 8 (per output channel) or 4 (per `group_size` inputs of an output channel);
    `activations`: int8 activations too, in staticrt's own CPU kernels (models/a8_kernels.py; int4
    then has a scale and minimum a block of 32), or None: the kernels the device runs fastest,
    chosen when the model loads (`quantize.kernels_for`)."""

    bits: int
    group_size: int | None = None
    activations: bool | None = False

    @property
    def name(self) -> str:
        """The canonical spelling, as manifests and recipes record it: "int8" (the device's
        choice), "int8-a8", "int8-wo" (torchao's weight-only), "int4-g32", "int4-a8"."""
        if self.activations is None:
            return f"int{self.bits}"
        if self.activations:
            return f"int{self.bits}-a8"
        return "int8-wo" if self.bits == 8 else f"int4-g{self.group_size}"

    @property
    def layout(self) -> str:
        """The weights' grid whatever kernels run it: "int8", or "int4-g32" for int4 in groups of 32
        (how an ONNX graph's MatMulNBits, ONNX Runtime's own kernel, is named)."""
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"


def torchao_weights(spec: QuantSpec | None) -> bool:
    """Whether weights quantized by `spec` (its kernels chosen) are torchao's tensor subclasses
    (every spec but the int8-activation ones, whose codes are plain tensors for staticrt's kernels)."""
    return spec is not None and not spec.activations


def parse_quantize(value: str | None) -> QuantSpec | None:
    """`--quantize` / `quantize=` -> spec; None or "none" is no quantization. "int8" and "int4" leave
    the kernels to the device; "int4" is group 32 where torchao's run it, the finest group torch's
    int4 kernels take (the most accurate, at the same speed)."""
    if value is None or value == "none":
        return None
    named = {"int8": QuantSpec(8, None, None), "int8-wo": QuantSpec(8), "int8-a8": QuantSpec(8, None, True)}
    named |= {"int4": QuantSpec(4, 32, None), "int4-a8": QuantSpec(4, 32, True)}
    match = re.fullmatch(r"int4-g(\d+)", value)
    if match and int(match.group(1)) in INT4_GROUP_SIZES:
        return QuantSpec(4, int(match.group(1)))
    if value not in named:
        raise ConfigError(
            f"quantize {value!r} is not supported; choose one of {', '.join(QUANTIZE_CHOICES)}, or none "
            "(int8 and int4: the kernels this device runs fastest)"
        )
    return named[value]
