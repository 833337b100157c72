// y[M, N] = x[M, K] @ W[N, K]^T + b in bfloat16 for a batched decode's rows (tens of them), on
// AVX512-BF16 dot pairs, over a weight packed once at load.
//
// A batched decode step streams every weight of the model from memory once, and each weight is
// multiplied with every row of the batch: tens of FLOPs per byte, so the step is compute bound
// only if the weight stream keeps up with the dot products. oneDNN's blocked GEMM on its packed
// weight ran tens of rows at the rate it reaches on a cache-resident weight only when that weight
// was resident; streaming a model's layers one after another it lost about a third of it
// (docs/figures/execution.md). Here each thread walks its own contiguous run of the packed weight
// and, while its first register tile reads one block, asks for the next block into L2, a cache
// line per panel and key pair, so the stream is in flight while the block is multiplied.
//
// Packed layout: panels of 16 output columns, each [K/2][16][2]: the 16 columns' weights of a key
// pair side by side, the operand one `vdpbf16ps` multiplies with a broadcast pair of x (N padded
// to 16 with zero columns). A register tile is kRows rows of x by kPanels panels: kRows x kPanels
// fp32 accumulators, each output y[m, n] the sum over key pairs in order of exact bf16 products
// added pairwise, plus the bias, rounded to bf16 once. That is one function of x[m] and W[n]: it
// does not depend on M, the tile, or the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DEEPINFER_BATCH_ROWS 1
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kPanel = 16;  // output columns per panel: one fp32 vector of accumulators

#ifdef DEEPINFER_BATCH_ROWS
constexpr int kRows = 8;    // x rows per register tile
constexpr int kPanels = 3;  // panels per register tile (and per block a thread walks)
constexpr int64_t kMinParallel = 1 << 16;

// acc[R][P] over key pairs [0, KP) of rows x[0..R) (row stride ldx) and the P panels at wp (panel
// stride ps); with `ahead`, the same offsets of the next block are asked for into L2.
template <int R, int P>
inline void tile(const bf16* x, int64_t ldx, const bf16* wp, int64_t ps, int64_t KP, const bf16* ahead,
                 __m512 acc[R][P]) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512bh w[P];
    for (int j = 0; j < P; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + j * ps + kp * 2 * kPanel);
    if (ahead != nullptr)
      for (int j = 0; j < P; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * ps + kp * 2 * kPanel), _MM_HINT_T1);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * kp, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < P; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], a);
    }
  }
}

// Rows [m0, m0 + R) by panels [p0, p0 + P): the tile, then bias and one rounding per output.
template <int R, int P>
void run_tile(const bf16* x, int64_t ldx, int64_t K, const bf16* packed, const float* bias, int64_t N, int64_t m0,
              int64_t p0, const bf16* ahead, bf16* y) {
  const int64_t KP = K / 2, ps = KP * 2 * kPanel;
  __m512 acc[R][P];
  tile<R, P>(x + m0 * ldx, ldx, packed + p0 * ps, ps, KP, ahead, acc);
  for (int j = 0; j < P; ++j) {
    const int64_t n0 = (p0 + j) * kPanel, left = std::min<int64_t>(kPanel, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));
      _mm256_mask_storeu_epi16(y + (m0 + i) * N + n0, mask, out);
    }
  }
}

template <int P>
void rows_tile(int64_t R, const bf16* x, int64_t ldx, int64_t K, const bf16* packed, const float* bias, int64_t N,
               int64_t m0, int64_t p0, const bf16* ahead, bf16* y) {
  switch (R) {
    case 8: return run_tile<8, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 7: return run_tile<7, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 6: return run_tile<6, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 5: return run_tile<5, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 4: return run_tile<4, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 3: return run_tile<3, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    case 2: return run_tile<2, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
    default: return run_tile<1, P>(x, ldx, K, packed, bias, N, m0, p0, ahead, y);
  }
}
#endif

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "the weight must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(w.size(1) % 2 == 0, "the weight's input size must be even");
}

// [ceil(N / 16), K / 2, 16, 2]: panel p, key pair kp, column c holds W[16 p + c][2 kp .. 2 kp + 1].
at::Tensor pack(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be a bfloat16 [M, K] tensor with dense rows");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % 2 == 0, "the input size must be even");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(0) == panels && packed.size(1) == K / 2 && packed.size(2) == kPanel && packed.size(3) == 2,
              "packed must be batch_rows.pack's [ceil(N/16), K/2, 16, 2] of a weight with ", N, " rows and ", K,
              " columns");
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have ", N, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef DEEPINFER_BATCH_ROWS
  const bf16* xp = x.data_ptr<bf16>();
  const int64_t ldx = x.stride(0);
  const bf16* wp = packed.data_ptr<bf16>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  bf16* yp = y.data_ptr<bf16>();
  const int64_t blocks = (panels + kPanels - 1) / kPanels, ps = K * kPanel;
  // Contiguous runs of blocks per thread: each thread streams its own part of the weight. A call
  // of fewer than kMinParallel multiply-adds stays on this thread.
  const int64_t grain = std::max<int64_t>(1, kMinParallel / std::max<int64_t>(1, M * kPanels * kPanel * K));
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t p0 = blk * kPanels, P = std::min<int64_t>(kPanels, panels - p0);
      const bf16* ahead = blk + 1 < hi ? wp + (p0 + kPanels) * ps : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t R = std::min<int64_t>(kRows, M - m0);
        // the first row tile asks for the next block (its full width even where that block is the
        // last, narrower one: a prefetch past the end of the weight is harmless)
        const bf16* next = m0 == 0 ? ahead : nullptr;
        if (P == 3) rows_tile<3>(R, xp, ldx, K, wp, bp, N, m0, p0, next, yp);
        else if (P == 2) rows_tile<2>(R, xp, ldx, K, wp, bp, N, m0, p0, next, yp);
        else rows_tile<1>(R, xp, ldx, K, wp, bp, N, m0, p0, next, yp);  // the last block of a few panels
      }
    }
  });
#else
  TORCH_CHECK(false, "batch_rows.linear needs AVX512-BF16");
#endif
  return y;
}

// "avx512_bf16" or "none": whether this build runs the kernel.
std::string isa() {
#ifdef DEEPINFER_BATCH_ROWS
  return "avx512_bf16";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_batch, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
