// The activations of one qgemm.cpp call, taken once per call as its dot loop needs them: x as it
// is (the float path), or rounded per block of 32 values of a row to int16 / int8 codes with one
// scale per block (the integer paths), and the per-block sums that asymmetric weights' offsets meet.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "qgemm_layout.h"

// How a call's dots are taken: fp32 activations; integer codes widened to int16 (vpmaddwd, or
// vpdpwssd with VNNI); int8 activation codes as bytes against the packed bytes (vpdpbusd, VNNI only).
enum class Path { floats, int16, int16_vnni, bytes_vnni };

// The activations of one call, rows of stride K: x itself, or its int16 codes q (bytes b: the
// same codes in byte_order, for Path::bytes_vnni) and block scales d [m, g]; xsum [m, g] is the
// offset's factor (null: symmetric weights).
struct Rows {
  const float* x;
  const int16_t* q;
  const uint8_t* b;
  const float* d;
  const float* xsum;
  int64_t K;
  Rows at(int64_t m) const {
    const int64_t groups = K / GROUP;
    return {x + m * K, q == nullptr ? nullptr : q + m * K, b == nullptr ? nullptr : b + m * K,
            d == nullptr ? nullptr : d + m * groups, xsum == nullptr ? nullptr : xsum + m * groups, K};
  }
};

// One block of 32 activations -> codes round(x * L / max|x|) (half to even) and the block's scale
// max|x| / L; returns the sum of the codes.
inline int32_t quantize_block(const float* x, int16_t* q, float* d, float L) {
  float amax = 0.f;
  for (int64_t j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? L / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < GROUP; ++j) {
    q[j] = static_cast<int16_t>(std::nearbyint(x[j] * inv));
    sum += q[j];
  }
  *d = amax / L;
  return sum;
}

// x [M, K] (contiguous fp32 or bf16) prepared for one call's path; owns the buffers its rows()
// point into. bf16 rows are widened to fp32 here (exactly), so the dots see the values a
// torch-side x.float() would give them, without a tensor op per call.
class Activations {
 public:
  Activations(const at::Tensor& t, int64_t bits, int64_t act_bits, Path path, bool offset) : K_(t.size(1)) {
    const int64_t M = t.size(0), K = K_, nblk = M * (K / GROUP);
    if (t.scalar_type() == at::kBFloat16) {
      const at::BFloat16* xh = t.data_ptr<at::BFloat16>();
      xf_.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) xf_[i] = static_cast<float>(xh[i]);
      x_ = xf_.data();
    } else {
      x_ = t.data_ptr<float>();
    }
    const float* x = x_;
    if (offset) xsum_.resize(nblk);
    if (act_bits != 32) {
      xq_.resize(nblk * GROUP);
      xd_.resize(nblk);
      if (path == Path::bytes_vnni) xb_.resize(nblk * GROUP);
      const float L = act_bits == 16 ? 32767.f : 127.f;
      at::parallel_for(0, nblk, 256, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          int16_t* q = xq_.data() + i * GROUP;
          const int32_t sum = quantize_block(x + i * GROUP, q, &xd_[i], L);
          if (offset) xsum_[i] = xd_[i] * static_cast<float>(sum);
          for (int j = 0; j < (xb_.empty() ? 0 : GROUP); ++j)  // int8 weights take x + 128 as unsigned
            xb_[i * GROUP + j] = static_cast<uint8_t>(q[byte_order(bits, j)] + (bits == 8 ? 128 : 0));
        }
      });
    } else if (offset) {
      for (int64_t i = 0; i < nblk; ++i) {
        float s = 0.f;
        for (int64_t j = 0; j < GROUP; ++j) s += x[i * GROUP + j];
        xsum_[i] = s;
      }
    }
  }

  Rows rows() const { return {x_, data(xq_), data(xb_), data(xd_), data(xsum_), K_}; }

 private:
  template <typename T>
  static const T* data(const std::vector<T>& v) { return v.empty() ? nullptr : v.data(); }

  int64_t K_;
  const float* x_;
  std::vector<float> xf_, xsum_, xd_;
  std::vector<int16_t> xq_;
  std::vector<uint8_t> xb_;
};
