// Weight-only quantized matmul for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y fp32.
//
// W is stored in groups of 32 columns: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / 32,
// with int8 codes (one byte each) or 4-bit codes 0..15 packed 16 bytes per group, byte j holding
// column j in its low nibble and column j + 16 in its high one (the layout of GGUF's blocks, so a
// group unpacks into columns in order). Per output element:
//
//   y[m, n] = sum_g scale[n, g] * (q[n, g, :] . x[m, g, :]) + sum_g offset[n, g] * xsum[m, g]
//
// The codes are widened to fp32 and multiplied with the fp32 activations, so activations keep
// their precision; the weights are read at 1 or 1/2 byte per value, which is what batch-1 decode is
// bound by. Each output row n is computed by one thread in one fixed order, so the result does not
// depend on the thread count. Rows of x are taken MT at a time so a group's codes are widened once
// per MT rows. Built by deepinfer/quant/native.py with AVX2+FMA where torch runs AVX2, else as
// portable scalar code.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_MT = 4;  // activation rows per pass over a weight row

template <int BITS>
constexpr int64_t group_bytes() { return BITS == 8 ? GROUP : GROUP / 2; }

#ifdef DEEPINFER_AVX2

inline __m256 widen8(__m128i bytes8, bool is_signed) {
  __m256i v = is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8);
  return _mm256_cvtepi32_ps(v);
}

// One group's 32 codes as 4 x 8 floats, columns in order.
template <int BITS>
inline void widen_group(const uint8_t* q, __m256 w[4]) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < 4; ++i)
      w[i] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)), true);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);                     // columns 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // columns 16..31
    w[0] = widen8(lo, false);
    w[1] = widen8(_mm_srli_si128(lo, 8), false);
    w[2] = widen8(hi, false);
    w[3] = widen8(_mm_srli_si128(hi, 8), false);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_g scale[g] * (q[g] . x[m, g]) for MT rows of x (row stride K). Two accumulators per row
// (even and odd groups) so consecutive groups do not wait on one FMA chain.
template <int BITS, int MT>
void dot_rows(const float* x, int64_t K, const uint8_t* q, const float* scale, float* out) {
  __m256 acc[2][MT];
  for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const int64_t groups = K / GROUP;
  auto step = [&](int64_t g, int p) {
    __m256 w[4];
    widen_group<BITS>(q + g * group_bytes<BITS>(), w);
    const __m256 s = _mm256_broadcast_ss(scale + g);
    for (int m = 0; m < MT; ++m) {
      const float* xg = x + m * K + g * GROUP;
      __m256 d = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
      d = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), d);
      d = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), d);
      d = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), d);
      acc[p][m] = _mm256_fmadd_ps(d, s, acc[p][m]);
    }
  };
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    step(g, 0);
    step(g + 1, 1);
  }
  if (g < groups) step(g, 0);
  for (int m = 0; m < MT; ++m) out[m] = hsum(_mm256_add_ps(acc[0][m], acc[1][m]));
}

// a . b over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#else  // portable scalar code

template <int BITS>
inline float code(const uint8_t* q, int64_t j) {
  if constexpr (BITS == 8) {
    return static_cast<float>(static_cast<int8_t>(q[j]));
  } else {
    return static_cast<float>(j < 16 ? (q[j] & 0x0F) : (q[j - 16] >> 4));
  }
}

template <int BITS, int MT>
void dot_rows(const float* x, int64_t K, const uint8_t* q, const float* scale, float* out) {
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const uint8_t* qg = q + g * group_bytes<BITS>();
    for (int m = 0; m < MT; ++m) {
      const float* xg = x + m * K + g * GROUP;
      float d = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) d += code<BITS>(qg, j) * xg[j];
      out[m] += scale[g] * d;
    }
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#endif

template <int BITS, int MT>
void tile(const float* x, const float* xsum, int64_t K, int64_t N, int64_t n0, int64_t n1,
          const uint8_t* codes, const float* scale, const float* offset, const float* bias, float* y) {
  const int64_t groups = K / GROUP;
  const int64_t row_bytes = groups * group_bytes<BITS>();
  for (int64_t n = n0; n < n1; ++n) {
    float out[MT];
    dot_rows<BITS, MT>(x, K, codes + n * row_bytes, scale + n * groups, out);
    for (int m = 0; m < MT; ++m) {
      float v = out[m];
      if (offset != nullptr) v += dot(offset + n * groups, xsum + m * groups, groups);
      if (bias != nullptr) v += bias[n];
      y[m * N + n] = v;
    }
  }
}

template <int BITS>
void rows(const float* x, const float* xsum, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1,
          const uint8_t* codes, const float* scale, const float* offset, const float* bias, float* y) {
  const int64_t groups = K / GROUP;
  for (int64_t m0 = 0; m0 < M; m0 += MAX_MT) {
    const float* xm = x + m0 * K;
    const float* sm = xsum + m0 * groups;
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(MAX_MT, M - m0)) {
      case 1: tile<BITS, 1>(xm, sm, K, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 2: tile<BITS, 2>(xm, sm, K, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 3: tile<BITS, 3>(xm, sm, K, N, n0, n1, codes, scale, offset, bias, ym); break;
      default: tile<BITS, 4>(xm, sm, K, N, n0, n1, codes, scale, offset, bias, ym); break;
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                  const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                  int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), groups = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "in_features (", K, ") must be a multiple of ", GROUP);
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.dim() == 2 &&
              codes.size(1) == (bits == 8 ? K : K / 2), "codes must be contiguous bytes [N, K*bits/8]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.sizes() == at::IntArrayRef({N, groups}), "scale must be float32 [N, K/32]");
  const float* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() &&
                offset->sizes() == scale.sizes(), "offset must be float32 [N, K/32]");
    off = offset->data_ptr<float>();
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  // per row of x, the sum of each group: the offset's factor
  std::vector<float> xsum(off != nullptr ? M * groups : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) s += xp[i * GROUP + j];
    xsum[i] = s;
  }
  const uint8_t* q = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sc = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // at least ~64K multiply-adds per task: smaller layers are not worth waking a thread for
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 8)
      rows<8>(xp, xsum.data(), M, K, N, n0, n1, q, sc, off, b, yp);
    else
      rows<4>(xp, xsum.data(), M, K, N, n0, n1, q, sc, off, b, yp);
  });
  return y;
}

// "avx2" or "scalar": which code this build holds.
std::string isa() {
#ifdef DEEPINFER_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_quant, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scale, Tensor? offset, Tensor? bias, int bits) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
