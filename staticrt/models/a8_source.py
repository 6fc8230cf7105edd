"""The C++ every int8-activation kernel shares (a8_kernels.py says what they compute, with a worked
example, and builds this source with a8_int8_source.py's and a8_int4_source.py's once a machine):
the activation rows' quantization, the loops that split channels between threads, and the
`staticrt` operator namespace's schemas."""

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <cstring>
#include <omp.h>

// Each weight load first asks for the bytes 8 KB ahead: enough misses in flight to stream from DRAM at
// 34-37 GB/s on 2 EPYC cores, not 25-29 (docs/measurements.md); a prefetch is a hint, never a fault.
template <class T> inline const T* fetched(const T* p) { _mm_prefetch((const char*)p + 8192, _MM_HINT_T0); return p; }

// x [M, K] float32 -> int8 codes q [M, K] and, a block of 32, scales s [M, B] and code sums n [M, B]
// (what int8's unsigned offset and int4's minimums multiply)
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> n;
};
static QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  const float* xp = x.data_ptr<float>();
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * B), std::vector<int32_t>(M * B)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* src = xp + m * K + b * 32;
      float amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(src[i]));
      const float s = amax > 0 ? amax / 127.f : 1.f, inv = 1.f / s;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int8_t q = (int8_t)std::nearbyint(src[i] * inv);
        r.q[m * K + b * 32 + i] = q;
        sum += q;
      }
      r.s[m * B + b] = s;
      r.n[m * B + b] = sum;
    }
  return r;
}

// Row m of x's codes, scales and code sums (a block of 32 a scale and sum): what int8_group and
// int4_group read for their rows m, m + 1, ... (a row every K codes, every K / 32 scales and sums)
struct RowsAt {
  const int8_t* q;
  const float* s;
  const int32_t* n;
  int64_t B;
};
static inline RowsAt rows_at(const QuantizedRows& x, int64_t m, int64_t K) {
  return {x.q.data() + m * K, x.s.data() + m * (K / 32), x.n.data() + m * (K / 32), K / 32};
}

#if !defined(__AVX512VNNI__)
// AVX2's 16 channels in two registers a row, acc[r][0] channels 0..7 and acc[r][1] 8..15, into out[r]
template <int R> static inline void store_halves(float (*out)[16], __m256 (*acc)[2]) {
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}
#endif

// Rows a step of int8_linear and int4_linear shares each load of a group's codes between: as many as
// the registers hold
#if defined(__AVX512VNNI__)
constexpr int A8_ROWS = 4;
#else
constexpr int A8_ROWS = 2;
#endif

// run(m, n0, rows, count) for each W channels n0.. of a matrix of N (rows: W, or what is left) and
// its rows m .. m + count of x, count = R while R are left, then 1: the channels split between
// threads, R rows sharing each load of the W channels' weights
template <int W, int R, class Run> static void each_channel_block(int64_t M, int64_t N, Run run) {
  #pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    const int rows = (int)std::min<int64_t>(W, N - n0);
    int64_t m = 0;
    for (; m + R <= M; m += R) run(m, n0, rows, R);
    for (; m < M; ++m) run(m, n0, rows, 1);
  }
}

// A mixture of experts' step: index [R] (checked in 0..E-1) names the expert row r of x goes
// through; run(r, n0, rows, e) for each row, its expert e and each W channels n0.. of e's N (rows: W,
// or what is left)
template <int W, class Run> static void each_expert_block(const torch::Tensor& index, int64_t R, int64_t E, int64_t N,
                                                          const char* op, Run run) {
  TORCH_CHECK(index.size(0) == R, op, ": index must have a row of x each");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < E, op, ": an expert index outside 0..E-1");
  const int64_t blocks = (N + W - 1) / W;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < R * blocks; ++t) {
    const int64_t r = t / blocks, n0 = (t % blocks) * W;
    run(r, n0, (int)std::min<int64_t>(W, N - n0), ip[r]);
  }
}

TORCH_LIBRARY(staticrt, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor dm, int n) -> Tensor");
  m.def("int8_experts(Tensor x, Tensor codes, Tensor scales, Tensor index) -> Tensor");
  m.def("int4_experts(Tensor x, Tensor codes, Tensor dm, Tensor index, int n) -> Tensor");
}
"""
