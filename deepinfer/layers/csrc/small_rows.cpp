// y[M, N] = x[M, K] @ W[N, K]^T + b for a few rows of x (decode, batched decode, spec verify),
// float32 or bfloat16 (weights and activations of one dtype), accumulated in float32.
//
// A few rows are weight-bandwidth bound: each weight row is read once, from memory, and dotted
// with every row of x (which stays in cache) in a tile of output rows x activation rows.
//
// Every output y[m, n] is one fixed function of x[m] and W[n]: eight lane sums over K in order
// (one FMA per 8 values), a fixed tree over the lanes, then the K % 8 tail and the bias. It does
// not depend on M, on the tile the value fell in, or on the thread that computed it, so a decode
// row and the same row inside a verify span get the same bits, on any thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 4;  // output rows per tile: their weights are read once for all of x
constexpr int64_t kTileCols = 3;  // activation rows per tile: 4 x 3 accumulators fit the registers

float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename W>
float weight_at(const W* w, int64_t k) {
  if constexpr (std::is_same_v<W, float>) return w[k];
  else return bf16_to_float(w[k]);
}

#ifdef __AVX2__
template <typename W>
__m256 load8(const W* w) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(w);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

float lane_sum(__m256 v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the same tree everywhere
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[c][r] = dot(x row c, W row r) over the first K8 values, for R weight rows and C x rows.
template <int R, int C, typename W>
void tile_dots(const W* const* w, const float* const* x, int64_t K8, float out[C][R]) {
  __m256 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = _mm256_loadu_ps(x[c] + k);
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(wv[r], xv, acc[c][r]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c][r] = lane_sum(acc[c][r]);
}
#else
// The same arithmetic in portable code: eight lane sums, the same tree.
template <int R, int C, typename W>
void tile_dots(const W* const* w, const float* const* x, int64_t K8, float out[C][R]) {
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < K8; k += 8)
        for (int i = 0; i < 8; ++i) l[i] = std::fma(weight_at(w[r], k + i), x[c][k + i], l[i]);
      out[c][r] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    }
}
#endif

// R weight rows starting at n against every x row, written to y with the K % 8 tail and bias.
template <int R, typename W, typename Y>
void row_tile(const W* wp, const float* xp, const float* bias, int64_t n, int64_t M, int64_t K, int64_t N, Y* y) {
  const int64_t K8 = K - K % 8;
  const W* w[R];
  for (int r = 0; r < R; ++r) w[r] = wp + (n + r) * K;
  auto finish = [&](const float* xr, int64_t m, const float* dots) {
    for (int r = 0; r < R; ++r) {
      float v = dots[r];
      for (int64_t k = K8; k < K; ++k) v = std::fma(weight_at(w[r], k), xr[k], v);
      if (bias) v += bias[n + r];
      y[m * N + n + r] = static_cast<Y>(v);
    }
  };
  int64_t m = 0;
  for (; m + kTileCols <= M; m += kTileCols) {
    const float* x[kTileCols];
    for (int c = 0; c < kTileCols; ++c) x[c] = xp + (m + c) * K;
    float out[kTileCols][R];
    tile_dots<R, kTileCols>(w, x, K8, out);
    for (int c = 0; c < kTileCols; ++c) finish(x[c], m + c, out[c]);
  }
  for (; m < M; ++m) {  // the last M % 3 rows one at a time: same per-value arithmetic
    const float* x[1] = {xp + m * K};
    float out[1][R];
    tile_dots<R, 1>(w, x, K8, out);
    finish(x[0], m, out[0]);
  }
}

template <typename W, typename Y>
void run(const W* wp, const float* xp, const float* bias, int64_t M, int64_t K, int64_t N, Y* y) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  // at least 1M weights per task: waking a sleeping (passive) worker and waiting for it costs
  // more than reading a smaller layer alone, by far when other jobs hold the cores
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / (kTileRows * K));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kTileRows;
      if (n + kTileRows <= N) {
        row_tile<kTileRows>(wp, xp, bias, n, M, K, N, y);
      } else {
        for (int64_t i = n; i < N; ++i) row_tile<1>(wp, xp, bias, i, M, K, N, y);
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "weight must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "x must be [M, K] of the weight's dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [N, K] tensor with K = x.size(1)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // a few rows: widened once
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (dtype == at::kFloat) {
    run(weight.data_ptr<float>(), xf.data_ptr<float>(), bp, M, K, N, y.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), xf.data_ptr<float>(), bp, M, K, N,
        y.data_ptr<at::BFloat16>());
  }
  return y;
}

std::string isa() {
#ifdef __AVX2__
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_rows, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
