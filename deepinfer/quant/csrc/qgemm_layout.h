// The packed weight layout of qgemm.cpp (deepinfer/quant/packed.py writes it): constants and the
// scalar accessors (the scalar kernel and dequantize read the codes through them).
//
// W is held in groups of 32 columns: w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k / 32,
// with int8 codes or 4-bit codes 0..15, repacked once at load (quant/native.py's pack_weight) so
// that one 256-bit register holds 8 output rows at once:
// - the rows are taken 8 at a time (a "block"; N padded with zero rows to a multiple of 8);
// - per block and group, the 8 x 32 codes are laid out as 16 column pairs p (columns 2p, 2p + 1),
//   each pair a vector of 16 int16 lanes [row 0 col 2p, row 0 col 2p+1, row 1 col 2p, ...], so one
//   _mm256_madd_epi16 against the activation pair broadcast gives 8 rows' partial dots in 8 int32
//   lanes, and a group's 16 pairs sum into the 8 rows' exact integer dots without any horizontal sum;
// - int8: 8 chunks of 32 bytes, int16 lane l of chunk c holding pair 2c in its low byte and pair
//   2c + 1 in its high one (two shifts widen them); int4: 4 chunks of 32 bytes, lane l of chunk c
//   holding pairs 4c .. 4c + 3 in its 4 nibbles, low first (a shift and a mask each);
// - scale and offset as [blocks, groups, 8] floats: one load per block and group.
#pragma once

#include <cstdint>

constexpr int64_t GROUP = 32;
constexpr int ROWS = 8;  // output rows per block: one fp32 register

template <int BITS>
constexpr int64_t block_bytes() { return ROWS * GROUP * BITS / 8; }  // per block and group

// Column of a group of x that activation byte i of the VNNI byte path holds: the column order of
// the packed bytes' 32-bit lanes (int8 codes: columns 4c + 0, 2, 1, 3 in chunk c; int4: 8c + 0, 4,
// 1, 5 in its low nibbles, then 8c + 2, 6, 3, 7 in its high ones).
inline int byte_order(int64_t bits, int i) {
  constexpr int IN8[4] = {0, 2, 1, 3}, IN4[4] = {0, 4, 1, 5};
  return bits == 8 ? (i & ~3) + IN8[i & 3] : (i & ~7) + 2 * ((i >> 2) & 1) + IN4[i & 3];
}

// Code of row r, column j of a block's group (the layout above).
template <int BITS>
inline int32_t code(const uint8_t* q, int r, int j) {
  const int p = j / 2, lane = 2 * r + j % 2;
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(q[32 * (p / 2) + 2 * lane + p % 2]);
  } else {
    const int s = p % 4;
    return (q[32 * (p / 4) + 2 * lane + s / 2] >> (4 * (s % 2))) & 0x0F;
  }
}
