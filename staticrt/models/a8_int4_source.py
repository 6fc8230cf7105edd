"""The C++ of `int4_linear` and `int4_experts` (a8_kernels.py's worked example says what they
compute), built with a8_source.py's shared part into one library."""

SOURCE = r"""
// int4_linear's weight: int8_linear's groups of 16 channels, a byte holding two codes: codes [G, K / 8,
// 16, 4] (a8_linear.int4_groups), channel 16g + c's codes 8t + j in the low nibble of [g, t, c, j] and
// 8t + 4 + j in its high one (j < 4), so that a 64-byte load's low nibbles are 16 channels' codes
// 8t .. 8t + 3, what one vpdpbusd multiplies by 4 bytes of x in every lane, and its high nibbles the
// next 4; dm [G, K / 32, 2, 16] float16, a block's 16 scales d then 16 minimums m. Rows m .. m + R
// of x through the group at w: channel c's sum_b s_b (d_b sum_i q xq + m_b sum_i xq) into
// y[r * N + c], c < rows. A row's sums are the same operations in the same order whatever R, so
// prefill and decode agree to the bit.
template <int R>
static inline void int4_group(const QuantizedRows& x, int64_t m, const uint8_t* w, const uint16_t* dm, int64_t K,
                              int rows, float* y, int64_t N) {
  const RowsAt at = rows_at(x, m, K);
  float out[R][16];
#if defined(__AVX512VNNI__)
  const __m512i nibble = _mm512_set1_epi8(15);  // q is unsigned: vpdpbusd takes it against xq directly
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < at.B; ++b) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const __m512i packed = _mm512_loadu_si512(fetched(w + (b * 4 + t) * 64));
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      for (int r = 0; r < R; ++r) {
        int32_t four[2];
        std::memcpy(four, at.q + r * K + b * 32 + 8 * t, 8);
        dot[r] = _mm512_dpbusd_epi32(dot[r], low, _mm512_set1_epi32(four[0]));
        dot[r] = _mm512_dpbusd_epi32(dot[r], high, _mm512_set1_epi32(four[1]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + b * 32)));
    const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dm + b * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      const float s = at.s[r * at.B + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[r]);
      acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(s * (float)at.n[r * at.B + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
#else  // AVX2: vpmaddubsw takes q (unsigned) against xq (a pair fits int16: 2 * 15 * 127), 8 channels a register
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < at.B; ++b) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {
      const uint8_t* wt = fetched(w + (b * 4 + t) * 64);
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(wt + 32 * h));
        const __m256i low = _mm256_and_si256(packed, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < R; ++r) {
          int32_t four[2];
          std::memcpy(four, at.q + r * K + b * 32 + 8 * t, 8);
          const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(four[0])), ones);
          const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high, _mm256_set1_epi32(four[1])), ones);
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_add_epi32(lo, hi));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + b * 32 + 8 * h)));
      const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dm + b * 32 + 16 + 8 * h)));
      for (int r = 0; r < R; ++r) {
        const float s = at.s[r * at.B + b];
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(s * (float)at.n[r * at.B + b]), acc[r][h]);
      }
    }
  }
  store_halves<R>(out, acc);
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < rows; ++c) y[r * N + c] = out[r][c];
}

static void check_int4(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& dm, int64_t lead,
                       int64_t N, const char* op) {
  const int64_t K = x.size(1), G = (N + 15) / 16, at = codes.dim() - 4;
  TORCH_CHECK(K % 64 == 0 && codes.dim() == lead + 4 && codes.is_contiguous() && codes.size(at) == G &&
                  codes.size(at + 1) * 8 == K && codes.size(at + 2) == 16 && codes.size(at + 3) == 4 &&
                  dm.dim() == lead + 4 && dm.is_contiguous() && dm.size(at) == G && dm.size(at + 1) * 32 == K &&
                  dm.size(at + 2) == 2 && dm.size(at + 3) == 16,
              op, ": codes must be [N / 16 rounded up, K / 8, 16, 4] uint8 and dm [N / 16 rounded up, K / 32, 2, 16] ",
              "float16 (a8_linear.int4_groups), K a multiple of 64");
}

// x [M, K] float32 (K % 64 == 0), codes [G, K / 8, 16, 4] uint8 and dm [G, K / 32, 2, 16] float16
// (int4_group's layout) for n channels -> [M, n] float32
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor dm, int64_t n) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = n;
  check_int4(x, codes, dm, 0, N, "int4_linear");
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const uint16_t* dmp = (const uint16_t*)dm.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  each_channel_block<16, A8_ROWS>(M, N, [&](int64_t m, int64_t n0, int rows, int count) {
    if (count == A8_ROWS)
      int4_group<A8_ROWS>(xr, m, wp + n0 * (K / 2), dmp + n0 * (K / 16), K, rows, yp + m * N + n0, N);
    else
      int4_group<1>(xr, m, wp + n0 * (K / 2), dmp + n0 * (K / 16), K, rows, yp + m * N + n0, N);
  });
  return y;
}

// x [R, K] float32 (K % 64 == 0), codes [E, G, K / 8, 16, 4] uint8, dm [E, G, K / 32, 2, 16] float16
// (each expert's int4_linear layout), index [R] int64 -> [R, n] float32: int8_experts for int4 codes
torch::Tensor int4_experts(torch::Tensor x, torch::Tensor codes, torch::Tensor dm, torch::Tensor index, int64_t n) {
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = codes.size(0), N = n, G = (N + 15) / 16;
  check_int4(x, codes, dm, 1, N, "int4_experts");
  TORCH_CHECK(dm.size(0) == E, "int4_experts: codes and dm must hold the same experts");
  auto y = torch::empty({R, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* dmp = (const uint16_t*)dm.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  each_expert_block<16>(index, R, E, N, "int4_experts", [&](int64_t r, int64_t n0, int rows, int64_t e) {
    const int64_t channel = e * G * 16 + n0;  // in the stack seen as one [E * G * 16, K] matrix
    int4_group<1>(xr, r, cp + channel * (K / 2), dmp + channel * (K / 16), K, rows, yp + r * N + n0, N);
  });
  return y;
}

TORCH_LIBRARY_IMPL(staticrt, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_experts", &int4_experts);
}
"""
