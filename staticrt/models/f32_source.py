"""The C++ of staticrt's float32 matrix-vector kernels (f32_kernels.py says why and builds it with
the int8-activation kernels, a8_source.py, whose `fetched` and thread splits it uses):
`f32_linear`, a decode step's product of a few rows by a row-major weight, and `f32_experts`, each
row through its own expert's weights read in place (a mixture of experts' decode step)."""

SOURCE = r"""
// Rows of x a kernel call takes at most as matrix-vector products; more go to torch's GEMM.
constexpr int64_t GEMV_ROWS = 4;

// `rows` (1..4) channels of float32 weights (w, a channel every K floats) against one activation
// row xr -> out[0 .. rows): 4 channels share each load of 16 activations, two accumulators a
// channel keep two FMA chains in flight (K % 16 == 0)
static inline void f32_rows(const float* xr, const float* w, int64_t K, int rows, float* out) {
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(xr + k);
    for (int j = 0; j < rows; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(fetched(w + j * K + k)), xv, acc[j]);
  }
  for (int j = 0; j < rows; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
#else
  __m256 acc[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(xr + k), x1 = _mm256_loadu_ps(xr + k + 8);
    for (int j = 0; j < rows; ++j) {
      const float* wj = fetched(w + j * K + k);
      acc[2 * j] = _mm256_fmadd_ps(_mm256_loadu_ps(wj), x0, acc[2 * j]);
      acc[2 * j + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 8), x1, acc[2 * j + 1]);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const __m256 both = _mm256_add_ps(acc[2 * j], acc[2 * j + 1]);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    out[j] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
  }
#endif
}

// x [M, K] float32, w [N, K] float32 -> [M, N] float32 (x w^T): a decode step's M <= GEMV_ROWS
// rows on f32_rows where w is row-major and K % 16 == 0, anything else on torch's linear (a
// prefill's GEMM). A column-major w ([K, N] contiguous) streams row k's N outputs 4 KB at a time
// with a page (and a TLB entry) a row: 10.5 GB/s against 18.5 row-major on bench-qwen3's
// matrices (docs/measurements.md), so F32Linear holds its weight row-major.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "f32_linear: w must be [N, K], K as x's");
  if (M > GEMV_ROWS || !w.is_contiguous() || K % 16 != 0) return at::linear(x, w);
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_channel_block(M, N, [&](int64_t m, int64_t n0, int n) {
    f32_rows(xp + m * K, wp + n0 * K, K, n, yp + m * N + n0);
  });
  return y;
}

// x [R, K] float32 (K % 16 == 0), w [E, N, K] float32, index [R] int64 -> [R, N] float32: row r
// through expert index[r], reading only the chosen experts' weights
torch::Tensor f32_experts(torch::Tensor x, torch::Tensor w, torch::Tensor index) {
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  TORCH_CHECK(K % 16 == 0 && w.size(2) == K && w.is_contiguous(),
              "f32_experts: w must be [E, N, K], contiguous, K % 16 == 0");
  auto y = torch::empty({R, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_expert_block(index, R, E, N, "f32_experts", [&](int64_t r, int64_t n0, int rows, int64_t channel) {
    f32_rows(xp + r * K, wp + channel * K, K, rows, yp + r * N + n0);
  });
  return y;
}
"""
