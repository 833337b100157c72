// A page row's blocks (page_codecs.cpp's decode): each block's codes, valued (page_values.h),
// times its float32 scale, into the pool's dtype. block_rest is the exact expression per element
// on any ISA. Into bfloat16 with AVX512-BF16 the scales are checked 16 at a time, and a block
// whose every product is zero or a normal float32 within bfloat16's range (plain_block: the
// common case, the encoders' scales being amax / the format's max) rounds each vector in one
// instruction, the same bits as the integer rounding; runs of 16 plain blocks of the codecs'
// default sizes store two vectors at a time, streaming into 64-byte aligned pages.

#pragma once

#include "page_values.h"

namespace page_values {

// n codes' values times g -> out, one per byte (fp4's block scales: e4m3 codes times the page's
// float32 scale): vals.one(code) * g per element
template <typename Values>
void scaled_values(const uint8_t* codes, int64_t n, float g, const Values& vals, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 g16 = _mm512_set1_ps(g);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(vals.v16(ByteCodes::codes16(codes + i)), g16));
#endif
#ifdef __AVX2__
  const __m256 g8 = _mm256_set1_ps(g);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(vals.v8(ByteCodes::codes8(codes + i)), g8));
#endif
  for (; i < n; ++i) out[i] = vals.one(codes[i]) * g;
}

// codes i.. of one block (Codes' packing) times scale s, valued by vals -> out[i..block): the
// exact expression per element, on any ISA
template <typename Codes, typename T, typename Values>
void block_rest(const uint8_t* c, int64_t i, int64_t block, float s, const Values& vals, T* out) {
#ifdef __AVX512F__
  const __m512 sv16 = _mm512_set1_ps(s);
  for (; i + 16 <= block; i += 16)
    Out<T>::put16(out + i, _mm512_mul_ps(vals.v16(Codes::codes16(c + Codes::offset(i))), sv16));
#endif
#ifdef __AVX2__
  const __m256 sv = _mm256_set1_ps(s);
  for (; i + 8 <= block; i += 8)
    Out<T>::put8(out + i, _mm256_mul_ps(vals.v8(Codes::codes8(c + Codes::offset(i))), sv));
#endif
  for (; i < block; ++i) Out<T>::put(out + i, vals.one(Codes::code(c, i)) * s);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Whether every product of a Values code and scale s is zero or a normal float32 within T's
// finite range (NaN codes aside): exact in double, where a float32 product cannot round past
// the bounds (both are float32 values).
template <typename T, typename Values>
bool plain_block(float s) {
  const double a = std::fabs(static_cast<double>(s));
  return a == 0.0 || (a * Values::kMinNonzero >= FLT_MIN && a * Values::kMaxAbs <= Out<T>::kMax);
}

// The |s| for which plain_block<T, Values>(s) holds, as float bounds: s == 0 or lo <= |s| <= hi
// (both conditions are monotone in |s|); lo > hi where none does (a table of unknown values).
template <typename T, typename Values>
struct PlainScales {
  float lo = FLT_MAX, hi = 0.0f;
  PlainScales() {
    if (Values::kMaxAbs == 0.0f) return;
    lo = static_cast<float>(FLT_MIN / Values::kMinNonzero);
    hi = static_cast<float>(static_cast<double>(Out<T>::kMax) / Values::kMaxAbs);
    while (!plain_block<T, Values>(lo)) lo = std::nextafter(lo, FLT_MAX);
    while (plain_block<T, Values>(std::nextafter(lo, 0.0f))) lo = std::nextafter(lo, 0.0f);
    while (!plain_block<T, Values>(hi)) hi = std::nextafter(hi, 0.0f);
    while (plain_block<T, Values>(std::nextafter(hi, FLT_MAX))) hi = std::nextafter(hi, FLT_MAX);
  }
  // which of 16 scales (as |s|) are plain (none for a table of unknown values)
  __mmask16 mask(__m512 a) const {
    if (Values::kMaxAbs == 0.0f) return 0;
    return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ)
           | (_mm512_cmp_ps_mask(a, _mm512_set1_ps(lo), _CMP_GE_OQ) & _mm512_cmp_ps_mask(a, _mm512_set1_ps(hi), _CMP_LE_OQ));
  }
};

// Whether any of n e4m3 codes is a NaN code (0x7F, 0xFF).
inline bool any_nan_code(const uint8_t* c, int64_t n) {
  const __m512i ones = _mm512_set1_epi8(-1), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    if (_mm512_cmpeq_epi8_mask(_mm512_or_si512(_mm512_loadu_si512(c + i), sign), ones)) return true;
  for (; i < n; ++i)
    if ((c[i] & 0x7F) == 0x7F) return true;
  return false;
}

// 16 codes from element i on, valued and times the block's scale: from the codes' bits (Bits:
// e4m3 value * 2**-120, sv = s * 2**120, exact where |s| <= 2**7 and subnormal inputs count) or
// vals.v16 (sv = s)
template <bool Bits, typename Codes, typename Values>
__m512 plain_values(const uint8_t* c, int64_t i, __m512 sv, const Values& vals) {
  if constexpr (Bits) {
    static_assert(std::is_same_v<Codes, ByteCodes>, "code bits are read one code per byte");
    return _mm512_mul_ps(Values::bits16(c + i), sv);
  } else {
    return _mm512_mul_ps(vals.v16(Codes::codes16(c + Codes::offset(i))), sv);
  }
}

// One plain block's whole vectors into bfloat16, one rounding instruction each (sv as
// plain_values; Stream: out is 32-byte aligned). -> the elements written
template <bool Bits, bool Stream, typename Codes, typename Values>
int64_t plain_bf16(const uint8_t* c, int64_t block, __m512 sv, const Values& vals, c10::BFloat16* out) {
  int64_t i = 0;
  for (; i + 16 <= block; i += 16) Out<c10::BFloat16>::put16_plain<Stream>(out + i, plain_values<Bits, Codes>(c, i, sv, vals));
  return i;
}

// 16 plain blocks of 16 * V elements (V = 1 or 2, the codecs' default blocks), their scales sv
// (as plain_values), two vectors per store (Stream: out is 64-byte aligned). e2m1 codes: the 16
// values times the scales of the two blocks 32 codes span (the same block's twice where V = 2),
// rounded once (32 bfloat16), then one word permute per 32 codes picks them: the same products
// and rounding as per element.
template <int V, bool Bits, bool Stream, typename Codes, typename Values>
void plain_run(const uint8_t* c, const float* sv, const Values& vals, c10::BFloat16* out) {
  if constexpr (std::is_same_v<Values, E2M1Values>) {
    const __m512i code = _mm512_set1_epi16(0x0F);
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
#pragma GCC unroll 8
    for (int q = 0; q < 16 * V; q += 2) {
      const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
          _mm512_mul_ps(vals.all, _mm512_set1_ps(sv[(q + 1) / V])), _mm512_mul_ps(vals.all, _mm512_set1_ps(sv[q / V]))));
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 8 * q));
      const __m128i h = _mm_srli_epi16(x, 4);  // each byte's high nibble in the low 4 bits
      const __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(x, h), _mm_unpacklo_epi8(x, h));
      // word i: code i (low 4 bits) + 16 for the second block's half of the table
      const __m512i idx = _mm512_ternarylogic_epi32(_mm512_cvtepu8_epi16(codes), code, second, 0xEA);
      Out<c10::BFloat16>::store32<Stream>(out + 16 * q, _mm512_permutexvar_epi16(idx, table));
    }
  } else {
    static_assert(std::is_same_v<Codes, ByteCodes>, "e4m3 codes are one per byte");
#pragma GCC unroll 16
    for (int q = 0; q < 16 * V; q += 2) {
      const __m512 s0 = _mm512_set1_ps(sv[q / V]), s1 = _mm512_set1_ps(sv[(q + 1) / V]);
      if constexpr (Bits) {
        Out<c10::BFloat16>::put32_plain<Stream>(out + 16 * q, plain_values<Bits, Codes>(c, 16 * q, s0, vals),
                                                 plain_values<Bits, Codes>(c, 16 * q + 16, s1, vals));
      } else {
        Out<c10::BFloat16>::put32_plain<Stream>(out + 16 * q, _mm512_mul_ps(vals.v16(ByteCodes::codes16(c + 16 * q)), s0),
                                                 _mm512_mul_ps(vals.v16(ByteCodes::codes16(c + 16 * q + 16)), s1));
      }
    }
  }
}

// A row's blocks into bfloat16, their scales checked 16 at a time: plain blocks (the common
// case: the encoders' scales are amax / the format's max) take one rounding instruction per
// vector, 16 of them at once where the block is 16 or 32 long; the others, and any block's
// tail, block_rest. A row holding a NaN code takes block_rest throughout. Stream: o is 64-byte
// aligned and the block a multiple of 16.
template <bool Stream, typename Codes, typename Values>
void bf16_blocks(const uint8_t* codes, int64_t m, int64_t block, const uint8_t* scales, const Values& vals,
                 c10::BFloat16* o) {
  static const PlainScales<c10::BFloat16, Values> range;
  constexpr bool kBits = Values::kBitsScale > 0.0f;
  const int64_t nb = m / block;
  bool nan_codes = Values::kMayNaN;
  if constexpr (Values::kMayNaN && std::is_same_v<Codes, ByteCodes>) nan_codes = any_nan_code(codes, m);
  // from bits where |s| <= 2**7 and subnormal inputs count (no DAZ): the subnormal codes are
  // subnormal bits
  const float bits_limit = kBits && !(_mm_getcsr() & 0x40) ? 0x1p7f : -1.0f;
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t k = std::min<int64_t>(16, nb - b0);
    const __mmask16 live = static_cast<__mmask16>((1u << k) - 1);
    const __m512 s16 = _mm512_maskz_loadu_ps(live, scales + 4 * b0), a16 = _mm512_abs_ps(s16);
    const __mmask16 plain = nan_codes ? 0 : range.mask(a16) & live;
    const __mmask16 bits = plain & _mm512_cmp_ps_mask(a16, _mm512_set1_ps(bits_limit), _CMP_LE_OQ);
    const uint8_t* c0 = codes + Codes::offset(b0 * block);
    alignas(64) float sv[16], sb[16];  // the scales, and times 2**120 for values from bits
    _mm512_store_ps(sv, s16);
    if constexpr (kBits) _mm512_store_ps(sb, _mm512_mul_ps(s16, _mm512_set1_ps(Values::kBitsScale)));
    if (plain == 0xFFFF && (block == 16 || block == 32) && (bits == 0xFFFF || bits == 0)) {
      const auto run = [&](auto v) {
        if (kBits && bits) plain_run<decltype(v)::value, kBits, Stream, Codes>(c0, sb, vals, o + b0 * block);
        else plain_run<decltype(v)::value, false, Stream, Codes>(c0, sv, vals, o + b0 * block);
      };
      if (block == 16) run(std::integral_constant<int, 1>{});
      else run(std::integral_constant<int, 2>{});
      continue;
    }
    for (int64_t j = 0; j < k; ++j) {
      const float s = sv[j];
      const uint8_t* c = codes + Codes::offset((b0 + j) * block);
      c10::BFloat16* out = o + (b0 + j) * block;
      int64_t i = 0;
      if (kBits && (bits >> j & 1)) i = plain_bf16<kBits, Stream, Codes>(c, block, _mm512_set1_ps(sb[j]), vals, out);
      else if (plain >> j & 1) i = plain_bf16<false, Stream, Codes>(c, block, _mm512_set1_ps(s), vals, out);
      block_rest<Codes>(c, i, block, s, vals, out);
    }
  }
}
#endif

// codes of m elements (Codes' packing) times the float32 scale of each block (scales: nb of
// them, possibly unaligned), valued by vals -> o[m]
template <typename Codes, typename T, typename Values>
void block_values(const uint8_t* codes, int64_t m, int64_t block, const uint8_t* scales, const Values& vals, T* o) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // streaming stores where every vector store is aligned
    if (reinterpret_cast<uintptr_t>(o) % 64 == 0 && block % 16 == 0) bf16_blocks<true, Codes>(codes, m, block, scales, vals, o);
    else bf16_blocks<false, Codes>(codes, m, block, scales, vals, o);
    return;
  }
#endif
  for (int64_t b = 0; b < m / block; ++b)
    block_rest<Codes>(codes + Codes::offset(b * block), 0, block, load_f32(scales + 4 * b), vals, o + b * block);
}

}  // namespace page_values
