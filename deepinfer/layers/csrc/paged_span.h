// Paged attention of a span: R consecutive query rows of one sequence (a speculative verify span,
// a short prefill chunk), row r seeing the keys [lo_r, hi_r) with hi_r = hi_0 + r, each row
// computed exactly as the decode kernel computes one row at its position (paged_block.h: the
// same chunks of kSplit keys from the row's first visible key, the same kBlock blocks in the same
// order, the same online softmax and merge), so each row gets the bits a decode there gets.
//
// Only the loop order differs. Row by row, every row reads the whole context's K/V again, from
// far caches: a span of R rows cost about R decodes of attention. Here a work item is (kv head,
// chunk index) of the whole span, and inside it each block of keys, once its rows are found in
// the pages, is consumed by every row whose chunk covers it (all q heads of the GQA group) before
// the next block, so the block stays in L1 and the context is read from memory once per span.
// Rows' blocks coincide without a window; with one, lo_r moves with hi_r and row r's block is
// that of row 0 shifted by lo_r - lo_0 < R keys, so the block's rows span kBlock + R keys at most.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_block.h"

namespace deepinfer_attention {

struct SpanRow {
  int64_t lo, hi;  // visible keys [lo, hi)
  int64_t chunks() const { return hi > lo ? (hi - lo + kSplit - 1) / kSplit : 0; }
};

// Chunk c of every row: for each block index j, the union of the rows' j-th blocks is found in
// the pages once, then each row attends over its own part of it.
template <typename T>
void attend_span_chunk(const std::vector<SpanRow>& rows, int64_t c, const PagedHead<T>& kv, const T* q, int64_t Hq,
                       int64_t G, float scale, float* part, std::vector<float>& qf, std::vector<float>& sc,
                       std::vector<float>& cs, std::vector<const T*>& krow, std::vector<const T*>& vrow) {
  const int64_t R = static_cast<int64_t>(rows.size()), D = kv.D, Dv = kv.Dv, row = Dv + 2;
  std::vector<int64_t> begin(R), end(R);
  int64_t last = 0;  // where the chunk's keys end (no prefetch past it)
  for (int64_t r = 0; r < R; ++r) {
    begin[r] = rows[r].lo + c * kSplit;
    end[r] = std::min(rows[r].hi, begin[r] + kSplit);
    if (begin[r] < end[r]) {
      start_row(q + r * Hq * D, G, D, Dv, scale, qf.data() + r * G * D, part + r * G * row);
      last = std::max(last, end[r]);
    }
  }
  for (int64_t j = 0;; ++j) {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = begin[r] + j * kBlock;
      if (s < end[r]) lo = std::min(lo, s), hi = std::max(hi, std::min(end[r], s + kBlock));
    }
    if (hi <= lo) break;
    kv.rows(lo, hi - lo, krow.data(), vrow.data());
    kv.prefetch(hi, std::min(kBlock, last - hi));
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = begin[r] + j * kBlock;
      if (s >= end[r]) continue;
      attend_block(q + r * Hq * D, qf.data() + r * G * D, scale, krow.data() + (s - lo), vrow.data() + (s - lo),
                   std::min(kBlock, end[r] - s), G, D, Dv, part + r * G * row, sc.data(), cs.data());
    }
  }
}

// out [R, Hq, Dv] for the span's rows (q [R, Hq, D]) over the page table `table` whose first
// entry holds position `first`; items below min_parallel query-key pairs stay on this thread.
template <typename T>
void run_span(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
              int64_t first, const std::vector<SpanRow>& rows, float scale, int64_t min_parallel, at::Tensor& out) {
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t G = Hq / Hkv, row = Dv + 2;
  int64_t chunks = 0, keys = 0;
  for (const SpanRow& sr : rows) chunks = std::max(chunks, sr.chunks()), keys += std::max<int64_t>(0, sr.hi - sr.lo);
  // part[c][h][r][g]: one work item's rows together
  std::vector<float> part(static_cast<size_t>(chunks * Hkv * R * G * row));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  const int64_t grain = keys * Hq >= min_parallel ? 1 : std::max<int64_t>(1, chunks * Hkv);
  at::parallel_for(0, chunks * Hkv, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(R * G * D), sc(G * kBlock), cs(G);
    std::vector<const T*> krow(kBlock + R), vrow(kBlock + R);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t c = w / Hkv, h = w % Hkv;
      const PagedHead<T> kv{kp + h * ks[2], vp + h * vs[2], ks, vs, table, first, k_cache.size(1), D, Dv};
      attend_span_chunk(rows, c, kv, qp + h * G * D, Hq, G, scale, part.data() + w * R * G * row, qf, sc, cs,
                        krow, vrow);
    }
  });
  merge_rows(R, Hkv, G, Dv, grain == 1 ? 16 : std::max<int64_t>(1, R * Hkv), [&](int64_t r, int64_t h) {
    return std::make_tuple(part.data() + (h * R + r) * G * row, Hkv * R * G * row, rows[r].chunks());
  }, out.data_ptr<T>());
}

}  // namespace deepinfer_attention
