"""What `--quantize` / `quantize=` names, torch-free (the CLI parses it before torch loads)."""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError

INT4_GROUP_SIZES = (32, 64, 128)
A8_CHOICES = ("int8-a8", "int4-a8")  # int8 activations too, in staticrt's own CPU kernels
QUANTIZE_CHOICES = ("int8", "int8-a8", "int4", *(f"int4-g{g}" for g in INT4_GROUP_SIZES), "int4-a8")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """`bits` 8 (per output channel) or 4 (per `group_size` inputs of an output channel);
    `activations`: int8 activations too, in staticrt's own CPU kernels (models/a8_kernels.py; int4
    then has a scale and minimum a block of 32)."""

    bits: int
    group_size: int | None = None
    activations: bool = False

    @property
    def name(self) -> str:
        """The canonical spelling, as manifests and recipes record it: "int8", "int8-a8", "int4-g32", "int4-a8"."""
        if self.activations:
            return f"int{self.bits}-a8"
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"


def torchao_weights(spec: QuantSpec | None) -> bool:
    """Whether weights quantized by `spec` are torchao's tensor subclasses (every spec but the
    int8-activation ones, whose codes are plain tensors for staticrt's kernels)."""
    return spec is not None and not spec.activations


def parse_quantize(value: str | None) -> QuantSpec | None:
    """`--quantize` / `quantize=` -> spec; None or "none" is no quantization. "int4" is group 32,
    the finest group torch's int4 kernels take (the most accurate, at the same speed)."""
    if value is None or value == "none":
        return None
    if value in A8_CHOICES:
        return QuantSpec(8, activations=True) if value == "int8-a8" else QuantSpec(4, 32, activations=True)
    match = re.fullmatch(r"int8|int4(?:-g(\d+))?", value)
    group = int(match.group(1) or 32) if match and value != "int8" else None
    if match is None or (group is not None and group not in INT4_GROUP_SIZES):
        raise ConfigError(
            f"quantize {value!r} is not supported; choose one of {', '.join(QUANTIZE_CHOICES)} "
            "(int4 is int4-g32), or none"
        )
    return QuantSpec(8) if value == "int8" else QuantSpec(4, group)
