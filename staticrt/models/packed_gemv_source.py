"""The C++ of `f32_packed_linear` (packed_gemv.py says why and when it runs) and `f32_experts`
(packed_experts.py), built into the a8 kernels' library (a8_kernels.py), as a fragment of its
`staticrt` operator namespace."""

SOURCE = r"""
// The vector type and its intrinsics: AVX-512's 16 lanes, else AVX2's 8 (VEC(loadu_ps) is
// _mm512_loadu_ps or _mm256_loadu_ps)
#if defined(__AVX512F__)
typedef __m512 vecf;
constexpr int LANES = 16, REGISTERS = 32;
#define VEC(op) _mm512_##op
#else
typedef __m256 vecf;
constexpr int LANES = 8, REGISTERS = 16;
#define VEC(op) _mm256_##op
#endif

// R rows of x (a row every K floats) against one block of oneDNN's packed weight: NB = V * LANES
// channels, channel j of the block at w[k * NB + j] for each k. Each k loads the block's NB weights
// once and multiplies them by every row's x[k]: out[r * NB + j] = sum_k x[r, k] w[k * NB + j].
template <int V, int R> static void packed_block(const float* x, int64_t K, const float* w, float* out) {
  vecf acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = VEC(setzero_ps)();
  for (int64_t k = 0; k < K; ++k) {
    vecf wv[V];
    for (int v = 0; v < V; ++v) wv[v] = VEC(loadu_ps)(w + k * V * LANES + v * LANES);
    for (int r = 0; r < R; ++r) {
      const vecf xv = VEC(set1_ps)(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = VEC(fmadd_ps)(wv[v], xv, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) VEC(storeu_ps)(out + r * V * LANES + v * LANES, acc[r][v]);
}

// Rows m0 .. m0 + rows of a block, as many a pass as the registers hold ((R + 1) * V of them).
template <int V> static void packed_rows(const float* x, int64_t K, const float* w, float* out, int64_t rows) {
  constexpr int R = (5 * V <= REGISTERS) ? 4 : (3 * V <= REGISTERS) ? 2 : 1;
  int64_t r = 0;
  for (; r + R <= rows; r += R) packed_block<V, R>(x + r * K, K, w, out + r * V * LANES);
  for (; r < rows; ++r) packed_block<V, 1>(x + r * K, K, w, out + r * V * LANES);
}

// x [M, K] float32 (M <= 4), w [B, Kp, NB] float32 (oneDNN's packed copy of an [N, K] weight, N <=
// B * NB, K <= Kp, NB a multiple of the vector's lanes) -> [M, B * NB] float32 (x w^T, the channels
// past N from oneDNN's zero padding): each thread takes whole blocks, read once whatever M is.
torch::Tensor f32_packed_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) <= 4 && x.scalar_type() == torch::kFloat,
              "f32_packed_linear: x must be [M <= 4, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == torch::kFloat && x.size(1) <= w.size(1),
              "f32_packed_linear: w must be [B, Kp >= K, NB] float32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), B = w.size(0), Kp = w.size(1), NB = w.size(2);
  const int64_t V = NB / LANES;
  TORCH_CHECK(NB % LANES == 0 && (V == 1 || V == 2 || V == 4 || V == 8),
              "f32_packed_linear: NB must be 1, 2, 4 or 8 vectors");
  x = x.contiguous();
  auto y = torch::empty({M, B * NB}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> scratch;
  #pragma omp parallel for schedule(static) private(scratch)
  for (int64_t b = 0; b < B; ++b) {
    scratch.resize(M * NB);  // a block's outputs, row by row, then scattered into y's rows
    const float* wb = wp + b * Kp * NB;
    switch (V) {
      case 1: packed_rows<1>(xp, K, wb, scratch.data(), M); break;
      case 2: packed_rows<2>(xp, K, wb, scratch.data(), M); break;
      case 4: packed_rows<4>(xp, K, wb, scratch.data(), M); break;
      default: packed_rows<8>(xp, K, wb, scratch.data(), M); break;
    }
    for (int64_t m = 0; m < M; ++m) std::copy_n(scratch.data() + m * NB, NB, yp + m * B * NB + b * NB);
  }
  return y;
}

// x [R, K] float32, w [E, G, K, 16] float32 (each expert's [N, K] stack in blocks of 16 channels,
// f32_packed_linear's layout with NB = 16: packed_experts.py), index [R] int64 -> [R, G * 16]
// float32: row r through expert index[r] (a mixture of experts' decode step), read in place
torch::Tensor f32_experts(torch::Tensor x, torch::Tensor w, torch::Tensor index) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "f32_experts: x must be [R, K] float32");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == torch::kFloat && w.size(2) == x.size(1) &&
                  w.size(3) == 16,
              "f32_experts: w must be [E, G, K, 16] float32, contiguous");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), E = w.size(0), G = w.size(1);
  auto y = torch::empty({R, G * 16}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  each_expert_block<16>(index, R, E, G * 16, "f32_experts", [&](int64_t r, int64_t n0, int rows, int64_t e) {
    packed_block<16 / LANES, 1>(xp + r * K, K, wp + (e * G * 16 + n0) * K, yp + r * G * 16 + n0);
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(staticrt, m) {
  m.def("f32_packed_linear(Tensor x, Tensor w) -> Tensor");
  m.def("f32_experts(Tensor x, Tensor w, Tensor index) -> Tensor");
}
TORCH_LIBRARY_IMPL(staticrt, CPU, m) {
  m.impl("f32_packed_linear", &f32_packed_linear);
  m.impl("f32_experts", &f32_experts);
}
"""
