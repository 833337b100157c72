// The small per-layer ops of a step in one call each (float32 or bfloat16, CPU). At batch 1 each
// torch op on a few hundred values costs its dispatch, not its arithmetic: rotary alone is about
// ten ops per tensor, RMSNorm five. In bfloat16 torch's code also converts to float32 and back
// around each of them, which costs a bf16 prefill more than its attention's softmax; here each
// value is widened once, computed in float32 and rounded once (to nearest even, as ``.to``
// does). Rows are independent and each is computed by one thread, so results do not depend on
// the thread count.

// Products are rounded one by one (no fused multiply-add), so rotary matches torch's bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

namespace {

constexpr int64_t kRowsPerTask = 64;

// float32 and bfloat16 activations; anything else is left to torch by the caller.
void check_dtype(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
}

template <typename T>
void rotate_rows(const at::Tensor& x, const float* cp, const float* sp, const int64_t* pos, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T_, kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < H; ++h) {
        const T* x1 = xp + t * st + h * sh;
        const T* x2 = x1 + half;
        T* o = op + (t * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float u = static_cast<float>(x1[i]), v = static_cast<float>(x2[i]);
          const float a = u * c[i], b = v * s[i];  // rounded one by one, as torch does
          const float e = v * c[i], f = u * s[i];
          o[i] = static_cast<T>(a - b);
          o[half + i] = static_cast<T>(e + f);
        }
      }
    }
  });
}

// x [T, H, D] (last dim dense) rotated by position, NeoX halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
// with cos/sin [max_positions, D / 2] float32.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  check_dtype(x);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with a dense last dim");
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
  if (x.scalar_type() == at::kFloat)
    rotate_rows<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, out);
  else
    rotate_rows<c10::BFloat16>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, out);
  return out;
}

template <typename T>
void norm_row(const T* x, const float* w, float eps, int64_t N, T* o) {
  double ss = 0.0;
  for (int64_t i = 0; i < N; ++i) ss += static_cast<double>(static_cast<float>(x[i])) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / N) + eps);
  for (int64_t i = 0; i < N; ++i) o[i] = static_cast<T>(static_cast<float>(x[i]) * inv * w[i]);
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  check_dtype(x);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, N] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight must be contiguous float32 [N]");
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& w, float eps, at::Tensor& out) {
  const int64_t N = x.size(1);
  const T* xp = x.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * N, wp, eps, N, op + t * N);
  });
}

// RMSNorm of each row of x [T, N]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    norm_rows<float>(x, w, static_cast<float>(eps), out);
  else
    norm_rows<c10::BFloat16>(x, w, static_cast<float>(eps), out);
  return out;
}

// sum = x + residual rounded to T (as torch's add), then its RMSNorm, row by row
template <typename T>
void add_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, float eps, at::Tensor& sum,
                   at::Tensor& out) {
  const int64_t N = x.size(1);
  const T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>();
  const float* wp = w.data_ptr<float>();
  T *sp = sum.data_ptr<T>(), *op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t i = 0; i < N; ++i)
        sp[t * N + i] = static_cast<T>(static_cast<float>(xp[t * N + i]) + static_cast<float>(rp[t * N + i]));
      norm_row(sp + t * N, wp, eps, N, op + t * N);
    }
  });
}

// (x + residual, RMSNorm(x + residual)): a residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "residual must be contiguous and like x");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    add_norm_rows<float>(x, residual, w, static_cast<float>(eps), sum, out);
  else
    add_norm_rows<c10::BFloat16>(x, residual, w, static_cast<float>(eps), sum, out);
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
