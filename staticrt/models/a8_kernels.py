"""staticrt's matmuls with int8 activations for CPUs with AVX512-VNNI or AVX2 (quantize "int8-a8"
and "int4-a8"): the kernel quantizes each activation row to int8 in blocks of 32 along K (one scale
a block, llama.cpp's Q8 block) and multiplies the weights' integer codes by them as integer dot
products, float32 out. Weights: int8, one scale an output channel (`int8_linear`), or int4, a scale
and a minimum a block of 32 (`int4_linear`, llama.cpp's Q4_1 numbers in a layout of its own).

torch's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, what torchao
runs) take bfloat16 activations and multiply in floats; these multiply integers. SmolLM2-135M,
2 threads, one `staticrt bench` run: int8-a8 decode 3.75 ms/token compiled, 3.41 AOTInductor,
against llama.cpp Q8_0's 6.05; int4-a8 3.25 / 3.15 against Q4_1's 6.18 (docs/measurements.md).
Blocks of 32 keep its perplexity within 0.2-0.6% of float; blocks of 64 cost 0.85% on 512 tokens,
one scale a token 1.5%.

A worked example, for row m and channel n: x[m, 32b : 32b+32] has absmax a, so xq = round(x * 127
/ a) in -127..127 and s_b = a / 127. int8 (`int8_linear`): the codes of 16 channels lie interleaved
4 bytes at a time (a8_linear.int8_groups), so AVX512-VNNI's `vpdpbusd` takes 16 channels' codes
4k .. 4k+3 against xq[4k .. 4k+3] broadcast to every lane, 8 of them a block into 16 int32 sums;
it multiplies unsigned bytes by signed ones, so it takes w + 128 against xq, and the sums start
at -128 * sum_i xq_i to end at sum_i w_i xq_i. AVX2's `vpmaddubsw` takes |xq| against w with xq's
sign (|xq| * |w| <= 127 * 127, so a pair fits int16), `vpmaddwd` pairs of those into int32. Each
block's sums are scaled by s_b into float; the row's float sum ends times the channel's scale.
int4: w = d_b * q + m_b with q in 0..15 (unsigned, so `vpdpbusd` takes q against xq directly), so
the row's sum is sum_b s_b * (d_b * sum_i q_i xq_i + m_b * sum_i xq_i): the second term needs only
each activation block's code sum (S_b = s_b * sum_i xq_i), once a row.
The codes lie in int8's groups of 16 channels, two a byte (a8_linear.int4_groups): a 64-byte load
holds 16 channels' codes 8t .. 8t+7, the low nibbles 8t .. 8t+3 and the high ones 8t+4 .. 8t+7, so
`vpdpbusd` takes the low nibbles against xq[8t .. 8t+3] and the high ones against the next 4 into
the same 16 sums; a block's 16 scales d and 16 minimums m are float16, side by side, each block's
sums times s_b * d (and s_b * sum_i xq_i times m) added into 16 float lanes as int8's are. The
16-channel groups took SmolLM2's 512-token int4 prefill from 1.26x its float32 prefill's time to
0.75x (one channel a register and a horizontal sum a row and channel before; docs/measurements.md).

`int8_experts` and `int4_experts` are those for a mixture of experts' step: each activation row
through the codes of its own expert (a token's k chosen ones), read in place (expert_quant.py);
each expert's codes in its linear's groups, so that a channel's number is the one its expert's own
int8_linear (int4_linear) gives.

Compiled on first use (torch's cpp_extension, ~20 s) into the user cache, once a machine, torch,
source and instruction set; a later process loads the library.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from ..artifacts.user_cache import cache_root
from ..errors import ConfigError
from ..host import cpuinfo
from . import a8_int4_source, a8_int8_source, a8_source, packed_gemv_source

# One library: the shared part first, then each kernel's, packed_gemv.py's float one too
SOURCE = a8_source.SOURCE + a8_int8_source.SOURCE + a8_int4_source.SOURCE + packed_gemv_source.SOURCE

log = logging.getLogger("staticrt")
BLOCK = 32  # activation values a scale
STEP = 64  # bytes a VNNI instruction takes: K is a multiple of it
# The compiler flags of the kernel's build for each instruction set; `isa` picks the one this CPU runs.
FLAGS = {
    "avx512_vnni": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-mf16c", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
}
_loaded = False


def isa() -> str | None:
    """The instruction set the kernels are built for here: AVX512-VNNI, else AVX2 (with FMA and
    F16C), else None."""
    _, flags = cpuinfo()
    if {"avx512_vnni", "avx512bw", "avx512dq", "f16c"} <= flags:
        return "avx512_vnni"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else None


def unavailable() -> str | None:
    """Why the kernels cannot run on this machine, or None where they can."""
    return None if isa() is not None else "this CPU has neither AVX512-VNNI nor AVX2 (or no /proc/cpuinfo says so)"


def load(quantize: str = "int8-a8") -> None:
    """Make `torch.ops.staticrt.int8_linear` and `int4_linear` callable (`build`); a machine that
    cannot run or build them is refused with the way out, `quantize` (int8-a8, int4-a8) naming
    what asked for them."""
    if _loaded:
        return
    weights_only = quantize.removesuffix("-a8")  # torchao's weight-only quantization, the way out
    reason = unavailable()
    if reason is not None:
        raise ConfigError(
            f"quantize {quantize!r} runs staticrt's int8-activation kernels, and {reason}; "
            f"use --quantize {weights_only}"
        )
    try:
        build()
    except ConfigError as err:
        raise ConfigError(f"quantize {quantize!r} needs {err}, or use --quantize {weights_only}") from None


def build() -> None:
    """Load the library of every staticrt CPU kernel (the a8 ones and packed_gemv.py's float32
    one) from the user cache, compiled there first if absent; ConfigError naming the folder and
    the compiler it needs where that fails. The caller has checked `unavailable()`."""
    global _loaded
    if _loaded:
        return
    flags = FLAGS[isa()]
    digest = hashlib.sha256((SOURCE + " ".join(flags) + torch.__version__).encode()).hexdigest()[:16]
    # Resolved: torch's builder (ninja) rebuilds a library whose recorded command names another
    # path, so a cache reached through a link builds once, not once a path to it.
    folder = (cache_root() / "kernels").resolve() / f"a8-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"staticrt_a8_{digest}"
    if not (folder / f"{name}.so").exists():
        log.info("compiling staticrt's CPU kernels (int8-activation, float32 decode) once into %s (about 20 s)", folder)
    from torch.utils.cpp_extension import load_inline

    try:
        load_inline(
            name,
            cpp_sources=SOURCE,
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
        )
    except (RuntimeError, OSError) as err:  # no compiler, or one without these flags
        raise ConfigError(
            f"staticrt's CPU kernels, which could not be built in {folder}: {str(err).splitlines()[0]}; "
            f"install a C++ compiler that takes {' '.join(flags)} (g++ 10 or newer does)"
        ) from None
    # for torch.compile: x [M, K] (a row an expert's input for the experts) -> [M, N], N int8's scales'
    # last length, int4's `n`
    fakes = {
        "int8_linear": lambda x, codes, scales: x.new_empty(x.shape[0], scales.shape[-1]),
        "int4_linear": lambda x, codes, dm, n: x.new_empty(x.shape[0], n),
        "int8_experts": lambda x, codes, scales, index: x.new_empty(x.shape[0], scales.shape[-1]),
        "int4_experts": lambda x, codes, dm, index, n: x.new_empty(x.shape[0], n),
    }
    for op, fake in fakes.items():
        torch.library.register_fake(f"staticrt::{op}")(fake)
    torch.library.register_fake("staticrt::f32_packed_linear")(_packed_shape)
    torch.library.register_fake("staticrt::f32_experts")(_f32_experts_shape)
    _loaded = True


def _f32_experts_shape(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1] * w.shape[3])  # [R, K] x [E, G, K, 16] -> [R, G * 16]


def _packed_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] * w.shape[2])  # [M, K] x [B, Kp, NB] -> [M, B * NB]
