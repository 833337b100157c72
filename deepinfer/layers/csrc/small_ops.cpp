// The small per-layer ops of a decode step in one call each (float32 or bf16, CPU). At batch 1
// each torch op on a few hundred values costs its dispatch, not its arithmetic: rotary alone is
// about ten ops per tensor, RMSNorm five (bf16: more, with the widening and rounding copies).
// Rows are independent and each is computed by one thread, so results do not depend on the
// thread count. bf16 tensors are computed as torch's code computes them: widened to float32
// (exact), the float32 arithmetic, each result rounded to bf16 (to nearest even) as it is stored.

// Products are rounded one by one (no fused multiply-add), so rotary matches torch's bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "attention_math.h"  // load8: 8 float32 or bf16 values widened to float32

namespace {

#ifdef __AVX2__
using deepinfer_attention::exp8;
using deepinfer_attention::load8;
#endif

constexpr int64_t kRowsPerTask = 64;

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// 8 float32 -> 8 bf16 rounded to nearest even, in one instruction (a subnormal float32 result
// becomes zero: far below any activation or norm output).
inline __m128i to_bf16x8(__m256 v) { return reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)); }
#elif defined(__AVX2__)
// 8 float32 -> 8 bf16 rounded to nearest even (a NaN stays a quiet NaN), as c10's conversion.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

#ifdef __AVX2__
// 8 float32 values stored as S (float32, or bf16 rounded as c10 rounds).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v)); }
#endif

// f(T{}) with T the element type of x: float or at::BFloat16 (the only ones accepted).
template <typename F>
void on_dtype(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kBFloat16) f(at::BFloat16{});
  else f(float{});
}

bool float_or_bf16(const at::Tensor& x) { return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16; }

// Rotary embedding of x [T, H, D] (last dim dense) by position, NeoX halves: (x1, x2) -> (x1 c - x2 s,
// x2 c + x1 s), with cos/sin [max_positions, D / 2] float32. Checks x, the tables and positions;
// returns the positions.
const int64_t* rotary_positions(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && float_or_bf16(x) && x.stride(2) == 1, "x must be float32 or bf16 [T, H, D]");
  const int64_t T = x.size(0), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && cos.is_contiguous() && sin.is_contiguous()
              && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be contiguous float32 [max_positions, D / 2]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong
              && positions.is_contiguous(), "positions must be a contiguous int64 [T] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " beyond the rotary table");
  return pos;
}

// x rotated into out [T, H, D] (contiguous)
void rotate_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const int64_t* pos, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  on_dtype(x, [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const float* c = cp + pos[t] * half;
        const float* s = sp + pos[t] * half;
        for (int64_t h = 0; h < H; ++h) {
          const S* x1 = xp + t * st + h * sh;
          const S* x2 = x1 + half;
          S* o = op + (t * H + h) * D;
          for (int64_t i = 0; i < half; ++i) {
            const float u = static_cast<float>(x1[i]), v = static_cast<float>(x2[i]);
            const float a = u * c[i], b = v * s[i];  // rounded one by one, as torch does
            const float e = v * c[i], f = u * s[i];
            o[i] = static_cast<S>(a - b);
            o[half + i] = static_cast<S>(e + f);
          }
        }
      }
    });
  });
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  const int64_t* pos = rotary_positions(x, cos, sin, positions);
  at::Tensor out = at::empty(x.sizes(), x.options());
  rotate_into(x, cos, sin, pos, out);
  return out;
}

template <typename S>
void norm_row(const S* x, const float* w, float eps, int64_t N, S* o) {
  double ss = 0.0;  // squares of float32 values are exact in double: the order barely matters
  int64_t i = 0;
#ifdef __AVX2__
  __m256d acc = _mm256_setzero_pd();
  for (; i + 8 <= N; i += 8) {
    const __m256 v = load8(x + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_mul_pd(lo, lo), _mm256_mul_pd(hi, hi)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  ss = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < N; ++i) ss += static_cast<double>(static_cast<float>(x[i])) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / N) + eps);
  i = 0;
#ifdef __AVX2__
  for (; i + 8 <= N; i += 8)
    store8(o + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), _mm256_set1_ps(inv)), _mm256_loadu_ps(w + i)));
#endif
  for (; i < N; ++i) o[i] = static_cast<S>(static_cast<float>(x[i]) * inv * w[i]);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x) && x.is_contiguous(), "x must be contiguous float32 or bf16 [T, N]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && float_or_bf16(w) && w.is_contiguous(),
              "weight must be contiguous float32 or bf16 [N]");
}

// The weight widened to float32 (exact): a bf16 model's norm weights are bf16.
std::vector<float> weight_floats(const at::Tensor& w) {
  std::vector<float> out(w.numel());
  on_dtype(w, [&](auto tag) {
    const auto* p = w.data_ptr<decltype(tag)>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(p[i]);
  });
  return out;
}

// RMSNorm of each row of x [T, N]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty_like(x);
  const std::vector<float> wf = weight_floats(w);
  const float* wp = wf.data();
  on_dtype(x, [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    S* op = out.data_ptr<S>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * N, wp, static_cast<float>(eps), N, op + t * N);
    });
  });
  return out;
}

// (x + residual, RMSNorm(x + residual)): a residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "residual must be contiguous and of x's dtype");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const std::vector<float> wf = weight_floats(w);
  const float* wp = wf.data();
  on_dtype(x, [&](auto tag) {
    using S = decltype(tag);
    const S *xp = x.data_ptr<S>(), *rp = residual.data_ptr<S>();
    S *sp = sum.data_ptr<S>(), *op = out.data_ptr<S>();
    at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        int64_t i = 0;  // the sum rounded to x's dtype first: the norm reads what is returned
#ifdef __AVX2__
        for (; i + 8 <= N; i += 8) store8(sp + t * N + i, _mm256_add_ps(load8(xp + t * N + i), load8(rp + t * N + i)));
#endif
        for (; i < N; ++i)
          sp[t * N + i] = static_cast<S>(static_cast<float>(xp[t * N + i]) + static_cast<float>(rp[t * N + i]));
        norm_row(sp + t * N, wp, static_cast<float>(eps), N, op + t * N);
      }
    });
  });
  return {sum, out};
}

// Each row's largest value's index, as torch.argmax gives it: the first of equal largest values,
// and a NaN counts as largest (the first NaN wins). A greedy step reads one per sequence from
// [rows, vocab] logits; torch's argmax takes them one element at a time, and a bf16 row first
// costs a float32 copy of the logits.
template <typename S>
int64_t argmax_row(const S* x, int64_t V) {
  int64_t best = 0, i = 0;
  float top = static_cast<float>(x[0]);
#ifdef __AVX2__
  if (V >= 16) {  // per lane: the first largest value; a strict > keeps the earlier index on ties
    __m256 vbest = load8(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    __m256 nan = _mm256_cmp_ps(vbest, vbest, _CMP_UNORD_Q);
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= V; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = load8(x + i);
      const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vbest = _mm256_blendv_ps(vbest, v, gt);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    if (_mm256_movemask_ps(nan)) {  // rare: the first NaN, scanned for
      for (int64_t j = 0; j < V; ++j)
        if (std::isnan(static_cast<float>(x[j]))) return j;
    }
    alignas(32) float vals[8];
    alignas(32) int32_t idx[8];
    _mm256_store_ps(vals, vbest);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), vidx);
    top = vals[0], best = idx[0];
    for (int l = 1; l < 8; ++l)
      if (vals[l] > top || (vals[l] == top && idx[l] < best)) top = vals[l], best = idx[l];
  } else {
    i = 1;
  }
#else
  i = 1;
#endif
  for (; i < V; ++i) {  // the tail comes after every index above: only a larger value wins
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) {
      for (int64_t j = 0; j <= i; ++j)
        if (std::isnan(static_cast<float>(x[j]))) return j;
    }
    if (v > top) top = v, best = i;
  }
  return std::isnan(top) ? 0 : best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x) && x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 or bf16 [rows, V] with dense rows");
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 65536 / V);  // a task of at least ~64K values
  on_dtype(x, [&](auto tag) {
    using S = decltype(tag);
    const S* xp = x.data_ptr<S>();
    at::parallel_for(0, R, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) op[r] = argmax_row(xp + r * stride, V);
    });
  });
  return out;
}

// cache[slot // S, slot % S] = x[t] for each t (slot = slots[t]), cache [pages, S, H, D] and x
// [T, H, D] of one dtype with dense last dims: the step's new K or V rows written into their
// pages by one call (torch's index_copy_ goes through TensorIterator element by element).
void check_store(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 4 && x.dim() == 3 && float_or_bf16(x) && x.scalar_type() == cache.scalar_type(),
              "cache [pages, S, H, D] and x [T, H, D] must be float32 or bf16 of one dtype");
  TORCH_CHECK(cache.sizes().slice(2) == x.sizes().slice(1) && cache.stride(3) == 1 && x.stride(2) == 1,
              "cache and x differ in heads or dim, or a last dim is not dense");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong
              && slots.is_contiguous(), "slots must be a contiguous int64 [T] tensor");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache.size(0) * cache.size(1), "slot ", sp[t], " out of range");
}

void store_into(at::Tensor& cache, const at::Tensor& x, const int64_t* sp) {
  const int64_t T = x.size(0), H = x.size(1), S = cache.size(1), bytes = x.size(2) * x.element_size();
  char* cp = static_cast<char*>(cache.data_ptr());
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t es = x.element_size();
  for (int64_t t = 0; t < T; ++t) {
    char* dst = cp + ((sp[t] / S) * cache.stride(0) + (sp[t] % S) * cache.stride(1)) * es;
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(dst + h * cache.stride(2) * es, xp + (t * x.stride(0) + h * x.stride(1)) * es, bytes);
  }
}

void store_rows(at::Tensor& cache, const at::Tensor& x, const at::Tensor& slots) {
  check_store(cache, x, slots);
  store_into(cache, x, slots.data_ptr<int64_t>());
}

// A layer's rotary and K/V store in one call: (q, k) rotated, the rotated k and v written into
// their caches' slots (what rotate, rotate, store_rows, store_rows give).
std::tuple<at::Tensor, at::Tensor> rotate_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                                                const at::Tensor& slots) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must be of one dtype");
  const int64_t* pos = rotary_positions(q, cos, sin, positions);
  rotary_positions(k, cos, sin, positions);
  check_store(k_cache, k, slots);
  check_store(v_cache, v, slots);
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  rotate_into(q, cos, sin, pos, q_out);
  rotate_into(k, cos, sin, pos, k_out);
  store_into(k_cache, k_out, slots.data_ptr<int64_t>());
  store_into(v_cache, v, slots.data_ptr<int64_t>());
  return {q_out, k_out};
}

// silu(g) * u of bf16 values, each product rounded to bf16 as torch's silu stores it before the
// multiply: g / (1 + e^-g) from e^-|g| (exp8 takes x <= 0), so no e^g overflows.
inline float silu_mul_one(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  const float silu = g * (g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
  return static_cast<float>(static_cast<at::BFloat16>(silu)) * u;
}


#ifdef __AVX2__
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // e^-|g|
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.f), e, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
  __m256 silu = _mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  // below exp8's clamp e^g is 0 in float32: g * 0 (-0, or NaN for -inf), as the scalar code gives
  silu = _mm256_blendv_ps(silu, _mm256_mul_ps(g, _mm256_setzero_ps()),
                          _mm256_cmp_ps(g, _mm256_set1_ps(-87.3f), _CMP_LT_OQ));
  const __m128i rounded = to_bf16x8(silu);
  return _mm256_mul_ps(load8(reinterpret_cast<const at::BFloat16*>(&rounded)), u);
}
#endif

// gate_up [T, 2I] bf16 (gate | up, rows dense) -> silu(gate) * up [T, I]: the MLP's activation in
// one pass instead of silu's output tensor and a multiply over it.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.stride(1) == 1
              && gate_up.size(1) % 2 == 0, "gate_up must be bf16 [T, 2I] with dense rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, st = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const at::BFloat16* xp = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // tasks of at least ~64K values, as argmax_rows: waking a sleeping (passive) worker costs more
  // than a batched decode's few rows (docs/figures/execution.md)
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(I, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const at::BFloat16 *g = xp + t * st, *u = g + I;
      at::BFloat16* o = op + t * I;
      int64_t i = 0;
#ifdef __AVX2__
      for (; i + 8 <= I; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), to_bf16x8(silu_mul8(load8(g + i), load8(u + i))));
      }
#endif
      for (; i < I; ++i) o[i] = static_cast<at::BFloat16>(silu_mul_one(static_cast<float>(g[i]), static_cast<float>(u[i])));
    }
  });
  return out;
}

std::string isa() {
#ifdef __AVX2__
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_ops, m) {
  m.def("rotate(Tensor x, Tensor cos, Tensor sin, Tensor positions) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("store_rows(Tensor(a!) cache, Tensor x, Tensor slots) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotate_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> (Tensor, Tensor)");
  m.def("isa() -> str", &isa);
  m.impl("rotate", c10::DispatchKey::CPU, TORCH_FN(rotate));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.impl("store_rows", c10::DispatchKey::CPU, TORCH_FN(store_rows));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rotate_store", c10::DispatchKey::CPU, TORCH_FN(rotate_store));
}
