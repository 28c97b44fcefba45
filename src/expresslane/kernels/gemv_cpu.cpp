// Small-batch linear layers for CPUs with AVX2 + FMA: y = x W^T (+ b), x float32 [M, K],
// W bfloat16 [N, K] (row-major, as stored by Hugging Face), y float32 [M, N].
//
// At decode batch sizes a linear layer is a matrix-vector product bound by the bytes of W
// it reads. Keeping W in bf16 halves those bytes against float32; CPUs without AVX-512 BF16
// have no bf16 dot product, so each 8-value chunk is widened to float32 in registers (a
// 16-bit shift) and fed to FMAs. Four output rows are computed together so their four
// accumulator chains hide FMA latency and each x chunk is loaded once per four rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline __m256 load_bf16x8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

inline float bf16_to_float(at::BFloat16 v) { return static_cast<float>(v); }

// Rows [n0, n0 + R) of W against M input vectors.
template <int M, int R>
void rows_kernel(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N,
                 int64_t n0, const float* bias) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16x8(w + (n0 + r) * K + k);
    for (int m = 0; m < M; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = K8; k < K; ++k) s += bf16_to_float(w[(n0 + r) * K + k]) * x[m * K + k];
      y[m * N + n0 + r] = s + (bias ? bias[n0 + r] : 0.0f);
    }
  }
}

template <int M>
void gemv(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N, const float* bias) {
  constexpr int R = M <= 2 ? 4 : 2;
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows_kernel<M, R>(x, w, y, K, N, b * R, bias);
  });
  for (int64_t n = blocks * R; n < N; ++n) rows_kernel<M, 1>(x, w, y, K, N, n, bias);
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kBFloat16, "x fp32, w bf16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes [M,K] x [N,K]");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value()) {
    bias_c = bias->to(torch::kFloat32).contiguous();
    b = bias_c.data_ptr<float>();
  }
  const auto* wp = w.data_ptr<at::BFloat16>();
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mb = std::min<int64_t>(4, M - m0);
    const float* xp = x.data_ptr<float>() + m0 * K;
    float* yp = y.data_ptr<float>() + m0 * N;
    switch (mb) {
      case 1: gemv<1>(xp, wp, yp, K, N, b); break;
      case 2: gemv<2>(xp, wp, yp, K, N, b); break;
      case 3: gemv<3>(xp, wp, yp, K, N, b); break;
      default: gemv<4>(xp, wp, yp, K, N, b); break;
    }
  }
  return y;
}

void register_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_stack(m);
  m.def("bf16_linear", &bf16_linear, "x (fp32) @ W^T (bf16) + b, for small batches (AVX2+FMA)");
}
