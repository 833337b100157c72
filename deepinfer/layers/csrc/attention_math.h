// Vector arithmetic of the paged attention kernels (paged_attention.cpp): scoring a block of keys
// against a query, the exponentials of an online softmax, and adding value rows into fp32
// accumulators. Each function fixes its own summation order, so every caller that uses it gets
// the same bits from the same inputs (a decode row and a span row at one position agree).
//
// AVX-512: values are widened and accumulated 16 lanes at a time (the same per-lane arithmetic as
// the 8-lane AVX2 code). With AVX512-BF16, bf16 keys are scored by `vdpbf16ps` against the bf16
// query as it is (32 exact products per instruction, fp32 sums), the scale applied to each score.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEEPINFER_DPBF16 1
#endif

namespace deepinfer_attention {

constexpr int64_t kBlock = 32;  // keys scored before one rescale

using bf16 = c10::BFloat16;

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (Cephes' range reduction and polynomial; relative error ~1e-7).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#ifdef DEEPINFER_DPBF16
// s[t] = scale * (q . k[t]) for t < n, D % 32 == 0: bf16 pairs dotted by `vdpbf16ps`, four keys
// at a time so their dot chains overlap.
inline void dp_scores(const bf16* q, float scale, const bf16* const* k, int64_t n, int64_t D, float* s) {
  auto at = [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = at(q + d);
      a0 = _mm512_dpbf16_ps(a0, qv, at(k[t] + d));
      a1 = _mm512_dpbf16_ps(a1, qv, at(k[t + 1] + d));
      a2 = _mm512_dpbf16_ps(a2, qv, at(k[t + 2] + d));
      a3 = _mm512_dpbf16_ps(a3, qv, at(k[t + 3] + d));
    }
    s[t] = scale * _mm512_reduce_add_ps(a0), s[t + 1] = scale * _mm512_reduce_add_ps(a1);
    s[t + 2] = scale * _mm512_reduce_add_ps(a2), s[t + 3] = scale * _mm512_reduce_add_ps(a3);
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) a = _mm512_dpbf16_ps(a, at(q + d), at(k[t] + d));
    s[t] = scale * _mm512_reduce_add_ps(a);
  }
}
#endif

// s[t] = q . k[t] for t < n; four keys at a time, so the FMAs of one key do not wait on each other
template <typename T>
inline void scores(const float* q, const T* const* k, int64_t n, int64_t D, float* s) {
  int64_t t = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; t + 4 <= n; t += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, load8(k[t] + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k[t + 1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k[t + 2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k[t + 3] + d), a3);
      }
      s[t] = hsum(a0), s[t + 1] = hsum(a1), s[t + 2] = hsum(a2), s[t + 3] = hsum(a3);
    }
    for (; t < n; ++t) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k[t] + d), a);
      s[t] = hsum(a);
    }
  }
#endif
  for (; t < n; ++t) {
    float a = 0.f;
    for (int64_t d = 0; d < D; ++d) a += q[d] * static_cast<float>(k[t][d]);
    s[t] = a;
  }
}

// acc[0:Dv] = acc * c + sum_t p[t] * v[t]: 64 dims of acc stay in registers over the block's keys
template <typename T>
inline void accumulate(float* acc, float c, const float* p, const T* const* v, int64_t n, int64_t Dv) {
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 cw = _mm512_set1_ps(c);
  for (; d + 64 <= Dv; d += 64) {
    __m512 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm512_mul_ps(cw, _mm512_loadu_ps(acc + d + 16 * i));
    for (int64_t t = 0; t < n; ++t) {
      const __m512 pv = _mm512_set1_ps(p[t]);
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(pv, load16(v[t] + d + 16 * i), a[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + d + 16 * i, a[i]);
  }
#endif
#ifdef __AVX2__
  const __m256 cv = _mm256_set1_ps(c);
  for (; d + 64 <= Dv; d += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d + 8 * i));
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pv = _mm256_set1_ps(p[t]);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pv, load8(v[t] + d + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d + 8 * i, a[i]);
  }
  for (; d + 8 <= Dv; d += 8) {
    __m256 a = _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d));
    for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(v[t] + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
#endif
  for (; d < Dv; ++d) {
    float a = acc[d] * c;
    for (int64_t t = 0; t < n; ++t) a += p[t] * static_cast<float>(v[t][d]);
    acc[d] = a;
  }
}

// s[0:n] = exp(s - m); returns their sum (added in a fixed order)
inline float exp_sum(float* s, float m, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return total;
}

// The heads g0 .. g0 + GN - 1 of a kv head's G, four at a time: f(GN constant, g0).
template <typename F>
inline void head_chunks(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: f(std::integral_constant<int, 4>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 1>{}, g0); break;
    }
  }
}

#ifdef __AVX512F__
// For GN heads: acc_g[0:Dv] = acc_g * c[g] + sum_t p_g[t] * v[t] (acc_g = acc + g * row,
// p_g = p + g * kBlock), Dv % 64 == 0: each value vector is loaded and widened once for all GN
// heads; per head the same arithmetic as accumulate(), so the same bits.
template <int GN, typename T>
inline void accumulate_heads(float* acc, int64_t row, const float* c, const float* p, const T* const* v, int64_t n,
                             int64_t Dv) {
  for (int64_t d = 0; d < Dv; d += 64) {
    __m512 a[GN][4];
    for (int g = 0; g < GN; ++g) {
      const __m512 cw = _mm512_set1_ps(c[g]);
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_mul_ps(cw, _mm512_loadu_ps(acc + g * row + d + 16 * i));
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = load16(v[t] + d + 16 * i);
      for (int g = 0; g < GN; ++g) {
        const __m512 pv = _mm512_set1_ps(p[g * kBlock + t]);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(pv, vv[i], a[g][i]);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * row + d + 16 * i, a[g][i]);
  }
}
#endif

}  // namespace deepinfer_attention
