"""The C++ of `int8_linear` and `int8_experts` (a8_kernels.py's worked example says what they
compute), built with a8_source.py's shared part into one library."""

SOURCE = r"""
// int8_linear's weight: 16 channels a group, codes [G, K / 4, 16, 4] for N channels (G = N / 16
// rounded up, the channels past N zero): channel 16g + c's codes 4t .. 4t + 3 at [g, t, c, :], so a
// 64-byte load holds 16 channels' next 4 codes, what one vpdpbusd multiplies by 4 bytes of x in every
// lane, and a thread streams its groups from one address on (4 channels a K apart streamed at
// 17 GB/s, this at 25-29: docs/measurements.md). Rows m .. m + R of x through the group at w, each
// load of codes shared by the R rows: channel c's sum_b s_b sum_i w[c, 32b + i] xq[m + r, 32b + i]
// times scales[c] into y[r * N + c], c < rows (those past N dropped). A row's sums are the same,
// in the same order, whatever R.
template <int R>
static inline void int8_group(const QuantizedRows& x, int64_t m, const int8_t* w, const float* scales, int64_t K,
                              int rows, float* y, int64_t N) {
  const RowsAt at = rows_at(x, m, K);
  float out[R][16];
#if defined(__AVX512VNNI__)
  // vpdpbusd takes unsigned bytes against signed ones: w + 128 (w ^ 0x80) against xq, a block's
  // int32 sums starting from -128 times its code sum, so that they end at sum_i w xq exactly
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < at.B; ++b) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(-128 * at.n[r * at.B + b]);
    for (int t = 0; t < 8; ++t) {
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(fetched(w + (b * 8 + t) * 64)), flip);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, at.q + r * K + b * 32 + 4 * t, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(four));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(at.s[r * at.B + b]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
#else  // AVX2: vpmaddubsw takes |xq| against w with xq's sign (a pair fits int16), 8 channels a register
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < at.B; ++b) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const int8_t* wt = fetched(w + (b * 8 + t) * 64);
      const __m256i wv[2] = {_mm256_loadu_si256((const __m256i*)wt), _mm256_loadu_si256((const __m256i*)(wt + 32))};
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, at.q + r * K + b * 32 + 4 * t, 4);
        const __m256i xv = _mm256_set1_epi32(four), magnitude = _mm256_sign_epi8(xv, xv);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(wv[h], xv));
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_set1_ps(at.s[r * at.B + b]), acc[r][h]);
  }
  store_halves<R>(out, acc);
#endif
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < rows; ++c) y[r * N + c] = out[r][c] * scales[c];
}

// x [M, K] float32 (K % 64 == 0), w [G, K / 4, 16, 4] int8 (int8_group's layout), scales [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(0);
  TORCH_CHECK(K % 64 == 0 && w.dim() == 4 && w.is_contiguous() && w.size(0) == (N + 15) / 16 && w.size(1) * 4 == K &&
                  w.size(2) == 16 && w.size(3) == 4,
              "int8_linear: w must be [N / 16 rounded up, K / 4, 16, 4] int8 (a8_linear.int8_groups), ",
              "K a multiple of 64");
  auto y = torch::empty({M, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_channel_block<16, A8_ROWS>(M, N, [&](int64_t m, int64_t n0, int rows, int count) {
    if (count == A8_ROWS)
      int8_group<A8_ROWS>(xr, m, wp + n0 * K, sp + n0, K, rows, yp + m * N + n0, N);
    else
      int8_group<1>(xr, m, wp + n0 * K, sp + n0, K, rows, yp + m * N + n0, N);
  });
  return y;
}

// x [R, K] float32 (K % 64 == 0), codes [E, G, K / 4, 16, 4] int8 (each expert's int8_linear
// layout), scales [E, N] float32, index [R] int64 -> [R, N] float32: row r through expert index[r]
// (a mixture of experts' step: each token's k chosen experts), reading only the chosen experts'
// codes, each channel's number what int8_linear gives for its expert
torch::Tensor int8_experts(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor index) {
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = codes.size(0), N = scales.size(1), G = (N + 15) / 16;
  TORCH_CHECK(K % 64 == 0 && codes.dim() == 5 && codes.is_contiguous() && codes.size(1) == G &&
                  codes.size(2) * 4 == K && codes.size(3) == 16 && codes.size(4) == 4,
              "int8_experts: codes must be [E, N / 16 rounded up, K / 4, 16, 4] int8 (a8_linear.int8_groups), ",
              "K a multiple of 64");
  auto y = torch::empty({R, N}, x.options());
  const QuantizedRows xr = quantize_rows(x);
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_expert_block<16>(index, R, E, N, "int8_experts", [&](int64_t r, int64_t n0, int rows, int64_t e) {
    int8_group<1>(xr, r, cp + (e * G * 16 + n0) * K, sp + e * N + n0, K, rows, yp + r * N + n0, N);
  });
  return y;
}

TORCH_LIBRARY_IMPL(staticrt, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_experts", &int8_experts);
}
"""
