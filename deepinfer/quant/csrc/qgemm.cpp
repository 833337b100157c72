// Weight-only quantized matmul for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x and y fp32,
// or both bf16 (a bf16 model's activations, taken and given back as they are: widened to fp32 on
// the way in, which is exact, and rounded once as y is stored; the arithmetic is the fp32 call's).
//
// W is held in groups of 32 columns, repacked once at load 8 output rows together: the layout
// is qgemm_layout.h's.
//
//   y[m, n] = bias[n] + sum_g (scale[n, g] * d[m, g] * (q[n, g, :] . xq[m, g, :]) + offset[n, g] * xsum[m, g])
//
// summed over g in order, one fp32 FMA for each term. The activations are taken one of two ways:
// - act_bits 16 or 8, integer: each block of 32 values of a row of x is rounded once per call to
//   codes xq = round(x * L / max|x|) (L = 32767 or 127) with the block's scale d = max|x| / L;
//   the dots are exact int32 (|q| <= 128, 32 products); xsum = d * the sum of the block's codes.
// - act_bits 32, float: the codes are widened to fp32 and dotted with x as it is (d = 1 and
//   xsum = the block's sum); its only error is the weights' own.
// Each output element is computed by one thread in one fixed order, whatever the thread count or
// the number of rows M (rows of x are taken MT at a time over a block that stays in L1, so the
// weights are read from memory once per call). Built by deepinfer/native_build.py with AVX2+FMA
// where torch runs AVX2, else as portable scalar code (the same integer dots and the same order
// of the per-group FMAs; the float path's in-group sums may round differently). Where the build
// has AVX-512 VNNI (with VL: 256-bit forms, the same registers and layout), the int16 loop fuses
// its multiply-add and add into vpdpwssd, and act_bits 8 takes its codes as bytes, 4 products per
// vpdpbusd (u8 x s8: int4 codes are the unsigned side; int8 codes meet x + 128, less 128 x the
// codes' sum, as llama.cpp does); the integer dots are exact either way, so the results are the
// AVX2 loop's bit for bit (vnni=false runs that loop in such a build, to compare them). With
// AVX-512 BW too, int16 calls of several rows run qgemm_wide.h's 512-bit tiles, again the same
// bits (wide=false keeps them on the 256-bit loop, to compare).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "qgemm_acts.h"
#include "qgemm_layout.h"
#include "qgemm_operands.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEEPINFER_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DEEPINFER_VNNI 1  // 256-bit vpdpwssd / vpdpbusd: the same registers, fused multiply-add-to-int32
#endif
#endif
#include "qgemm_wide.h"  // (after DEEPINFER_VNNI: its 512-bit tiles need it)

namespace {

constexpr int MAX_MT = 4;  // activation rows per pass over a block

#ifdef DEEPINFER_AVX2

// Pair p of a block's group as 16 int16 lanes (see the layout above); chunk = the 32 bytes holding it.
template <int BITS, int S>
inline __m256i pair_codes(__m256i chunk) {
  if constexpr (BITS == 8) {
    return S == 0 ? _mm256_srai_epi16(_mm256_slli_epi16(chunk, 8), 8) : _mm256_srai_epi16(chunk, 8);
  } else {
    return _mm256_and_si256(_mm256_srli_epi16(chunk, 4 * S), _mm256_set1_epi16(0x0F));
  }
}

inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i pair_of(const int16_t* x) {  // x[0], x[1] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return _mm256_set1_epi32(v);
}

// dot[m] + odd[m] = the exact integer dots of one block's group with MT rows of int16 activation
// codes (VNNI: odd pairs into odd[m], two chains, as a fused multiply-add waits on its sum).
template <int BITS, int MT, bool VNNI>
inline void dots_int16(const Rows& a, const uint8_t* q, int64_t g, __m256i dot[MT], __m256i odd[MT]) {
  constexpr int PER_CHUNK = BITS == 8 ? 2 : 4;
  for (int c = 0; c < 16 / PER_CHUNK; ++c) {
    const __m256i chunk = load(q + 32 * c);
    auto step = [&](__m256i wp, int p) {
      for (int m = 0; m < MT; ++m) {
        const __m256i xp = pair_of(a.q + m * a.K + g * GROUP + 2 * p);
#ifdef DEEPINFER_VNNI
        if constexpr (VNNI) {
          __m256i& sum = p % 2 ? odd[m] : dot[m];
          sum = _mm256_dpwssd_epi32(sum, wp, xp);
          continue;
        }
#endif
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(wp, xp));
      }
    };
    step(pair_codes<BITS, 0>(chunk), PER_CHUNK * c);
    step(pair_codes<BITS, 1>(chunk), PER_CHUNK * c + 1);
    if constexpr (PER_CHUNK == 4) {
      step(pair_codes<BITS, 2>(chunk), PER_CHUNK * c + 2);
      step(pair_codes<BITS, 3>(chunk), PER_CHUNK * c + 3);
    }
  }
}

#ifdef DEEPINFER_VNNI
// The same dots from int8 activation codes as bytes: each 32-bit lane of a chunk holds 4 columns
// of one row (int8: the chunk's two pairs; int4: its low or its high nibbles), so one vpdpbusd
// adds 4 products per row against 4 activation bytes broadcast in that column order (byte_order).
template <int BITS, int MT>
inline void dots_bytes(const Rows& a, const uint8_t* q, int64_t g, __m256i dot[MT], __m256i odd[MT]) {
  auto quad = [&](int m, int i) {
    int32_t v;
    std::memcpy(&v, a.b + m * a.K + g * GROUP + 4 * i, sizeof v);
    return _mm256_set1_epi32(v);
  };
  if constexpr (BITS == 4) {  // the codes 0..15 are the unsigned operand, the activations signed
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i chunk = load(q + 32 * c);
      const __m256i lo = _mm256_and_si256(chunk, mask), hi = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), mask);
      for (int m = 0; m < MT; ++m) {
        dot[m] = _mm256_dpbusd_epi32(dot[m], lo, quad(m, 2 * c));
        odd[m] = _mm256_dpbusd_epi32(odd[m], hi, quad(m, 2 * c + 1));
      }
    }
  } else {  // signed codes: the activations + 128 are the unsigned operand, less 128 x the codes' sum
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i chunk = load(q + 32 * c);
      sum = _mm256_dpbusd_epi32(sum, ones, chunk);
      for (int m = 0; m < MT; ++m) {
        __m256i& acc = c % 2 ? odd[m] : dot[m];
        acc = _mm256_dpbusd_epi32(acc, quad(m, c), chunk);
      }
    }
    sum = _mm256_slli_epi32(sum, 7);
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_sub_epi32(dot[m], sum);
  }
}
#endif

// acc[m] += per-group terms of one block for MT rows of integer activations.
template <int BITS, int MT, Path P>
inline void group_int(const Rows& a, const Packed& w, const uint8_t* q, int64_t g, __m256 acc[MT]) {
  __m256i dot[MT], odd[MT];
  for (int m = 0; m < MT; ++m) dot[m] = odd[m] = _mm256_setzero_si256();
#ifdef DEEPINFER_VNNI
  if constexpr (P == Path::bytes_vnni) dots_bytes<BITS, MT>(a, q, g, dot, odd);
  else
#endif
    dots_int16<BITS, MT, P == Path::int16_vnni>(a, q, g, dot, odd);
  if constexpr (P != Path::int16)
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_add_epi32(dot[m], odd[m]);
  const __m256 s = _mm256_loadu_ps(w.scale + g * ROWS);
  for (int m = 0; m < MT; ++m) {
    const int64_t mg = m * w.groups + g;
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(s, _mm256_set1_ps(a.d[mg])), acc[m]);
    if (w.offset != nullptr)
      acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(w.offset + g * ROWS), _mm256_set1_ps(a.xsum[mg]), acc[m]);
  }
}

// The same with float activations: the pair's codes widened to fp32 (rows 0-3 and 4-7, each lane
// pair one row's two columns) times the activation pair; the lane pairs are added at the group's end.
template <int BITS, int MT>
inline void group_float(const Rows& a, const Packed& w, const uint8_t* q, int64_t g, __m256 acc[MT]) {
  constexpr int PER_CHUNK = BITS == 8 ? 2 : 4;
  __m256 lo[MT], hi[MT];
  for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int c = 0; c < 16 / PER_CHUNK; ++c) {
    const __m256i chunk = load(q + 32 * c);
    auto step = [&](__m256i wp, int p) {
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(wp)));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(wp, 1)));
      for (int m = 0; m < MT; ++m) {
        const double* xp = reinterpret_cast<const double*>(a.x + m * a.K + g * GROUP + 2 * p);
        const __m256 xb = _mm256_castpd_ps(_mm256_broadcast_sd(xp));
        lo[m] = _mm256_fmadd_ps(w0, xb, lo[m]);
        hi[m] = _mm256_fmadd_ps(w1, xb, hi[m]);
      }
    };
    step(pair_codes<BITS, 0>(chunk), PER_CHUNK * c);
    step(pair_codes<BITS, 1>(chunk), PER_CHUNK * c + 1);
    if constexpr (PER_CHUNK == 4) {
      step(pair_codes<BITS, 2>(chunk), PER_CHUNK * c + 2);
      step(pair_codes<BITS, 3>(chunk), PER_CHUNK * c + 3);
    }
  }
  const __m256 s = _mm256_loadu_ps(w.scale + g * ROWS);
  for (int m = 0; m < MT; ++m) {
    // hadd: [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order
    const __m256 h = _mm256_hadd_ps(lo[m], hi[m]);
    const __m256 dot = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
    acc[m] = _mm256_fmadd_ps(dot, s, acc[m]);
    if (w.offset != nullptr)
      acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(w.offset + g * ROWS), _mm256_set1_ps(a.xsum[m * w.groups + g]),
                               acc[m]);
  }
}

// y rows m0 .. m0 + MT of one block of 8 output rows (n0 .. n0 + valid).
template <int BITS, int MT, Path P>
void block_tile(const Rows& a, const Packed& w, int64_t n0, int valid, const Out& y) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* q = w.codes + g * block_bytes<BITS>();
    if constexpr (P == Path::floats) group_float<BITS, MT>(a, w, q, g, acc);
    else group_int<BITS, MT, P>(a, w, q, g, acc);
  }
  for (int m = 0; m < MT; ++m) {
    alignas(32) float out[ROWS];
    _mm256_store_ps(out, acc[m]);
    for (int r = 0; r < valid; ++r) y.put(m, n0 + r, w.bias == nullptr ? out[r] : out[r] + w.bias[n0 + r]);
  }
}

#else  // portable scalar code

template <int BITS, int MT, Path P>
void block_tile(const Rows& a, const Packed& w, int64_t n0, int valid, const Out& y) {
  for (int m = 0; m < MT; ++m) {
    for (int r = 0; r < valid; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* q = w.codes + g * block_bytes<BITS>();
        const int64_t mg = m * w.groups + g;
        const float s = w.scale[g * ROWS + r];
        if constexpr (P == Path::floats) {
          float d = 0.f;
          for (int j = 0; j < GROUP; ++j) d += static_cast<float>(code<BITS>(q, r, j)) * a.x[m * a.K + g * GROUP + j];
          acc = std::fma(d, s, acc);
        } else {
          int32_t d = 0;
          for (int j = 0; j < GROUP; ++j) d += code<BITS>(q, r, j) * a.q[m * a.K + g * GROUP + j];
          acc = std::fma(static_cast<float>(d), s * a.d[mg], acc);
        }
        if (w.offset != nullptr) acc = std::fma(w.offset[g * ROWS + r], a.xsum[mg], acc);
      }
      y.put(m, n0 + r, w.bias == nullptr ? acc : acc + w.bias[n0 + r]);
    }
  }
}

#endif

// Blocks b0 .. b1 for every row of x: each block's codes are read from memory once, then reused
// from cache for the next MT rows. wide: two blocks at a time through qgemm_wide.h's tiles (the
// same bits), the last one of an odd count alone.
template <int BITS, Path P>
void blocks(const Rows& a, const Packed& w, int64_t M, int64_t N, int64_t b0, int64_t b1, const Out& y,
            bool wide) {
  for (int64_t b = b0; b < b1; ++b) {
    const Packed wb{w.codes + b * w.groups * block_bytes<BITS>(), w.scale + b * w.groups * ROWS,
                    w.offset == nullptr ? nullptr : w.offset + b * w.groups * ROWS, w.bias, w.groups};
    const int64_t n0 = b * ROWS;
#ifdef DEEPINFER_WIDE
    if constexpr (P == Path::int16_vnni) {
      if (wide && b + 1 < b1) {
        wide_pair_of_blocks<BITS>(a, wb, M, n0, static_cast<int>(std::min<int64_t>(2 * ROWS, N - n0)), y);
        ++b;
        continue;
      }
    }
#endif
    const int valid = static_cast<int>(std::min<int64_t>(ROWS, N - n0));
    for (int64_t m0 = 0; m0 < M; m0 += MAX_MT) {
      const Rows am = a.at(m0);
      const Out ym = y.at(m0);
      switch (std::min<int64_t>(MAX_MT, M - m0)) {
        case 1: block_tile<BITS, 1, P>(am, wb, n0, valid, ym); break;
        case 2: block_tile<BITS, 2, P>(am, wb, n0, valid, ym); break;
        case 3: block_tile<BITS, 3, P>(am, wb, n0, valid, ym); break;
        default: block_tile<BITS, 4, P>(am, wb, n0, valid, ym); break;
      }
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                  const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t bits, int64_t act_bits, bool vnni, bool wide) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(act_bits == 32 || act_bits == 16 || act_bits == 8, "act_bits must be 32, 16 or 8, got ", act_bits);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 or bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, groups = K / GROUP;
  const int64_t nblocks = (N + ROWS - 1) / ROWS;
  TORCH_CHECK(K % GROUP == 0, "in_features (", K, ") must be a multiple of ", GROUP);
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 &&
              codes.sizes() == at::IntArrayRef({nblocks, groups, bits == 8 ? 256 : 128}),
              "codes must be contiguous packed bytes [ceil(N/8), K/32, 32*bits]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.sizes() == at::IntArrayRef({nblocks, groups, ROWS}), "scale must be float32 [ceil(N/8), K/32, 8]");
  const float* off = nullptr;
  if (offset.has_value()) {
    TORCH_CHECK(offset->scalar_type() == at::kFloat && offset->is_contiguous() &&
                offset->sizes() == scale.sizes(), "offset must be float32 [ceil(N/8), K/32, 8]");
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
#ifdef DEEPINFER_VNNI
  const Path ints = !vnni ? Path::int16 : act_bits == 8 ? Path::bytes_vnni : Path::int16_vnni;
#else
  const Path ints = Path::int16;  // (vnni: no such code in this build)
#endif
  const Path path = act_bits == 32 ? Path::floats : ints;
#ifdef DEEPINFER_WIDE
  const bool wide_rows = wide && M >= WIDE_MIN_ROWS;  // (int16 VNNI calls only: blocks() checks the path)
#else
  const bool wide_rows = false;  // (wide: no such code in this build)
#endif
  const Activations acts(x, bits, act_bits, path, off != nullptr);
  const Rows a = acts.rows();
  const Packed w{static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), off, b, groups};
  const Out yp{bf16 ? nullptr : y.data_ptr<float>(), bf16 ? y.data_ptr<at::BFloat16>() : nullptr, N};
  // at least ~64K multiply-adds per task: smaller layers are not worth waking a thread for
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * ROWS));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    auto run = [&](auto p) {
      if (bits == 8) blocks<8, decltype(p)::value>(a, w, M, N, b0, b1, yp, wide_rows);
      else blocks<4, decltype(p)::value>(a, w, M, N, b0, b1, yp, wide_rows);
    };
    switch (path) {
      case Path::floats: run(std::integral_constant<Path, Path::floats>{}); break;
#ifdef DEEPINFER_VNNI
      case Path::int16_vnni: run(std::integral_constant<Path, Path::int16_vnni>{}); break;
      case Path::bytes_vnni: run(std::integral_constant<Path, Path::bytes_vnni>{}); break;
#endif
      default: run(std::integral_constant<Path, Path::int16>{}); break;
    }
  });
  return y;
}

// The weight in fp32, [N, K] (prefill-sized calls run F.linear on it): w = q * scale + offset.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                      int64_t out_features, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  const int64_t nblocks = codes.size(0), groups = codes.size(1), N = out_features, K = groups * GROUP;
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1 && codes.size(2) == (bits == 8 ? 256 : 128) &&
              nblocks == (N + ROWS - 1) / ROWS, "codes must be contiguous packed bytes [ceil(N/8), K/32, 32*bits]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.sizes() == at::IntArrayRef({nblocks, groups, ROWS}),
              "scale must be float32 [ceil(N/8), K/32, 8]");
  const float* off = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  at::Tensor w = at::empty({N, K}, scale.options());
  const uint8_t* q = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sc = scale.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  const int64_t bb = bits == 8 ? block_bytes<8>() : block_bytes<4>();
  at::parallel_for(0, nblocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int r = 0; r < ROWS && b * ROWS + r < N; ++r) {
        float* row = wp + (b * ROWS + r) * K;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* qg = q + (b * groups + g) * bb;
          const int64_t i = (b * groups + g) * ROWS + r;
          const float o = off == nullptr ? 0.f : off[i];  // (unused when null)
          for (int j = 0; j < GROUP; ++j) {
            // rounded product, then the sum (volatile: never fused into an FMA), as QuantizedWeight.dequantize
            volatile float v = static_cast<float>(bits == 8 ? code<8>(qg, r, j) : code<4>(qg, r, j)) * sc[i];
            row[g * GROUP + j] = off == nullptr ? v : v + o;
          }
        }
      }
    }
  });
  return w;
}

// "avx512-vnni", "avx2" or "scalar": which code this build holds.
std::string isa() {
#if defined(DEEPINFER_VNNI)
  return "avx512-vnni";
#elif defined(DEEPINFER_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_quant, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scale, Tensor? offset, Tensor? bias, int out_features, int bits, "
        "int act_bits, bool vnni=True, bool wide=True) -> Tensor");
  m.def("dequantize(Tensor codes, Tensor scale, Tensor? offset, int out_features, int bits) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.impl("dequantize", c10::DispatchKey::CPU, TORCH_FN(dequantize));
}
