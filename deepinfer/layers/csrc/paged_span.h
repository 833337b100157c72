// Paged attention of a span: R consecutive query rows of one sequence (a speculative verify span,
// a short prefill chunk), row r seeing the keys [lo_r, hi_r) with hi_r = hi_0 + r, each row
// computed exactly as the decode kernel computes one row at its position (paged_block.h: the
// same chunks of kSplit keys from the row's first visible key, the same kBlock blocks in the same
// order, the same online softmax and merge), so each row gets the bits a decode there gets.
//
// Only the loop order differs. As R decode rows, every row finds and reads the whole context's
// K/V again. Here a work item is (kv head,
// chunk index) of the whole span (of a group of its rows where a short context has too few
// chunks for the threads), and inside it each block of keys, once its rows are found in the pages,
// is consumed by every row whose chunk covers it (all q heads of the GQA group) before the next
// block, so the block stays in L1 and the context is read from memory once per item. Each row's
// arithmetic (scores, exponentials, value FMAs) is still a decode's, and it dominates: a span
// costs nearly R decodes of attention either way (docs/figures/speculative.md).
// Rows' blocks coincide without a window; with one, lo_r moves with hi_r and row r's block is
// that of row 0 shifted by lo_r - lo_0 < R keys, so the block's rows span kBlock + R keys at most.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_block.h"

namespace deepinfer_attention {

struct SpanRow {
  int64_t lo, hi;  // visible keys [lo, hi)
  int64_t chunks() const { return hi > lo ? (hi - lo + kSplit - 1) / kSplit : 0; }
};

// A work item: chunk c of rows [r0, r1) for kv head h; cost = their query-key pairs.
struct SpanItem {
  int64_t c, h, r0, r1, cost;
};

// Chunk c of rows [r0, r1): for each block index j, the union of the rows' j-th blocks is found in
// the pages once, then each row attends over its own part of it.
template <typename T>
void attend_span_chunk(const std::vector<SpanRow>& rows, const SpanItem& it, const PagedHead<T>& kv, const T* q,
                       int64_t Hq, int64_t G, float scale, float* part, std::vector<float>& qf, std::vector<float>& sc,
                       std::vector<float>& cs, std::vector<const T*>& krow, std::vector<const T*>& vrow) {
  const int64_t R = static_cast<int64_t>(rows.size()), D = kv.D, Dv = kv.Dv, row = Dv + 2, c = it.c;
  std::vector<int64_t> begin(R), end(R);
  int64_t last = 0;  // where the chunk's keys end (no prefetch past it)
  for (int64_t r = it.r0; r < it.r1; ++r) {
    begin[r] = rows[r].lo + c * kSplit;
    end[r] = std::min(rows[r].hi, begin[r] + kSplit);
    if (begin[r] < end[r]) {
      start_row(q + r * Hq * D, G, D, Dv, scale, qf.data() + r * G * D, part + r * G * row);
      last = std::max(last, end[r]);
    }
  }
  for (int64_t j = 0;; ++j) {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t r = it.r0; r < it.r1; ++r) {
      const int64_t s = begin[r] + j * kBlock;
      if (s < end[r]) lo = std::min(lo, s), hi = std::max(hi, std::min(end[r], s + kBlock));
    }
    if (hi <= lo) break;
    kv.rows(lo, hi - lo, krow.data(), vrow.data());
    kv.prefetch(hi, std::min(kBlock, last - hi));
    for (int64_t r = it.r0; r < it.r1; ++r) {
      const int64_t s = begin[r] + j * kBlock;
      if (s >= end[r]) continue;
      attend_block(q + r * Hq * D, qf.data() + r * G * D, scale, krow.data() + (s - lo), vrow.data() + (s - lo),
                   std::min(kBlock, end[r] - s), G, D, Dv, part + r * G * row, sc.data(), cs.data());
    }
  }
}

// The work items, longest first: (chunk, kv head) pairs, their rows split into groups only where
// there are too few pairs to keep `threads` busy (a short context has one or two chunks per head,
// the last one short: whole-span items left one thread idle while the other ran the long ones).
inline std::vector<SpanItem> span_items(const std::vector<SpanRow>& rows, int64_t chunks, int64_t Hkv,
                                        int64_t threads) {
  const int64_t R = static_cast<int64_t>(rows.size()), pairs = chunks * Hkv;
  const int64_t groups = std::clamp<int64_t>((4 * threads + pairs - 1) / std::max<int64_t>(pairs, 1), 1, R);
  std::vector<SpanItem> items;
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < groups; ++g) {
        SpanItem it{c, h, g * R / groups, (g + 1) * R / groups, 0};
        for (int64_t r = it.r0; r < it.r1; ++r)
          it.cost += std::clamp<int64_t>(rows[r].hi - rows[r].lo - c * kSplit, 0, kSplit);
        if (it.cost > 0) items.push_back(it);
      }
  std::stable_sort(items.begin(), items.end(), [](const SpanItem& a, const SpanItem& b) { return a.cost > b.cost; });
  return items;
}

// out [R, Hq, Dv] for the span's rows (q [R, Hq, D]) over the page table `table` whose first
// entry holds position `first`. Threads take the items longest first from a shared counter, so
// unequal items and a thread that another process holds up still balance; a span of fewer than
// min_parallel query-key pairs stays on this thread. Each item writes only its own partials, so
// the result does not depend on which thread ran what.
template <typename T>
void run_span(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
              int64_t first, const std::vector<SpanRow>& rows, float scale, int64_t min_parallel, at::Tensor& out) {
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t G = Hq / Hkv, row = Dv + 2;
  int64_t chunks = 0, keys = 0;
  for (const SpanRow& sr : rows) chunks = std::max(chunks, sr.chunks()), keys += std::max<int64_t>(0, sr.hi - sr.lo);
  const bool parallel = keys * Hq >= min_parallel;
  const int64_t threads = parallel ? at::get_num_threads() : 1;
  const std::vector<SpanItem> items = span_items(rows, chunks, Hkv, threads);
  const int64_t n_items = static_cast<int64_t>(items.size());
  // part[c][h][r][g]: a (chunk, kv head) pair's rows together
  std::vector<float> part(static_cast<size_t>(chunks * Hkv * R * G * row));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_items), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(R * G * D), sc(G * kBlock), cs(G);
    std::vector<const T*> krow(kBlock + R), vrow(kBlock + R);
    for (int64_t i = next++; i < n_items; i = next++) {
      const SpanItem& it = items[i];
      const PagedHead<T> kv{kp + it.h * ks[2], vp + it.h * vs[2], ks, vs, table, first, k_cache.size(1), D, Dv};
      attend_span_chunk(rows, it, kv, qp + it.h * G * D, Hq, G, scale,
                        part.data() + (it.c * Hkv + it.h) * R * G * row, qf, sc, cs, krow, vrow);
    }
  });
  T* op = out.data_ptr<T>();
  merge_rows<T>(R, Hkv, G, Dv, parallel ? 16 : std::max<int64_t>(1, R * Hkv), [&](int64_t r, int64_t h) {
    return std::make_tuple(part.data() + (h * R + r) * G * row, Hkv * R * G * row, rows[r].chunks(),
                           op + (r * Hkv + h) * G * Dv);
  });
}

}  // namespace deepinfer_attention
