"""The C++ of `int4_linear` and `int4_experts` (a8_kernels.py's worked example says what they
compute), built with a8_source.py's shared part into one library."""

SOURCE = r"""
// (s_2c, s_2c+1, S_2c, S_2c+1) a row and 64-value step: the activation blocks' scales and code sums
// times scale, in the order int4's (d, d, m, m) multiply them
static std::vector<float> step_scales(const QuantizedRows& x, int64_t M, int64_t C) {
  std::vector<float> sS(M * C * 4);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) {
      float* out = sS.data() + (m * C + c) * 4;
      out[0] = x.s[m * 2 * C + 2 * c], out[1] = x.s[m * 2 * C + 2 * c + 1];
      out[2] = out[0] * x.n[m * 2 * C + 2 * c], out[3] = out[1] * x.n[m * 2 * C + 2 * c + 1];
    }
  return sS;
}

// `rows` (1..4) channels of int4 codes (w, a channel every K / 2 bytes; dm, (d, d, m, m) a step, a
// channel every K / 16) against R rows' codes xr (a row every K) and step scales sr (a row every
// C * 4) -> out[r * N + 0 .. rows). Each load and unpacking of codes is shared by the R rows; a row's
// sums are the same operations in the same order whatever R, so prefill and decode agree to the bit.
template <int R>
static inline void int4_rows(const int8_t* xr, const float* sr, const uint8_t* w, const uint16_t* dm, int64_t K,
                             int rows, float* out, int64_t N) {
  const int64_t C = K / 64;
  __m128 mins[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) mins[r][j] = _mm_setzero_ps();
#if defined(__AVX512VNNI__)
  const __m512i zero = _mm512_setzero_si512();
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i xv[R];
    __m128 ss[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm512_loadu_si512(xr + r * K + c * 64);
      ss[r] = _mm_loadu_ps(sr + r * C * 4 + c * 4);
    }
    for (int j = 0; j < rows; ++j) {
      const __m256i packed = _mm256_loadu_si256((const __m256i*)fetched(w + j * (K / 2) + c * 32));
      const __m256i low = _mm256_and_si256(packed, _mm256_set1_epi8(15));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(15));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      const __m128 dmh = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(dm + j * (K / 16) + c * 4)));
      for (int r = 0; r < R; ++r) {
        const __m128 dmv = _mm_mul_ps(dmh, ss[r]);  // (d s, d s, m S, m S)
        const __m512 scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(dmv));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, q, xv[r])), scale, acc[r][j]);
        mins[r][j] = _mm_add_ps(mins[r][j], dmv);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < rows; ++j) {
      const __m128 hi = _mm_movehl_ps(mins[r][j], mins[r][j]);  // lanes 2, 3: the minimums' terms
      const float minimums = _mm_cvtss_f32(_mm_add_ss(hi, _mm_movehdup_ps(hi)));
      out[r * N + j] = _mm512_reduce_add_ps(acc[r][j]) + minimums;
    }
#else  // AVX2: maddubs takes q (unsigned) against xr (pairs fit int16: 2 * 15 * 127)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m256i x0[R], x1[R];
    __m128 ss[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = _mm256_loadu_si256((const __m256i*)(xr + r * K + c * 64));
      x1[r] = _mm256_loadu_si256((const __m256i*)(xr + r * K + c * 64 + 32));
      ss[r] = _mm_loadu_ps(sr + r * C * 4 + c * 4);
    }
    for (int j = 0; j < rows; ++j) {
      const __m256i packed = _mm256_loadu_si256((const __m256i*)fetched(w + j * (K / 2) + c * 32));
      const __m256i low = _mm256_and_si256(packed, _mm256_set1_epi8(15));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(15));
      const __m128 dmh = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(dm + j * (K / 16) + c * 4)));
      for (int r = 0; r < R; ++r) {
        const __m128 dmv = _mm_mul_ps(dmh, ss[r]);  // (d s, d s, m S, m S)
        const __m256i dot0 = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x0[r]), ones);
        const __m256i dot1 = _mm256_madd_epi16(_mm256_maddubs_epi16(high, x1[r]), ones);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_broadcastss_ps(dmv), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_broadcastss_ps(_mm_movehdup_ps(dmv)), acc[r][j]);
        mins[r][j] = _mm_add_ps(mins[r][j], dmv);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < rows; ++j) {
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r][j]), _mm256_extractf128_ps(acc[r][j], 1));
      const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
      const __m128 hi = _mm_movehl_ps(mins[r][j], mins[r][j]);
      out[r * N + j] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter))) +
                       _mm_cvtss_f32(_mm_add_ss(hi, _mm_movehdup_ps(hi)));
    }
#endif
}

// Rows a step of int4_linear shares each unpacking of codes between (2 and 8 were no faster)
constexpr int INT4_ROWS = 4;

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
  each_channel_block<4, INT4_ROWS>(M, N, [&](int64_t m, int64_t n0, int rows, int count) {
    const int8_t* xm = xr.q.data() + m * K;
    const float* sm = sS.data() + m * C * 4;
    if (count == INT4_ROWS)
      int4_rows<INT4_ROWS>(xm, sm, wp + n0 * (K / 2), dmp + n0 * (K / 16), K, rows, yp + m * N + n0, N);
    else
      int4_rows<1>(xm, sm, wp + n0 * (K / 2), dmp + n0 * (K / 16), K, rows, yp + m * N + n0, N);
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
  each_expert_block<4>(index, R, E, N, "int4_experts", [&](int64_t r, int64_t n0, int rows, int64_t e) {
    const int64_t channel = e * N + n0;  // in the stack seen as one [E * N, K] matrix
    int4_rows<1>(xr.q.data() + r * K, sS.data() + r * C * 4, cp + channel * (K / 2), dmp + channel * (K / 16), K,
                 rows, yp + r * N + n0, N);
  });
  return y;
}

TORCH_LIBRARY_IMPL(staticrt, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_experts", &int4_experts);
}
"""
