// The steps of paged attention that the decode kernel (one query row per sequence) and the span
// kernel (consecutive query rows of one sequence) share: finding a block's key and value rows in
// the page pool, one row's online softmax over a block of keys, and the merge of a row's chunks.
// A row's result depends only on the blocks it is given and their order, so both kernels give a
// row at one position the same bits as long as they cut its keys the same way: chunks of kSplit
// keys from its first visible key, each scored kBlock keys at a time.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "attention_math.h"

namespace deepinfer_attention {

constexpr int64_t kSplit = 256;  // keys per chunk: one work item, merged with the others at the end

// One kv head of the page pool ([num_pages, page_size, kv_heads, dim]) seen through one
// sequence's page table, whose first entry holds position `first`.
template <typename T>
struct PagedHead {
  const T* k;  // the caches, offset to this kv head
  const T* v;
  at::IntArrayRef ks, vs;
  const int64_t* table;
  int64_t first, S, D, Dv;

  // krow[t], vrow[t]: the key and value rows of position pos0 + t, t < n; page and slot stepped
  // key by key, since a division per key costs as much as scoring it.
  void rows(int64_t pos0, int64_t n, const T** krow, const T** vrow) const {
    for (int64_t t = 0, p = (pos0 - first) / S, off = (pos0 - first) % S; t < n; ++t, off = off + 1 == S ? (++p, 0) : off + 1) {
      const int64_t page = table[p];
      krow[t] = k + page * ks[0] + off * ks[1];
      vrow[t] = v + page * vs[0] + off * vs[1];
    }
  }

  // Asks for the K and V rows of positions [pos0, pos0 + n) ahead of use: the rows of a head are
  // short (D values) runs spread over pages, which the hardware prefetcher does not follow.
  void prefetch(int64_t pos0, int64_t n) const {
#ifdef __AVX2__
    for (int64_t t = 0, p = (pos0 - first) / S, off = (pos0 - first) % S; t < n; ++t, off = off + 1 == S ? (++p, 0) : off + 1) {
      const int64_t page = table[p];
      const char* kr = reinterpret_cast<const char*>(k + page * ks[0] + off * ks[1]);
      const char* vr = reinterpret_cast<const char*>(v + page * vs[0] + off * vs[1]);
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(kr + b, _MM_HINT_T0);
      for (int64_t b = 0; b < Dv * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(vr + b, _MM_HINT_T0);
    }
#endif
  }
  // Loads one byte of every cache line of the K and V rows of positions [begin, end), for this
  // head and the next `heads - 1` (side by side in the pool), so that they are in cache when the
  // kernel reads them. Plain independent loads: against a step's cold reads (the weights just
  // went through the caches) the prefetch instructions above gained nothing measurable on Zen 4,
  // while these stream (docs/figures/execution.md, eleventh session).
  void touch(int64_t begin, int64_t end, int64_t heads) const {
    const int64_t k_bytes = ((heads - 1) * ks[2] + D) * static_cast<int64_t>(sizeof(T));
    const int64_t v_bytes = ((heads - 1) * vs[2] + Dv) * static_cast<int64_t>(sizeof(T));
    for (int64_t pos = begin, p = (pos - first) / S, off = (pos - first) % S; pos < end;
         ++pos, off = off + 1 == S ? (++p, 0) : off + 1) {
      const volatile char* kr = reinterpret_cast<const volatile char*>(k + table[p] * ks[0] + off * ks[1]);
      const volatile char* vr = reinterpret_cast<const volatile char*>(v + table[p] * vs[0] + off * vs[1]);
      for (int64_t b = 0; b < k_bytes; b += 64) (void)kr[b];
      for (int64_t b = 0; b < v_bytes; b += 64) (void)vr[b];
    }
  }
};

// Starts a row's chunk: part[g] = (max -inf, sum 0, acc[Dv] 0) for its G heads (rows of Dv + 2
// floats), and qf = the G query vectors qh (G x D) times scale in fp32, for fp32 scoring.
template <typename T>
inline void start_row(const T* qh, int64_t G, int64_t D, int64_t Dv, float scale, float* qf, float* part) {
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qh[g * D + d]) * scale;
    float* p = part + g * (Dv + 2);
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.f;
    std::fill(p + 2, p + 2 + Dv, 0.f);
  }
}

// One block of n <= kBlock keys for the G heads of one query row (qh as given, qf from
// start_row): the keys are scored for each head (from L1), then each value vector is loaded and
// widened once and added into every head's accumulator; online softmax in fp32 (running max,
// rescaled sum and accumulator). sc (G x kBlock) and cs (G) are scratch.
template <typename T>
inline void attend_block(const T* qh, const float* qf, float scale, const T* const* krow, const T* const* vrow,
                         int64_t n, int64_t G, int64_t D, int64_t Dv, float* part, float* sc, float* cs) {
  const int64_t row = Dv + 2;
  bool scored = false;
#ifdef DEEPINFER_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {
    if (D % 32 == 0) {
      for (int64_t g = 0; g < G; ++g) dp_scores(qh + g * D, scale, krow, n, D, sc + g * kBlock);
      scored = true;
    }
  }
#endif
  if (!scored)
    for (int64_t g = 0; g < G; ++g) scores(qf + g * D, krow, n, D, sc + g * kBlock);
  for (int64_t g = 0; g < G; ++g) {  // online softmax per head; its rescale factor into cs[g]
    float* s = sc + g * kBlock;
    float* p = part + g * row;
    const float m_new = std::max(p[0], *std::max_element(s, s + n));
    cs[g] = std::exp(p[0] - m_new);  // 0 for the first block (max -inf)
    p[1] = p[1] * cs[g] + exp_sum(s, m_new, n);
    p[0] = m_new;
  }
#ifdef __AVX512F__
  if (Dv % 64 == 0) {
    head_chunks(G, [&](auto gn, int64_t g0) {
      accumulate_heads<decltype(gn)::value>(part + g0 * row + 2, row, cs + g0, sc + g0 * kBlock, vrow, n, Dv);
    });
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) accumulate(part + g * row + 2, cs[g], sc + g * kBlock, vrow, n, Dv);
}

// out[0:Dv] = one head of one row from its `count` chunk partials part, part + stride, ...
// (max, sum, acc[Dv] each), merged in chunk order; zeros if it has none (no visible key).
template <typename T>
inline void merge_chunks(const float* part, int64_t stride, int64_t count, int64_t Dv, float* acc, T* out) {
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  for (int64_t i = 0; i < count; ++i) m = std::max(m, part[i * stride]);
  std::fill(acc, acc + Dv, 0.f);
  for (int64_t i = 0; i < count; ++i) {
    const float* p = part + i * stride;
    const float c = std::exp(p[0] - m);
    l += p[1] * c;
    for (int64_t d = 0; d < Dv; ++d) acc[d] += p[2 + d] * c;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < Dv; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

// Each of `rows` rows' heads merged from their chunk partials, where chunks(r, h) = (row r's first
// partial for the first q head of kv head h, the stride between its chunks, their count, where its
// G heads' Dv outputs go); the G heads' partials follow each other (Dv + 2 floats apart).
template <typename T, typename Chunks>
void merge_rows(int64_t rows, int64_t Hkv, int64_t G, int64_t Dv, int64_t grain, Chunks&& chunks) {
  at::parallel_for(0, rows * Hkv, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(Dv);
    for (int64_t w = lo; w < hi; ++w) {
      const auto [part, stride, count, out] = chunks(w / Hkv, w % Hkv);
      for (int64_t g = 0; g < G; ++g) merge_chunks(part + g * (Dv + 2), stride, count, Dv, acc.data(), out + g * Dv);
    }
  });
}

}  // namespace deepinfer_attention
