// Attention of a prefill chunk's queries over the cached keys before it, on the CPU: the tail of a
// prefix-cache hit (or a later chunk of a chunked prefill) against K/V read in place from the page
// pool ([num_pages, page_size, kv_heads, dim]) through the sequence's page table. Every query sees
// every one of those keys (no mask), so this is a dense product per kv head:
// [queries x q heads of the group] x [keys], as GEMM tiles.
//
// Work item: (kv head, block of 16 query rows), rows being (token, q head of the group): all 16
// rows share each key and value load (GQA). Vectorized over the rows, so the online softmax
// (running max, rescaled sum, fp32 accumulator) needs no horizontal reductions: a tile is 16 rows
// by 16 keys; scores are fp32 sums of exact products (AVX512-BF16 dot-pair instructions), the
// accumulator fp32. Rows are independent, so the result does not depend on the
// thread count. Returns the attention output in fp32 and each row's log-sum-exp of the scaled
// scores, which the caller merges with the chunk's own causal part.
//
// bfloat16 caches only (float32 ones keep torch's flash kernel: with plain FMAs this tiling did
// not beat it), and only where the build has AVX512-BF16: elsewhere ``isa()`` says "none" and
// the caller keeps its torch path.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int64_t kRows = 16;  // query rows per work item: one vector lane each
constexpr int64_t kKeys = 16;  // keys per tile

// e^x: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5] by a degree-7 Taylor polynomial (relative
// error ~1e-8); inputs below -100 give 0.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One value row into float32 (the PV product runs in fp32 FMAs).
inline void to_float(const bf16* v, int64_t n, float* out) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d));
    _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  for (; d < n; ++d) out[d] = static_cast<float>(v[d]);
}

// Queries of one work item, laid out for the score loop as [D/2][16 rows][2] (the pairs the
// dot-pair instruction multiplies). Missing rows are zeros.
void pack_queries(const bf16* q, int64_t row0, int64_t rows, int64_t G, int64_t h, int64_t Hq, int64_t D,
                  bf16* out) {
  std::memset(static_cast<void*>(out), 0, sizeof(bf16) * D * kRows);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = row0 + i;
    const bf16* src = q + (r / G) * Hq * D + (h * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) out[(d / 2) * kRows * 2 + i * 2 + d % 2] = src[d];
  }
}

// s[j] (16 rows each) = q . k[j] for the 16 keys of a tile (a fixed count: the scores stay in
// registers; a short tile's missing keys point at a valid one and are dropped by the caller).
inline void tile_scores(const bf16* qp, const bf16* const* k, int64_t D, __m512* s) {
  for (int64_t j = 0; j < kKeys; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh qd = (__m512bh)_mm512_loadu_si512(qp + d2 * kRows * 2);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j) {
      int32_t pair;
      std::memcpy(&pair, k[j] + 2 * d2, sizeof(pair));
      s[j] = _mm512_dpbf16_ps(s[j], qd, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
}

using T = bf16;

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
         int64_t prefix, float scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t T_ = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), S = k_cache.size(1);
  const int64_t Dv = v_cache.size(3), G = Hq / Hkv, rows = T_ * G, blocks = (rows + kRows - 1) / kRows;
  const T* qd = q.data_ptr<T>();
  const T* kd = k_cache.data_ptr<T>();
  const T* vd = v_cache.data_ptr<T>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> qp(D * kRows);
    std::vector<float> acc(Dv * kRows), vtile(kKeys * Dv);  // acc: [Dv][16 rows]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, row0 = (item % blocks) * kRows;
      const int64_t n_rows = std::min(kRows, rows - row0);
      pack_queries(qd, row0, n_rows, G, h, Hq, D, qp.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l = _mm512_setzero_ps();
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t j0 = 0; j0 < prefix; j0 += kKeys) {
        const int64_t n = std::min(kKeys, prefix - j0);
        const T* k[kKeys];
        for (int64_t j = 0; j < kKeys; ++j) {
          const int64_t pos = j0 + (j < n ? j : 0), page = table[pos / S], off = pos % S;
          k[j] = kd + page * ks0 + off * ks1 + h * ks2;
          to_float(vd + page * vs0 + off * vs1 + h * vs2, Dv, vtile.data() + j * Dv);
        }
        __m512 s[kKeys];
        tile_scores(qp.data(), k, D, s);
        __m512 bm = m;
#pragma GCC unroll 16
        for (int64_t j = 0; j < kKeys; ++j) {
          s[j] = j < n ? _mm512_mul_ps(s[j], vscale) : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          bm = _mm512_max_ps(bm, s[j]);
        }
        const __m512 alpha = exp16(_mm512_sub_ps(m, bm));  // e^-inf = 0 on the first tile
        m = bm;
        l = _mm512_mul_ps(l, alpha);
#pragma GCC unroll 16
        for (int64_t j = 0; j < kKeys; ++j) {
          s[j] = j < n ? exp16(_mm512_sub_ps(s[j], m)) : _mm512_setzero_ps();
          l = _mm512_add_ps(l, s[j]);
        }
        // four value columns at a time: independent FMA chains (one would wait on its latency)
        for (int64_t d = 0; d < Dv; d += 4) {
          const int64_t w = std::min<int64_t>(4, Dv - d);
          __m512 o[4];
          for (int64_t c = 0; c < 4; ++c)
            o[c] = c < w ? _mm512_mul_ps(_mm512_loadu_ps(acc.data() + (d + c) * kRows), alpha) : _mm512_setzero_ps();
#pragma GCC unroll 16
          for (int64_t j = 0; j < kKeys; ++j) {
            const float* vj = vtile.data() + j * Dv + d;
            for (int64_t c = 0; c < 4; ++c) o[c] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vj[c < w ? c : 0]), o[c]);
          }
          for (int64_t c = 0; c < w; ++c) _mm512_storeu_ps(acc.data() + (d + c) * kRows, o[c]);
        }
      }
      alignas(64) float mr[kRows], lr[kRows];
      _mm512_store_ps(mr, m);
      _mm512_store_ps(lr, l);
      for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t r = row0 + i, t = r / G, head = h * G + r % G;
        float* o = od + (t * Hq + head) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d * kRows + i] / lr[i];
        ld[t * Hq + head] = mr[i] + std::log(lr[i]);
      }
    }
  });
}
#endif

// (out [T, Hq, Dv] fp32, lse [T, Hq] fp32): queries q [T, Hq, D] over keys 0 .. prefix-1 of the
// page table ``pages``, all visible; lse is the natural log-sum-exp of the scaled scores.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& pages,
                                                    int64_t prefix, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_pages, page_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' last dim must be dense");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), "K and V caches differ in pages or heads");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(2) % 2 == 0, "q and K differ in head dim, or it is odd");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "q heads must be a multiple of kv heads");
  TORCH_CHECK(prefix > 0, "no cached keys");
  const int64_t S = k_cache.size(1);
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous() &&
              pages.size(0) * S >= prefix, "pages must be a contiguous int64 tensor covering the prefix");
  const int64_t* table = pages.data_ptr<int64_t>();
  for (int64_t p = 0; p < (prefix + S - 1) / S; ++p)
    TORCH_CHECK(table[p] >= 0 && table[p] < k_cache.size(0), "page id out of range");
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  run(q, k_cache, v_cache, table, prefix, static_cast<float>(scale), out, lse);
#else
  (void)scale;
  TORCH_CHECK(false, "prefix attention needs AVX512-BF16");
#endif
  return {out, lse};
}

// "avx512bf16" or "none": whether this build runs the kernel.
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512bf16";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_prefix, m) {
  m.def("prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int prefix, float scale) "
        "-> (Tensor, Tensor)");
  m.def("isa() -> str", &isa);
  m.impl("prefix_attention", c10::DispatchKey::CPU, TORCH_FN(prefix_attention));
}
