// The small per-layer ops of a decode step in one call each (float32, CPU). At batch 1 each
// torch op on a few hundred values costs its dispatch, not its arithmetic: rotary alone is about
// ten ops per tensor, RMSNorm five. Rows are independent and each is computed by one thread, so
// results do not depend on the thread count.

// Products are rounded one by one (no fused multiply-add), so rotary matches torch's bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

namespace {

constexpr int64_t kRowsPerTask = 64;

// x [T, H, D] (last dim dense) rotated by position, NeoX halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
// with cos/sin [max_positions, D / 2] float32.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be float32 [T, H, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && cos.is_contiguous() && sin.is_contiguous()
              && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be contiguous float32 [max_positions, D / 2]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong
              && positions.is_contiguous(), "positions must be a contiguous int64 [T] tensor");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " beyond the rotary table");
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < H; ++h) {
        const float* x1 = xp + t * st + h * sh;
        const float* x2 = x1 + half;
        float* o = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i] * c[i], b = x2[i] * s[i];  // rounded one by one, as torch does
          const float e = x2[i] * c[i], f = x1[i] * s[i];
          o[i] = a - b;
          o[half + i] = e + f;
        }
      }
    }
  });
  return out;
}

void norm_row(const float* x, const float* w, float eps, int64_t N, float* o) {
  double ss = 0.0;
  for (int64_t i = 0; i < N; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / N) + eps);
  for (int64_t i = 0; i < N; ++i) o[i] = x[i] * inv * w[i];
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, N]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight must be contiguous float32 [N]");
}

// RMSNorm of each row of x [T, N]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * N, wp, static_cast<float>(eps), N, op + t * N);
  });
  return out;
}

// (x + residual, RMSNorm(x + residual)): a residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "residual must be contiguous float32 like x");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t i = 0; i < N; ++i) sp[t * N + i] = xp[t * N + i] + rp[t * N + i];
      norm_row(sp + t * N, wp, static_cast<float>(eps), N, op + t * N);
    }
  });
  return {sum, out};
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
  m.def("isa() -> str", &isa);
  m.impl("rotate", c10::DispatchKey::CPU, TORCH_FN(rotate));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
