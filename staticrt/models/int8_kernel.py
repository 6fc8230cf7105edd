"""staticrt's int8 matmul for CPUs with AVX512-VNNI or AVX2 (quantize "int8-a8"): int8 weights, one
scale an output channel, times activations the kernel quantizes to int8 in blocks of 32 along K (one
scale a block and row, llama.cpp's Q8 block), as integer dot products, float32 out.

torch's int8 weight-only kernel (`_weight_int8pack_mm`, what torchao's int8 runs) takes bfloat16
activations and multiplies in floats; this one multiplies the int8 weights as integers. SmolLM2-135M,
compiled, 2 threads, one `staticrt bench` run: decode 5.55 ms/token against torchao int8's 6.76 and
llama.cpp Q8_0's 5.56 (docs/measurements.md). Blocks of 32 keep its perplexity within 0.2-0.6% of
float; blocks of 64 cost 0.85% on 512 tokens, one scale a token 1.5%. A worked example, for row m
and channel n: x[m, 32b : 32b+32] has absmax a, so xq = round(x * 127 / a) in -127..127. The byte
products take |xq| (unsigned) against w with xq's sign, the same product. AVX512-VNNI's `vpdpbusd`
takes 64 bytes, two blocks: its int32 lanes 0-7 sum block 2c's products (4 bytes a lane), lanes
8-15 block 2c+1's, so they are scaled by a vector of the two blocks' a / 127. AVX2's `vpmaddubsw`
sums byte pairs into int16 (|xq| * |w| <= 127 * 127, so a pair fits), `vpmaddwd` pairs of those
into int32, one block a step. The row's float sum ends times the channel's scale.

Compiled on first use (torch's cpp_extension, ~20 s) into the user cache, once a machine, torch,
source and instruction set; a later process loads the library.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from ..artifacts.user_cache import cache_root
from ..errors import ConfigError

BLOCK = 32  # activation values a scale
STEP = 64  # bytes a VNNI instruction takes: K is a multiple of it
SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// x [M, K] float32 (K % 64 == 0), w [N, K] int8, scales [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / 32;
  TORCH_CHECK(K % 64 == 0 && w.size(1) == K, "int8_linear: K must be a multiple of 64 and match w");
  auto y = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * B);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* src = xp + m * K + b * 32;
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(src[i]));
      const float s = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / s;
      xs[m * B + b] = s;
      for (int i = 0; i < 32; ++i) xq[m * K + b * 32 + i] = (int8_t)std::nearbyint(src[i] * inv);
    }
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  #pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 4) {  // 4 channels at a time share each activation block
    const int rows = (int)std::min<int64_t>(4, N - n0);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq.data() + m * K;
      const float* xsr = xs.data() + m * B;
#if defined(__AVX512VNNI__)
      const __m512i zero = _mm512_setzero_si512();
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t c = 0; c < K / 64; ++c) {
        const __m512i xv = _mm512_loadu_si512(xr + c * 64);
        const __mmask64 negative = _mm512_movepi8_mask(xv);
        const __m512i magnitude = _mm512_abs_epi8(xv);
        const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(xsr[2 * c]), _mm256_set1_ps(xsr[2 * c + 1]), 1);
        for (int j = 0; j < rows; ++j) {
          __m512i wv = _mm512_loadu_si512(wp + (n0 + j) * K + c * 64);
          wv = _mm512_mask_sub_epi8(wv, negative, zero, wv);
          acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, magnitude, wv)), scale, acc[j]);
        }
      }
      for (int j = 0; j < rows; ++j) yp[m * N + n0 + j] = _mm512_reduce_add_ps(acc[j]) * sp[n0 + j];
#else  // AVX2: one block of 32 a step; maddubs takes |x| against w with x's sign (pairs fit int16)
      const __m256i ones = _mm256_set1_epi16(1);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t b = 0; b < B; ++b) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xr + b * 32));
        const __m256i magnitude = _mm256_sign_epi8(xv, xv);
        const __m256 scale = _mm256_set1_ps(xsr[b]);
        for (int j = 0; j < rows; ++j) {
          const __m256i wv = _mm256_loadu_si256((const __m256i*)(wp + (n0 + j) * K + b * 32));
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv, xv));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), scale, acc[j]);
        }
      }
      for (int j = 0; j < rows; ++j) {
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
        const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
        yp[m * N + n0 + j] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter))) * sp[n0 + j];
      }
#endif
    }
  }
  return y;
}

TORCH_LIBRARY(staticrt, m) { m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(staticrt, CPU, m) { m.impl("int8_linear", &int8_linear); }
"""
# The compiler flags of the kernel's build for each instruction set; `isa` picks the one this CPU runs.
FLAGS = {
    "avx512_vnni": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-fopenmp"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],
}
_loaded = False


def isa() -> str | None:
    """The instruction set the kernel is built for here: AVX512-VNNI, else AVX2 (with FMA), else None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())
    if {"avx512_vnni", "avx512bw", "avx512dq"} <= flags:
        return "avx512_vnni"
    return "avx2" if {"avx2", "fma"} <= flags else None


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine, or None where it can."""
    return None if isa() is not None else "this CPU has neither AVX512-VNNI nor AVX2 (or no /proc/cpuinfo says so)"


def load() -> None:
    """Make `torch.ops.staticrt.int8_linear` callable: the library from the user cache, compiled
    there first if absent; a machine that cannot run or build it is refused with the way out."""
    global _loaded
    if _loaded:
        return
    reason = unavailable()
    if reason is not None:
        raise ConfigError(f"quantize 'int8-a8' runs staticrt's int8 kernel, and {reason}; use --quantize int8")
    flags = FLAGS[isa()]
    digest = hashlib.sha256((SOURCE + " ".join(flags) + torch.__version__).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels" / f"int8-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"staticrt_int8_{digest}"
    if not (folder / f"{name}.so").exists():
        logging.getLogger("staticrt").info("compiling staticrt's int8 kernel once into %s (about 20 s)", folder)
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
            f"quantize 'int8-a8' could not build staticrt's int8 kernel in {folder}: {str(err).splitlines()[0]}; "
            f"install a C++ compiler that takes {' '.join(flags)} (g++ 10 or newer does), or use --quantize int8"
        ) from None
    torch.library.register_fake("staticrt::int8_linear")(_shape)
    _loaded = True


def _shape(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


class Int8Linear(nn.Module):
    """A projection (or the head) as int8 codes `[N, K]` with float32 scales `[N]` (absmax / 127
    of each output channel), run by the kernel; a fused projection's forward returns its parts."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: dict[str, int] | None = None):
        super().__init__()
        w = weight.detach().float()  # [N, K]
        scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("codes", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:  # x [..., K] -> [..., N]
        y = torch.ops.staticrt.int8_linear(x.reshape(-1, x.shape[-1]), self.codes, self.scales)
        y = y.view(*x.shape[:-1], -1) if self.bias is None else y.view(*x.shape[:-1], -1) + self.bias
        return y if self.parts is None else y.split(list(self.parts.values()), dim=-1)
