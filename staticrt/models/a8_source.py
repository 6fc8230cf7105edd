"""The C++ of staticrt's int8-activation kernels (a8_kernels.py says what they compute, with a
worked example, and builds this source once a machine): `int8_linear`, `int4_linear`, and
`int8_experts` and `int4_experts`, which run each row through its own expert's codes (expert_quant.py)."""

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Each weight load first asks for the bytes 8 KB ahead: enough misses in flight to stream from DRAM at
// 34-37 GB/s on 2 EPYC cores, not 25-29 (docs/measurements.md); a prefetch is a hint, never a fault.
template <class T> inline const T* fetched(const T* p) { _mm_prefetch((const char*)p + 8192, _MM_HINT_T0); return p; }

// x [M, K] float32 -> int8 codes q [M, K] and, a block of 32, scales s [M, B] and code sums times
// scale sum [M, B] (what int4's minimums multiply)
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> s, sum;
};
static QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), B = K / 32;
  const float* xp = x.data_ptr<float>();
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * B), std::vector<float>(M * B)};
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
      r.sum[m * B + b] = s * sum;
    }
  return r;
}

// `rows` (1..4) channels of int8 codes (w, a channel every K bytes; scales s) against one row's
// codes xr and block scales xsr -> out[0 .. rows): 4 channels at a time share each activation block
static inline void int8_rows(const int8_t* xr, const float* xsr, const int8_t* w, const float* s, int64_t K, int rows,
                             float* out) {
  const int64_t B = K / 32;
#if defined(__AVX512VNNI__)
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < K / 64; ++c) {
    const __m512i xv = _mm512_loadu_si512(xr + c * 64);
    const __mmask64 negative = _mm512_movepi8_mask(xv);
    const __m512i magnitude = _mm512_abs_epi8(xv);
    const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(xsr[2 * c]), _mm256_set1_ps(xsr[2 * c + 1]), 1);
    for (int j = 0; j < rows; ++j) {
      __m512i wv = _mm512_loadu_si512(fetched(w + j * K + c * 64));
      wv = _mm512_mask_sub_epi8(wv, negative, zero, wv);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, magnitude, wv)), scale, acc[j]);
    }
  }
  for (int j = 0; j < rows; ++j) out[j] = _mm512_reduce_add_ps(acc[j]) * s[j];
#else  // AVX2: one block of 32 a step; maddubs takes |x| against w with x's sign (pairs fit int16)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < B; ++b) {
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xr + b * 32));
    const __m256i magnitude = _mm256_sign_epi8(xv, xv);
    const __m256 scale = _mm256_set1_ps(xsr[b]);
    for (int j = 0; j < rows; ++j) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)fetched(w + j * K + b * 32));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv, xv));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), scale, acc[j]);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    out[j] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter))) * s[j];
  }
#endif
}

// run(m, n0, rows) for every row m and each 4 channels n0.. of a matrix of N (rows: 4, or what is
// left), the channels split between threads: 4 channels at a time share each activation block
template <class Run> static void each_channel_block(int64_t M, int64_t N, Run run) {
  #pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += 4)
    for (int64_t m = 0; m < M; ++m) run(m, n0, (int)std::min<int64_t>(4, N - n0));
}

// A mixture of experts' step: index [R] (checked in 0..E-1) names the expert row r of x goes
// through; run(r, n0, rows, channel) for each row and each 4 channels n0.. of its expert, channel
// being n0's row in the stack seen as one [E * N, K] matrix (expert 3's channel 5: 3 * N + 5)
template <class Run> static void each_expert_block(const torch::Tensor& index, int64_t R, int64_t E, int64_t N,
                                                   const char* op, Run run) {
  TORCH_CHECK(index.size(0) == R, op, ": index must have a row of x each");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < E, op, ": an expert index outside 0..E-1");
  const int64_t blocks = (N + 3) / 4;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < R * blocks; ++t) {
    const int64_t r = t / blocks, n0 = (t % blocks) * 4;
    run(r, n0, (int)std::min<int64_t>(4, N - n0), ip[r] * N + n0);
  }
}

// x [M, K] float32 (K % 64 == 0), w [N, K] int8, scales [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), B = K / 32;
  TORCH_CHECK(K % 64 == 0 && w.size(1) == K, "int8_linear: K must be a multiple of 64 and match w");
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_channel_block(M, N, [&](int64_t m, int64_t n0, int rows) {
    int8_rows(xr.q.data() + m * K, xr.s.data() + m * B, wp + n0 * K, sp + n0, K, rows, yp + m * N + n0);
  });
  return y;
}

// x [R, K] float32 (K % 64 == 0), codes [E, N, K] int8, scales [E, N] float32, index [R] int64 ->
// [R, N] float32: row r through expert index[r] (a mixture of experts' step: each token's k
// chosen experts), reading only the chosen experts' codes
torch::Tensor int8_experts(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor index) {
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = codes.size(0), N = codes.size(1), B = K / 32;
  TORCH_CHECK(K % 64 == 0 && codes.size(2) == K, "int8_experts: K must be a multiple of 64 and match the codes");
  auto y = torch::empty({R, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_expert_block(index, R, E, N, "int8_experts", [&](int64_t r, int64_t n0, int rows, int64_t channel) {
    int8_rows(xr.q.data() + r * K, xr.s.data() + r * B, cp + channel * K, sp + channel, K, rows, yp + r * N + n0);
  });
  return y;
}

// (s_2c, s_2c+1, S_2c, S_2c+1) a row and 64-value step: the activation blocks' scales and code sums
// times scale, in the order int4's (d, d, m, m) multiply them
static std::vector<float> step_scales(const QuantizedRows& x, int64_t M, int64_t C) {
  std::vector<float> sS(M * C * 4);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      float* out = sS.data() + (m * C + c) * 4;
      out[0] = x.s[m * 2 * C + 2 * c], out[1] = x.s[m * 2 * C + 2 * c + 1];
      out[2] = x.sum[m * 2 * C + 2 * c], out[3] = x.sum[m * 2 * C + 2 * c + 1];
    }
  return sS;
}

// `rows` (1..4) channels of int4 codes (w, a channel every K / 2 bytes; dm, (d, d, m, m) a step, a
// channel every K / 16) against one row's codes xr and step scales sr -> out[0 .. rows)
static inline void int4_rows(const int8_t* xr, const float* sr, const uint8_t* w, const uint16_t* dm, int64_t K,
                             int rows, float* out) {
  const int64_t C = K / 64;
  __m128 mins[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
#if defined(__AVX512VNNI__)
  const __m512i zero = _mm512_setzero_si512();
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < C; ++c) {
    const __m512i xv = _mm512_loadu_si512(xr + c * 64);
    const __m128 ss = _mm_loadu_ps(sr + c * 4);
    for (int j = 0; j < rows; ++j) {
      const __m256i packed = _mm256_loadu_si256((const __m256i*)fetched(w + j * (K / 2) + c * 32));
      const __m256i low = _mm256_and_si256(packed, _mm256_set1_epi8(15));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(15));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      const __m128i halves = _mm_loadl_epi64((const __m128i*)(dm + j * (K / 16) + c * 4));
      const __m128 dmv = _mm_mul_ps(_mm_cvtph_ps(halves), ss);  // (d s, d s, m S, m S)
      const __m512 scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(dmv));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, xv)), scale, acc[j]);
      mins[j] = _mm_add_ps(mins[j], dmv);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const __m128 hi = _mm_movehl_ps(mins[j], mins[j]);  // lanes 2, 3: the minimums' terms
    const float minimums = _mm_cvtss_f32(_mm_add_ss(hi, _mm_movehdup_ps(hi)));
    out[j] = _mm512_reduce_add_ps(acc[j]) + minimums;
  }
#else  // AVX2: maddubs takes q (unsigned) against xr (pairs fit int16: 2 * 15 * 127)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < C; ++c) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xr + c * 64));
    const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xr + c * 64 + 32));
    const __m128 ss = _mm_loadu_ps(sr + c * 4);
    for (int j = 0; j < rows; ++j) {
      const __m256i packed = _mm256_loadu_si256((const __m256i*)fetched(w + j * (K / 2) + c * 32));
      const __m256i low = _mm256_and_si256(packed, _mm256_set1_epi8(15));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(15));
      const __m128i halves = _mm_loadl_epi64((const __m128i*)(dm + j * (K / 16) + c * 4));
      const __m128 dmv = _mm_mul_ps(_mm_cvtph_ps(halves), ss);  // (d s, d s, m S, m S)
      const __m256i dot0 = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x0), ones);
      const __m256i dot1 = _mm256_madd_epi16(_mm256_maddubs_epi16(high, x1), ones);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_broadcastss_ps(dmv), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_broadcastss_ps(_mm_movehdup_ps(dmv)), acc[j]);
      mins[j] = _mm_add_ps(mins[j], dmv);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    const __m128 hi = _mm_movehl_ps(mins[j], mins[j]);
    out[j] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter))) +
                         _mm_cvtss_f32(_mm_add_ss(hi, _mm_movehdup_ps(hi)));
  }
#endif
}

// x [M, K] float32 (K % 64 == 0), codes [N, K / 2] uint8 (two a byte, module docstring),
// dm [N, K / 16] float16 ((d, d, m, m) a 64-weight step) -> [M, N] float32
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor dm) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), C = K / 64;
  TORCH_CHECK(K % 64 == 0 && codes.size(1) * 2 == K && dm.size(1) * 16 == K,
              "int4_linear: K must be a multiple of 64 and match the codes and scales");
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const std::vector<float> sS = step_scales(xr, M, C);
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const uint16_t* dmp = (const uint16_t*)dm.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  each_channel_block(M, N, [&](int64_t m, int64_t n0, int rows) {
    int4_rows(xr.q.data() + m * K, sS.data() + m * C * 4, wp + n0 * (K / 2), dmp + n0 * (K / 16), K, rows,
              yp + m * N + n0);
  });
  return y;
}

// x [R, K] float32 (K % 64 == 0), codes [E, N, K / 2] uint8, dm [E, N, K / 16] float16, index [R]
// int64 -> [R, N] float32: int8_experts for int4 codes
torch::Tensor int4_experts(torch::Tensor x, torch::Tensor codes, torch::Tensor dm, torch::Tensor index) {
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = codes.size(0), N = codes.size(1), C = K / 64;
  TORCH_CHECK(K % 64 == 0 && codes.size(2) * 2 == K && dm.size(2) * 16 == K,
              "int4_experts: K must be a multiple of 64 and match the codes and scales");
  auto y = torch::empty({R, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const std::vector<float> sS = step_scales(xr, R, C);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dmp = (const uint16_t*)dm.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  each_expert_block(index, R, E, N, "int4_experts", [&](int64_t r, int64_t n0, int rows, int64_t channel) {
    int4_rows(xr.q.data() + r * K, sS.data() + r * C * 4, cp + channel * (K / 2), dmp + channel * (K / 16), K, rows,
              yp + r * N + n0);
  });
  return y;
}

TORCH_LIBRARY(staticrt, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor dm) -> Tensor");
  m.def("int8_experts(Tensor x, Tensor codes, Tensor scales, Tensor index) -> Tensor");
  m.def("int4_experts(Tensor x, Tensor codes, Tensor dm, Tensor index) -> Tensor");
}
TORCH_LIBRARY_IMPL(staticrt, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_experts", &int8_experts);
  m.impl("int4_experts", &int4_experts);
}
"""
