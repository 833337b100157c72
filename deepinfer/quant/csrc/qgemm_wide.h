// The 512-bit tiles of qgemm.cpp's int16 VNNI path, for calls of several rows (batched decode):
// two packed blocks side by side (16 output rows, one register) x up to WIDE_MT activation rows,
// so each 32-byte weight chunk is loaded and widened once per tile for both blocks and each
// activation pair is broadcast once for 16 output rows (the 256-bit loop: 8 output rows x 4
// rows, so at 32 rows it spends more instructions widening codes and broadcasting pairs than
// multiplying). The integer dots are the same exact sums and each output element takes the same
// per-group FMAs in the same order, and is rounded to bf16 the same way (torch's
// round-to-nearest-even, NaN to 0x7FC0): the 256-bit loop's bits, whichever of the two runs it.
#pragma once

#if defined(DEEPINFER_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define DEEPINFER_WIDE 1

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qgemm_acts.h"
#include "qgemm_layout.h"
#include "qgemm_operands.h"

constexpr int WIDE_MT = 8;         // activation rows per tile: 2 x 8 accumulators (12 measured no faster)
constexpr int WIDE_MIN_ROWS = 8;   // calls of fewer rows stay on the 256-bit loop (faster there for the LM head)

// Block b's 32 bytes (or 8 floats) at lo, block b + 1's at hi, in one register.
inline __m512i join_codes(const uint8_t* lo, const uint8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

inline __m512 join_floats(const float* lo, const float* hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo))),
                                             _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}

// Pair S of a joined chunk as int16 lanes (qgemm_layout.h; the 256-bit loop's pair_codes, twice).
template <int BITS, int S>
inline __m512i wide_pair(__m512i chunk) {
  if constexpr (BITS == 8) {
    return S == 0 ? _mm512_srai_epi16(_mm512_slli_epi16(chunk, 8), 8) : _mm512_srai_epi16(chunk, 8);
  } else {
    return _mm512_and_si512(_mm512_srli_epi16(chunk, 4 * S), _mm512_set1_epi16(0x0F));
  }
}

// fp32 lanes -> bf16 as at::BFloat16(v) rounds them.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// y rows 0 .. MT of blocks b and b + 1 (w: from block b on; n0 its first output row; valid: the
// output rows of the two that exist, 9 .. 16).
template <int BITS, int MT>
void wide_tile(const Rows& a, const Packed& w, int64_t n0, int valid, const Out& y) {
  constexpr int PER_CHUNK = BITS == 8 ? 2 : 4;
  const int64_t next_codes = w.groups * block_bytes<BITS>(), next_floats = w.groups * ROWS;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* q = w.codes + g * block_bytes<BITS>();
    __m512i dot[MT];
    for (int m = 0; m < MT; ++m) dot[m] = _mm512_setzero_si512();
    for (int c = 0; c < 16 / PER_CHUNK; ++c) {
      const __m512i chunk = join_codes(q + 32 * c, q + next_codes + 32 * c);
      auto step = [&](__m512i wp, int p) {
        for (int m = 0; m < MT; ++m) {
          int32_t xp;
          std::memcpy(&xp, a.q + m * a.K + g * GROUP + 2 * p, sizeof xp);
          dot[m] = _mm512_dpwssd_epi32(dot[m], wp, _mm512_set1_epi32(xp));
        }
      };
      step(wide_pair<BITS, 0>(chunk), PER_CHUNK * c);
      step(wide_pair<BITS, 1>(chunk), PER_CHUNK * c + 1);
      if constexpr (PER_CHUNK == 4) {
        step(wide_pair<BITS, 2>(chunk), PER_CHUNK * c + 2);
        step(wide_pair<BITS, 3>(chunk), PER_CHUNK * c + 3);
      }
    }
    const __m512 s = join_floats(w.scale + g * ROWS, w.scale + next_floats + g * ROWS);
    for (int m = 0; m < MT; ++m) {
      const int64_t mg = m * w.groups + g;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(s, _mm512_set1_ps(a.d[mg])), acc[m]);
    }
    if (w.offset != nullptr) {
      const __m512 o = join_floats(w.offset + g * ROWS, w.offset + next_floats + g * ROWS);
      for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.xsum[m * w.groups + g]), acc[m]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 bias = w.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, w.bias + n0);
  for (int m = 0; m < MT; ++m) {
    const __m512 v = w.bias == nullptr ? acc[m] : _mm512_add_ps(acc[m], bias);
    if (y.f != nullptr) _mm512_mask_storeu_ps(y.f + m * y.N + n0, mask, v);
    else _mm256_mask_storeu_epi16(y.h + m * y.N + n0, mask, to_bf16(v));
  }
}

// wide_tile<BITS, mt> for a run-time mt of 1 .. MT.
template <int BITS, int MT = WIDE_MT>
void wide_tile_of(int64_t mt, const Rows& a, const Packed& w, int64_t n0, int valid, const Out& y) {
  if constexpr (MT > 1) {
    if (mt < MT) return wide_tile_of<BITS, MT - 1>(mt, a, w, n0, valid, y);
  }
  wide_tile<BITS, MT>(a, w, n0, valid, y);
}

// Every row of x for blocks b and b + 1, in tiles of as equal a number of rows as WIDE_MT allows.
template <int BITS>
void wide_pair_of_blocks(const Rows& a, const Packed& w, int64_t M, int64_t n0, int valid, const Out& y) {
  const int64_t tiles = (M + WIDE_MT - 1) / WIDE_MT;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
    const int64_t mt = (M - m0) / (tiles - t);  // the rows left, shared over the tiles left
    wide_tile_of<BITS>(mt, a.at(m0), w, n0, valid, y.at(m0));
    m0 += mt;
  }
}

#endif
