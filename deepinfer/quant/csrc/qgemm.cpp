// Weight-only quantized matmul for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y fp32.
//
// W is stored in groups of 32 columns: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / 32,
// with int8 codes (one byte each) or 4-bit codes 0..15 packed 16 bytes per group, byte j holding
// column j in its low nibble and column j + 16 in its high one (the layout of GGUF's blocks, so a
// group unpacks into columns in order). Per output element:
//
//   y[m, n] = sum_g scale[n, g] * (q[n, g, :] . x[m, g, :]) + sum_g offset[n, g] * xsum[m, g]
//
// The activations of a group's dot are taken one of three ways (act_bits), chosen per call:
// - 32, float: the codes are widened to fp32 and multiplied with x as it is; x keeps its
//   precision, and the widening (two conversions per 8 values) bounds this path.
// - 16 or 8, integer: each block of 32 values of a row of x is rounded once per call to int16 /
//   int8 codes with one scale (d = max|x| / 32767 or / 127, symmetric), shared by every output
//   row. A group's dot is then exact integer arithmetic: int16 codes against the weights widened
//   to int16, 16 products per _mm256_madd_epi16; int8 codes (GGUF's Q8 activations) 32 products
//   per _mm256_maddubs_epi16 (unsigned x signed bytes into int16 pairs, which cannot saturate for
//   weight codes of at most 8 bits times 127) and one _mm256_madd_epi16; then one fp32 FMA with
//   scale * d. The offset term uses the rounded activations too (xsum = d * sum of the codes), so
//   the error is that of rounding x against the whole weight w, not against w - offset.
// The weights are read at 1 or 1/2 byte per value, which is what batch-1 decode is bound by. Each
// output row n is computed by one thread in one fixed order, so the result does not depend on the
// thread count. Rows of x are taken MT at a time so a group's codes are unpacked once per MT rows.
// Built by deepinfer/quant/native.py with AVX2+FMA where torch runs AVX2, else as portable scalar
// code (the same integer arithmetic, so the same results up to fp32 summation order).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_MT = 8;  // activation rows per pass over a weight row (8 measured faster than 4)

template <int BITS>
constexpr int64_t group_bytes() { return BITS == 8 ? GROUP : GROUP / 2; }

// The activations of one call: rows of x (stride K); for the integer paths their codes q8 or
// q16 [m, k] and block scales d[m, g]; xsum[m, g] is the offset's factor (null: symmetric weights).
struct Rows {
  const float* x;
  const int8_t* q8;
  const int16_t* q16;
  const float* d;
  const float* xsum;
  int64_t K;
  Rows at(int64_t m) const {
    const int64_t groups = K / GROUP;
    return {x + m * K, q8 == nullptr ? nullptr : q8 + m * K, q16 == nullptr ? nullptr : q16 + m * K,
            d == nullptr ? nullptr : d + m * groups, xsum == nullptr ? nullptr : xsum + m * groups, K};
  }
};

// One block of 32 activations -> codes round(x * L / max|x|) (half to even), L the largest T,
// and the block's scale max|x| / L; returns the sum of the codes.
template <typename T>
int32_t quantize_block(const float* x, T* q, float* d) {
  constexpr float L = std::numeric_limits<T>::max();
  float amax = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? L / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < GROUP; ++j) {
    q[j] = static_cast<T>(std::nearbyint(x[j] * inv));
    sum += q[j];
  }
  *d = amax / L;
  return sum;
}

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

// sum_g scale[g] * (q[g] . x[m, g]) for MT rows of x, float activations. Two accumulators per row
// (even and odd groups) so consecutive groups do not wait on one FMA chain.
template <int BITS, int MT>
void dot_rows_float(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  __m256 acc[2][MT];
  for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const int64_t groups = a.K / GROUP;
  auto step = [&](int64_t g, int p) {
    __m256 w[4];
    widen_group<BITS>(q + g * group_bytes<BITS>(), w);
    const __m256 s = _mm256_broadcast_ss(scale + g);
    for (int m = 0; m < MT; ++m) {
      const float* xg = a.x + m * a.K + g * GROUP;
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

// The same with int8 activations: per group and row, the exact integer dot as 8 int32 partial
// sums, then one FMA with scale[g] * d[m, g].
template <int BITS, int MT>
void dot_rows_int8(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  __m256 acc[2][MT];
  for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const int64_t groups = a.K / GROUP;
  const __m256i ones = _mm256_set1_epi16(1);
  auto step = [&](int64_t g, int p) {
    const uint8_t* qg = q + g * group_bytes<BITS>();
    __m256i w;  // unsigned operand of maddubs
    __m256i sign;  // int8 weights: their signs, moved onto the activations
    if constexpr (BITS == 8) {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg));
      w = _mm256_sign_epi8(sign, sign);  // |q|; -128 stays 0x80, i.e. 128 unsigned
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
    }
    const __m256 s = _mm256_broadcast_ss(scale + g);
    for (int m = 0; m < MT; ++m) {
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q8 + m * a.K + g * GROUP));
      if constexpr (BITS == 8) xq = _mm256_sign_epi8(xq, sign);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
      const __m256 sd = _mm256_mul_ps(s, _mm256_broadcast_ss(a.d + m * (a.K / GROUP) + g));
      acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, acc[p][m]);
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

// int16 activations: codes widened to int16 once per MT rows, 16 products per _mm256_madd_epi16.
template <int BITS, int MT>
void dot_rows_int16(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  __m256 acc[2][MT];
  for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  const int64_t groups = a.K / GROUP;
  auto step = [&](int64_t g, int p) {
    const uint8_t* qg = q + g * group_bytes<BITS>();
    __m256i w0, w1;  // columns 0..15, 16..31
    if constexpr (BITS == 8) {
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16)));
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
      const __m128i mask = _mm_set1_epi8(0x0F);
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    }
    const __m256 s = _mm256_broadcast_ss(scale + g);
    for (int m = 0; m < MT; ++m) {
      const int16_t* xg = a.q16 + m * a.K + g * GROUP;
      const __m256i d0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg)));
      const __m256i d1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16)));
      const __m256 sd = _mm256_mul_ps(s, _mm256_broadcast_ss(a.d + m * groups + g));
      acc[p][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1)), sd, acc[p][m]);
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
inline int32_t code(const uint8_t* q, int64_t j) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(q[j]);
  } else {
    return j < 16 ? (q[j] & 0x0F) : (q[j - 16] >> 4);
  }
}

template <int BITS, int MT>
void dot_rows_float(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
  for (int64_t g = 0; g < a.K / GROUP; ++g) {
    const uint8_t* qg = q + g * group_bytes<BITS>();
    for (int m = 0; m < MT; ++m) {
      const float* xg = a.x + m * a.K + g * GROUP;
      float d = 0.f;
      for (int64_t j = 0; j < GROUP; ++j) d += static_cast<float>(code<BITS>(qg, j)) * xg[j];
      out[m] += scale[g] * d;
    }
  }
}

template <int BITS, int MT, typename T>
void dot_rows_int(const T* xq, const Rows& a, const uint8_t* q, const float* scale, float* out) {
  const int64_t groups = a.K / GROUP;
  for (int m = 0; m < MT; ++m) out[m] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * group_bytes<BITS>();
    for (int m = 0; m < MT; ++m) {
      const T* xg = xq + m * a.K + g * GROUP;
      int32_t d = 0;
      for (int64_t j = 0; j < GROUP; ++j) d += code<BITS>(qg, j) * xg[j];
      out[m] = std::fma(static_cast<float>(d), scale[g] * a.d[m * groups + g], out[m]);
    }
  }
}

template <int BITS, int MT>
void dot_rows_int8(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  dot_rows_int<BITS, MT>(a.q8, a, q, scale, out);
}

template <int BITS, int MT>
void dot_rows_int16(const Rows& a, const uint8_t* q, const float* scale, float* out) {
  dot_rows_int<BITS, MT>(a.q16, a, q, scale, out);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

#endif

template <int BITS, int MT, int ACT_BITS>
void tile(const Rows& a, int64_t N, int64_t n0, int64_t n1, const uint8_t* codes, const float* scale,
          const float* offset, const float* bias, float* y) {
  const int64_t groups = a.K / GROUP;
  const int64_t row_bytes = groups * group_bytes<BITS>();
  for (int64_t n = n0; n < n1; ++n) {
    float out[MT];
    if constexpr (ACT_BITS == 16)
      dot_rows_int16<BITS, MT>(a, codes + n * row_bytes, scale + n * groups, out);
    else if constexpr (ACT_BITS == 8)
      dot_rows_int8<BITS, MT>(a, codes + n * row_bytes, scale + n * groups, out);
    else
      dot_rows_float<BITS, MT>(a, codes + n * row_bytes, scale + n * groups, out);
    for (int m = 0; m < MT; ++m) {
      float v = out[m];
      if (offset != nullptr) v += dot(offset + n * groups, a.xsum + m * groups, groups);
      if (bias != nullptr) v += bias[n];
      y[m * N + n] = v;
    }
  }
}

template <int BITS, int ACT_BITS>
void rows(const Rows& a, int64_t M, int64_t N, int64_t n0, int64_t n1, const uint8_t* codes,
          const float* scale, const float* offset, const float* bias, float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_MT) {
    const Rows am = a.at(m0);
    float* ym = y + m0 * N;
    switch (std::min<int64_t>(MAX_MT, M - m0)) {
      case 1: tile<BITS, 1, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 2: tile<BITS, 2, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 3: tile<BITS, 3, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 4: tile<BITS, 4, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 5: tile<BITS, 5, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 6: tile<BITS, 6, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      case 7: tile<BITS, 7, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
      default: tile<BITS, 8, ACT_BITS>(am, N, n0, n1, codes, scale, offset, bias, ym); break;
    }
  }
}

// Every block of x rounded to codes q (quantize_block); xsum (if not empty): d * the codes' sum.
template <typename T>
void quantize_blocks(const float* x, int64_t blocks, std::vector<T>& q, std::vector<float>& d,
                     std::vector<float>& xsum) {
  q.resize(blocks * GROUP);
  d.resize(blocks);
  at::parallel_for(0, blocks, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t sum = quantize_block(x + i * GROUP, q.data() + i * GROUP, &d[i]);
      if (!xsum.empty()) xsum[i] = d[i] * static_cast<float>(sum);
    }
  });
}

// The offset's factor for float activations: each block's sum.
void block_sums(const float* x, int64_t blocks, float* xsum) {
  for (int64_t i = 0; i < blocks; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) s += x[i * GROUP + j];
    xsum[i] = s;
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                  const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                  int64_t bits, int64_t act_bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(act_bits == 32 || act_bits == 16 || act_bits == 8, "act_bits must be 32, 16 or 8, got ", act_bits);
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
  const int64_t blocks = M * groups;
  std::vector<float> xsum(off != nullptr ? blocks : 0), xd;
  std::vector<int8_t> xq8;
  std::vector<int16_t> xq16;
  if (act_bits == 16) quantize_blocks(xp, blocks, xq16, xd, xsum);
  else if (act_bits == 8) quantize_blocks(xp, blocks, xq8, xd, xsum);
  else if (off != nullptr) block_sums(xp, blocks, xsum.data());
  auto data = [](auto& v) { return v.empty() ? nullptr : v.data(); };
  const Rows a{xp, data(xq8), data(xq16), data(xd), data(xsum), K};
  const uint8_t* q = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sc = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // at least ~64K multiply-adds per task: smaller layers are not worth waking a thread for
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 8 && act_bits == 16) rows<8, 16>(a, M, N, n0, n1, q, sc, off, b, yp);
    else if (bits == 8 && act_bits == 8) rows<8, 8>(a, M, N, n0, n1, q, sc, off, b, yp);
    else if (bits == 8) rows<8, 32>(a, M, N, n0, n1, q, sc, off, b, yp);
    else if (act_bits == 16) rows<4, 16>(a, M, N, n0, n1, q, sc, off, b, yp);
    else if (act_bits == 8) rows<4, 8>(a, M, N, n0, n1, q, sc, off, b, yp);
    else rows<4, 32>(a, M, N, n0, n1, q, sc, off, b, yp);
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
  m.def("linear(Tensor x, Tensor codes, Tensor scale, Tensor? offset, Tensor? bias, int bits, "
        "int act_bits) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
