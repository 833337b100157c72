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
//
// bfloat16 on a CPU with AVX512-BF16 takes x as it is (no widening) and W in its row-major
// layout: one `vdpbf16ps` multiplies 32 bf16 pairs and adds each two neighbouring products into
// one of 16 fp32 lane sums (a product of two bf16 values is exact in fp32, so only the order of
// the sums differs from F.linear). Each output is then sixteen lane sums over K in order (the
// K % 32 tail by masked loads into the same lanes, zeros elsewhere), a fixed tree over the lanes,
// and the bias: again one function of x[m] and W[n] alone.

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

#if defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEEPINFER_DPBF16 1
#endif

namespace {

constexpr int64_t kTileRows = 4;  // output rows per tile: their weights are read once for all of x
constexpr int64_t kTileCols = 3;  // activation rows per tile: 4 x 3 accumulators fit the registers
// bf16 tiles ask for the weight rows this far ahead while they read theirs: with the hardware
// prefetcher alone the kernel streamed large layers (LM head, gate/up) from memory far slower
// than oneDNN does its packed weights (docs/figures/execution.md)
constexpr int64_t kPrefetchRows = 16;

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

#ifdef DEEPINFER_DPBF16
// The lane sums of 16 accumulators in one vector, v[j] -> out lane j, by one tree for every j:
// within each 128-bit lane (l0 + l2) + (l1 + l3), then (L0 + L1) + (L2 + L3) over those lanes.
// 45 shuffles and adds instead of 16 separate reductions (which cost half as much as the dots
// themselves at K = 576).
[[gnu::always_inline]] inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// y[m0 + c, n0 + r] for r < R weight rows and c < C x rows (bf16, both row-major, row length K).
// Accumulator 4c + r holds the pair sums of (c, r); missing rows stay zero and are not stored.
// The 16 accumulators are named variables: GCC keeps an array of them in memory, stored back at
// every step.
template <int R, int C>
void bf16_tile(const uint16_t* wp, const uint16_t* xp, const float* bias, int64_t n0, int64_t m0, int64_t K,
               int64_t N, at::BFloat16* y) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
  const uint16_t* w = wp + n0 * K;
  const uint16_t* x = xp + m0 * K;
  const bool first_pass = m0 == 0;  // later passes over these weight rows find them in L1
  for (int64_t k = 0; k < K; k += 32) {  // the K % 32 tail by masked loads (zeros beyond K)
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh wv[4], xv[4];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int c = 0; c < C; ++c) xv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + c * K + k);
    if (first_pass)  // one line of each of 4 later rows (prefetches never fault past the end)
      for (int r = 0; r < kTileRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + r) * K + k), _MM_HINT_T0);
#define DEEPINFER_DOT(acc, r, c) \
  if constexpr (r < R && c < C) acc = _mm512_dpbf16_ps(acc, wv[r], xv[c]);
    DEEPINFER_DOT(a0, 0, 0) DEEPINFER_DOT(a1, 1, 0) DEEPINFER_DOT(a2, 2, 0) DEEPINFER_DOT(a3, 3, 0)
    DEEPINFER_DOT(a4, 0, 1) DEEPINFER_DOT(a5, 1, 1) DEEPINFER_DOT(a6, 2, 1) DEEPINFER_DOT(a7, 3, 1)
    DEEPINFER_DOT(a8, 0, 2) DEEPINFER_DOT(a9, 1, 2) DEEPINFER_DOT(a10, 2, 2) DEEPINFER_DOT(a11, 3, 2)
    DEEPINFER_DOT(a12, 0, 3) DEEPINFER_DOT(a13, 1, 3) DEEPINFER_DOT(a14, 2, 3) DEEPINFER_DOT(a15, 3, 3)
#undef DEEPINFER_DOT
  }
  const __m512 acc[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  __m512 sums = lane_sums16(acc);
  if (bias) sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((1 << R) - 1, bias + n0)));
  alignas(32) uint16_t out[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sums));
  for (int c = 0; c < C; ++c) std::memcpy(y + (m0 + c) * N + n0, out + 4 * c, R * sizeof(uint16_t));
}

// R weight rows from n0 against every x row, kTileRows x rows at a time.
template <int R>
void bf16_rows(const uint16_t* wp, const uint16_t* xp, const float* bias, int64_t n0, int64_t M, int64_t K,
               int64_t N, at::BFloat16* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) bf16_tile<R, 4>(wp, xp, bias, n0, m, K, N, y);
  switch (M - m) {
    case 3: bf16_tile<R, 3>(wp, xp, bias, n0, m, K, N, y); break;
    case 2: bf16_tile<R, 2>(wp, xp, bias, n0, m, K, N, y); break;
    case 1: bf16_tile<R, 1>(wp, xp, bias, n0, m, K, N, y); break;
    default: break;
  }
}

void run_bf16(const uint16_t* wp, const uint16_t* xp, const float* bias, int64_t M, int64_t K, int64_t N,
              at::BFloat16* y) {
  static_assert(kTileRows == 4, "one bf16 tile is 4 weight rows x 4 x rows, 16 accumulators");
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / (kTileRows * K));  // as run() below
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kTileRows;
      switch (std::min<int64_t>(kTileRows, N - n)) {
        case 4: bf16_rows<4>(wp, xp, bias, n, M, K, N, y); break;
        case 3: bf16_rows<3>(wp, xp, bias, n, M, K, N, y); break;
        case 2: bf16_rows<2>(wp, xp, bias, n, M, K, N, y); break;
        default: bf16_rows<1>(wp, xp, bias, n, M, K, N, y); break;
      }
    }
  });
}
#endif

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
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef DEEPINFER_DPBF16
  if (dtype == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    run_bf16(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), bp, M, K, N, y.data_ptr<at::BFloat16>());
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // a few rows: widened once
  if (dtype == at::kFloat) {
    run(weight.data_ptr<float>(), xf.data_ptr<float>(), bp, M, K, N, y.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), xf.data_ptr<float>(), bp, M, K, N,
        y.data_ptr<at::BFloat16>());
  }
  return y;
}

std::string isa() {  // the code of bfloat16 calls (float32 ones run the AVX2 code where there is AVX-512)
#if defined(DEEPINFER_DPBF16)
  return "avx512_bf16";
#elif defined(__AVX2__)
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
