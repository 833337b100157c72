// What one qgemm.cpp call's tiles read and write: the packed weights (qgemm_layout.h's layout) and
// the output rows. Shared by the 256-bit loop (qgemm.cpp) and the 512-bit tiles (qgemm_wide.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// The weights as pack_weight lays them out (codes, scale, offset from the first block on).
struct Packed {
  const uint8_t* codes;
  const float* scale;
  const float* offset;  // null: symmetric
  const float* bias;    // null: none
  int64_t groups;
};

// Where a call's outputs go, y [M, N] row-major: fp32, or bf16 rounded to nearest even as each
// value is stored (torch's own fp32 -> bf16 rounding, so no second pass over y).
struct Out {
  float* f;           // null: bf16
  at::BFloat16* h;    // null: fp32
  int64_t N;
  Out at(int64_t m) const { return {f == nullptr ? nullptr : f + m * N, h == nullptr ? nullptr : h + m * N, N}; }
  void put(int64_t m, int64_t n, float v) const {
    if (f != nullptr) f[m * N + n] = v;
    else h[m * N + n] = at::BFloat16(v);
  }
};
