// The value side of the lossy page decode (page_codecs.cpp): codes unpacked from their bytes,
// looked up, times the block scale, clamped and stored in the pool's dtype, 16 lanes at a time
// with AVX-512, 8 with AVX2, one by one elsewhere and in a block's tail. Every lane computes
// exactly the scalar expression Out<T>::put(o, table[code] * scale), so the vector width never
// changes a value; into bfloat16 the rounding is one instruction where a block's scale allows
// it (page_blocks.h), with the same result.
//
// Why not one gather per vector: a table gather costs several times a plain load on current
// x86 cores (it bounded FP8 loads at a quarter of a page copy), so e2m1 (16 values) is a register
// permute of the caller's table, and e4m3 is rebuilt from its bits where the caller's table
// holds exactly those values (``e4m3_from_bits`` checks, once per call; the gather stays for any
// other table and for the two NaN codes).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace page_values {

inline float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

inline uint32_t to_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
}

inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float clamp_to(float v, float fmax) { return v > fmax ? fmax : (v < -fmax ? -fmax : v); }  // NaN stays
#ifdef __AVX2__
inline __m256 clamp8(__m256 v, float fmax) {  // min/max return the second operand on NaN: it stays
  const __m256 mx = _mm256_set1_ps(fmax);
  return _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), mx), _mm256_min_ps(mx, v));
}
#endif
#ifdef __AVX512F__
inline __m512 clamp16(__m512 v, float fmax) {
  const __m512 mx = _mm512_set1_ps(fmax);
  return _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), mx), _mm512_min_ps(mx, v));
}
#endif

// -- stores of float32 values into the destination dtype (clamped first, as codecs._finish)
template <typename T> struct Out;
template <> struct Out<float> {
  static constexpr float kMax = FLT_MAX;
  static void put(float* o, float v) { *o = clamp_to(v, kMax); }
#ifdef __AVX2__
  static void put8(float* o, __m256 v) { _mm256_storeu_ps(o, clamp8(v, kMax)); }
#endif
#ifdef __AVX512F__
  static void put16(float* o, __m512 v) { _mm512_storeu_ps(o, clamp16(v, kMax)); }
#endif
};
template <> struct Out<c10::BFloat16> {
  static constexpr float kMax = 3.3895313892515355e38f;
  static void put(c10::BFloat16* o, float v) { *o = c10::BFloat16(clamp_to(v, kMax)); }
#ifdef __AVX2__
  static void put8(c10::BFloat16* o, __m256 v) {
    v = clamp8(v, kMax);
    const __m256i u = _mm256_castps_si256(v);  // round to nearest even, NaN -> 0x7FC0 (as c10)
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
  }
#endif
#ifdef __AVX512F__
  // (not VCVTNEPS2BF16: it treats float32 subnormals as zero, c10 rounds them)
  static void put16(c10::BFloat16* o, __m512 v) {
    v = clamp16(v, kMax);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  // One instruction where it rounds as put16: v holds no NaN, no float32 subnormal and nothing
  // beyond kMax (VCVTNEPS2BF16 keeps NaN payloads and flushes subnormals; the caller checks).
  // Stream: o is 32-byte aligned, and the pages are not read back soon (a load's destination).
  template <bool Stream>
  static void put16_plain(c10::BFloat16* o, __m512 v) {
    const __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    if constexpr (Stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(o), r);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), r);
  }
  // two vectors as put16_plain does each, in one 64-byte store (Stream: o is 64-byte aligned)
  template <bool Stream>
  static void put32_plain(c10::BFloat16* o, __m512 lo, __m512 hi) {
    store32<Stream>(o, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  template <bool Stream>
  static void store32(c10::BFloat16* o, __m512i r) {  // 32 bfloat16 bit patterns
    if constexpr (Stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(o), r);
    else _mm512_storeu_si512(o, r);
  }
#endif
};
template <> struct Out<c10::Half> {
  static constexpr float kMax = 65504.0f;
  static void put(c10::Half* o, float v) { *o = c10::Half(clamp_to(v, kMax)); }
#ifdef __AVX2__
  static void put8(c10::Half* o, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(clamp8(v, kMax), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
#ifdef __AVX512F__
  static void put16(c10::Half* o, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(clamp16(v, kMax), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
};

// How a block's codes sit in its bytes: one per byte (e4m3), or two (e2m1, even element low).
struct ByteCodes {
  static int64_t offset(int64_t i) { return i; }
  static int code(const uint8_t* c, int64_t i) { return c[i]; }
#ifdef __AVX2__
  static __m256i codes8(const uint8_t* c) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  }
#endif
#ifdef __AVX512F__
  static __m512i codes16(const uint8_t* c) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  }
#endif
};
struct NibbleCodes {
  static int64_t offset(int64_t i) { return i / 2; }
  static int code(const uint8_t* c, int64_t i) { return (i % 2) ? (c[i / 2] >> 4) : (c[i / 2] & 0x0F); }
#ifdef __AVX2__
  static __m128i spread(__m128i x) {  // bytes b0 b1 ... -> b0 & 15, b0 >> 4, b1 & 15, ...
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
  }
  static __m256i codes8(const uint8_t* c) {
    uint32_t w;
    std::memcpy(&w, c, 4);
    return _mm256_cvtepu8_epi32(spread(_mm_cvtsi32_si128(static_cast<int>(w))));
  }
#endif
#ifdef __AVX512F__
  static __m512i codes16(const uint8_t* c) {
    return _mm512_cvtepu8_epi32(spread(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
  }
#endif
};

// -- a code's float32 value: table[code], bit for bit
struct TableValues {  // any table: a gather
  static constexpr float kMinNonzero = 0.0f, kMaxAbs = 0.0f;  // unknown: never a plain block
  static constexpr float kBitsScale = 0.0f;                   // no bits16 (E4M3Values has one)
  static constexpr bool kMayNaN = true;
  const float* table;
  float one(int c) const { return table[c]; }
#ifdef __AVX2__
  __m256 v8(__m256i c) const { return _mm256_i32gather_ps(table, c, 4); }
#endif
#ifdef __AVX512F__
  __m512 v16(__m512i c) const { return _mm512_i32gather_ps(c, table, 4); }
#endif
};

struct E2M1Values {  // a 16-value table (codes 0..15): permutes within registers
  static constexpr float kMinNonzero = 0.5f, kMaxAbs = 6.0f;
  static constexpr float kBitsScale = 0.0f;
  static constexpr bool kMayNaN = false;
  const float* table;
#ifdef __AVX2__
  __m256 low = _mm256_loadu_ps(table), high = _mm256_loadu_ps(table + 8);
#endif
#ifdef __AVX512F__
  __m512 all = _mm512_loadu_ps(table);
#endif
  explicit E2M1Values(const float* t) : table(t) {}
  float one(int c) const { return table[c]; }
#ifdef __AVX2__
  __m256 v8(__m256i c) const {  // bit 3 picks the half (blendv reads each lane's top bit)
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, c), _mm256_permutevar8x32_ps(high, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
  }
#endif
#ifdef __AVX512F__
  __m512 v16(__m512i c) const { return _mm512_permutexvar_ps(c, all); }
#endif
};

// e4m3fn's value of a code from its bits: normal s.eeee.mmm -> float32 s, e + 120, mmm << 20;
// exponent 0: mmm * 2**-9 (exact); 0x7F / 0xFF (NaN) -> whatever the table holds.
inline float e4m3_bits_value(int c) {
  const uint32_t mag = c & 0x7F, sign = static_cast<uint32_t>(c & 0x80) << 24;
  const float v = mag < 8 ? static_cast<float>(mag) * 0x1p-9f : from_bits((mag << 20) + (120u << 23));
  return from_bits(to_bits(v) | sign);
}

// Whether ``table`` is e4m3fn bit for bit (NaN at the two NaN codes): then E4M3Values applies.
inline bool e4m3_from_bits(const float* table) {
  for (int c = 0; c < 256; ++c) {
    const bool nan_code = (c & 0x7F) == 0x7F;
    if (nan_code ? !std::isnan(table[c]) : to_bits(table[c]) != to_bits(e4m3_bits_value(c))) return false;
  }
  return true;
}

struct E4M3Values {  // e4m3_bits_value per lane; the table only for the NaN codes
  static constexpr float kMinNonzero = 0x1p-9f, kMaxAbs = 448.0f;
  static constexpr bool kMayNaN = true;  // the two NaN codes
  // A code's bits moved into a float32 (s.eeee.mmm at bits 31, 26-23, 22-20) are its value times
  // 2**-120 exactly, the subnormal codes as float32 subnormals: times (scale * 2**120) that is
  // value * scale, one rounding either way, where nothing flushes subnormal inputs (DAZ off).
  static constexpr float kBitsScale = 0x1p120f;
  const float* table;
  float one(int c) const { return table[c]; }
#ifdef __AVX2__
  __m256 v8(__m256i c) const {
    const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    const __m256 small = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, small);
    v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
    if (_mm256_movemask_ps(nan)) v = _mm256_mask_i32gather_ps(v, table, c, nan, 4);
    return v;
  }
#endif
#ifdef __AVX512F__
  __m512 v16(__m512i c) const {
    const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    __m512i v = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)),
                                      _mm512_castps_si512(sub));
    v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
    const __m512 out = _mm512_castsi512_ps(v);
    return nan ? _mm512_mask_i32gather_ps(out, nan, c, table, 4) : out;
  }
  // 16 codes (one per byte) as value * 2**-120 (the NaN codes give finite values): s.eeee.mmm
  // sign-extended, shifted to put eeee.mmm at bits 26-20 and s at 31, the copies of s masked off
  static __m512 bits16(const uint8_t* c) {
    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 20);
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
  }
#endif
};

}  // namespace page_values
