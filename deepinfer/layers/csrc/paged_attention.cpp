// Paged decode attention on the CPU: each decoding sequence's query heads attend over its keys
// and values read in place from the page pool ([num_pages, page_size, kv_heads, dim]) through
// its page table, so no layer copies K/V into a workspace first.
//
// Work item: (sequence, kv head, chunk of kSplit keys). The q heads of one kv head (GQA) share
// each key and value load (paged_block.h: a block's keys scored for each head from L1, each value
// vector widened once for every head). Within a chunk keys are scored kBlock at a time, with an
// online softmax in fp32 (running max, rescaled sum and accumulator); a row's chunks are merged in
// order by a second pass (a row of one chunk is finished by its item, with the same arithmetic).
// The split depends only on the context length, never on the thread count, so results are the
// same on any number of threads.
//
// Keys at positions [lo, len) are visible: lo = max(kv_start, kv_lo, len - window), the
// mask the torch path builds (kv_start: position of the page table's first key, ring views).
// Caches in float32 or bfloat16 (q and output in the same dtype); K and V may be views of one
// buffer (MLA: values are the leading part of each cached key), only the last dim must be dense.
// The vector code (scalar, AVX2, AVX-512, AVX512-BF16) is in attention_math.h.
//
// paged_span: the rows of one sequence's short chunk (a speculative verify span), each row with
// a decode's bits, the context read once for all of them (paged_span.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "paged_block.h"
#include "paged_span.h"

namespace {

using namespace deepinfer_attention;

constexpr int64_t kMinParallel = 8192;  // query-key pairs of a call worth a parallel region

struct Item {
  int64_t b, begin, end;  // sequence, positions [begin, end) of its keys
};

// One item of one kv head: partial[g] = (max, sum, acc[Dv]) over its keys.
template <typename T>
void attend_chunk(const Item& it, const PagedHead<T>& kv, const T* qh, int64_t G, float scale, float* part,
                  std::vector<float>& qf, std::vector<float>& sc, std::vector<float>& cs) {
  start_row(qh, G, kv.D, kv.Dv, scale, qf.data(), part);
  const T* krow[kBlock];
  const T* vrow[kBlock];
  for (int64_t pos0 = it.begin; pos0 < it.end; pos0 += kBlock) {
    const int64_t n = std::min(kBlock, it.end - pos0);
    kv.rows(pos0, n, krow, vrow);
    kv.prefetch(pos0 + kBlock, std::min(kBlock, it.end - pos0 - kBlock));
    attend_block(qh, qf.data(), scale, krow, vrow, n, G, kv.D, kv.Dv, part, sc.data(), cs.data());
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& pages,
         const std::vector<Item>& items, const std::vector<int64_t>& first_item, const int64_t* kv_start,
         float scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t G = Hq / Hkv, S = k_cache.size(1), width = pages.size(1), row = Dv + 2;
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::vector<float> part(static_cast<size_t>(n_items * Hkv * G * row));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* pp = pages.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  // Items of fewer query-key pairs than kMinParallel together run on this thread: a parallel
  // region costs more than they do (and far more when another process holds a core).
  int64_t keys = 0;
  for (const Item& it : items) keys += it.end - it.begin;
  const int64_t grain = keys * Hq >= kMinParallel ? 1 : std::max<int64_t>(1, n_items * Hkv);
  at::parallel_for(0, n_items * Hkv, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), sc(G * kBlock), cs(G), acc(Dv);
    // Item i's K/V rows of all heads, loaded into cache while the item before it runs (the first
    // one up front): after the layer's weights went through the caches, an item's own loads, a
    // few in flight at a time, waited on memory.
    auto touch = [&](int64_t i) {
      const Item& it = items[i];
      PagedHead<T>{kp, vp, ks, vs, pp + it.b * width, kv_start ? kv_start[it.b] : 0, S, D, Dv}.touch(it.begin,
                                                                                                    it.end, Hkv);
    };
    if (lo < hi) touch(lo / Hkv);
    for (int64_t w = lo; w < hi; ++w) {
      const Item& it = items[w / Hkv];
      const int64_t h = w % Hkv;
      if ((h == 0 || w == lo) && (w / Hkv + 1) * Hkv < hi) touch(w / Hkv + 1);
      const PagedHead<T> kv{kp + h * ks[2], vp + h * vs[2], ks, vs, pp + it.b * width,
                            kv_start ? kv_start[it.b] : 0, S, D, Dv};
      float* pw = part.data() + w * G * row;
      attend_chunk(it, kv, qp + (it.b * Hq + h * G) * D, G, scale, pw, qf, sc, cs);
      if (first_item[it.b + 1] - first_item[it.b] == 1)  // its only chunk: its output, as the merge gives it
        for (int64_t g = 0; g < G; ++g) merge_chunks(pw + g * row, 0, 1, Dv, acc.data(), op + ((it.b * Hkv + h) * G + g) * Dv);
    }
  });
  // The rows of several chunks (or none: zeros) are merged in a second pass; a row of one chunk
  // was written above, which saves short contexts a parallel region per layer.
  std::vector<int64_t> merged;
  for (int64_t b = 0; b < B; ++b)
    if (first_item[b + 1] - first_item[b] != 1) merged.push_back(b);
  if (merged.empty()) return;
  const int64_t n = static_cast<int64_t>(merged.size());
  merge_rows<T>(n, Hkv, G, Dv, grain == 1 ? 16 : std::max<int64_t>(1, n * Hkv), [&](int64_t r, int64_t h) {
    const int64_t b = merged[r];
    return std::make_tuple(part.data() + (first_item[b] * Hkv + h) * G * row, Hkv * G * row,
                           first_item[b + 1] - first_item[b], op + (b * Hkv + h) * G * Dv);
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [rows, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_pages, page_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' last dim must be dense");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), "K and V caches differ in pages or heads");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and K differ in head dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "q heads must be a multiple of kv heads");
}

// The first key a row ending at position hi - 1 sees (the torch path's mask).
int64_t visible_from(int64_t first, int64_t low, int64_t hi, std::optional<int64_t> window) {
  const int64_t lo = std::max(first, low);
  return window ? std::max(lo, hi - *window) : lo;
}

// Row b's keys [lo, hi) lie in its page table (width entries, the first at position `first`).
void check_table(const int64_t* table, int64_t width, int64_t first, int64_t lo, int64_t hi, int64_t S,
                 int64_t num_pages, int64_t b) {
  if (hi <= lo) return;
  TORCH_CHECK(hi - first <= width * S, "row ", b, ": ", hi - first, " keys but a page table of ", width, " pages");
  for (int64_t p = (lo - first) / S; p <= (hi - 1 - first) / S; ++p)
    TORCH_CHECK(table[p] >= 0 && table[p] < num_pages, "row ", b, ": page id out of range");
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& pages, const at::Tensor& kv_lens, const std::optional<at::Tensor>& kv_start,
                        const std::optional<at::Tensor>& kv_lo, std::optional<int64_t> window, double scale) {
  check_inputs(q, k_cache, v_cache);
  const int64_t B = q.size(0), Hq = q.size(1), S = k_cache.size(1);
  TORCH_CHECK(pages.dim() == 2 && pages.size(0) == B && pages.scalar_type() == at::kLong && pages.is_contiguous(),
              "pages must be a contiguous int64 [B, max_pages] tensor");
  auto check_row = [B](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == at::kLong && t.is_contiguous(), what,
                " must be a contiguous int64 [B] tensor");
    return t.data_ptr<int64_t>();
  };
  const int64_t* lens = check_row(kv_lens, "kv_lens");
  const int64_t* start = kv_start ? check_row(*kv_start, "kv_start") : nullptr;
  const int64_t* low = kv_lo ? check_row(*kv_lo, "kv_lo") : nullptr;
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t width = pages.size(1);
  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = start ? start[b] : 0, hi = lens[b];
    const int64_t lo = visible_from(first, low ? low[b] : 0, hi, window);
    check_table(table + b * width, width, first, lo, hi, S, k_cache.size(0), b);
    for (int64_t begin = lo; begin < hi; begin += kSplit) items.push_back({b, begin, std::min(hi, begin + kSplit)});
    first_item[b + 1] = static_cast<int64_t>(items.size());
  }
  at::Tensor out = at::empty({B, Hq, v_cache.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    run<float>(q, k_cache, v_cache, pages, items, first_item, start, static_cast<float>(scale), out);
  else
    run<bf16>(q, k_cache, v_cache, pages, items, first_item, start, static_cast<float>(scale), out);
  return out;
}

// The R rows of q [R, Hq, D] are one sequence's consecutive positions kv_len - R .. kv_len - 1,
// row r seeing what a decode at its position sees (paged_span.h): keys up to its own, from
// max(kv_start, kv_lo, its length - window), through the one page table `pages` [max_pages].
at::Tensor paged_span(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& pages, int64_t kv_len, int64_t kv_start, int64_t kv_lo,
                      std::optional<int64_t> window, double scale) {
  check_inputs(q, k_cache, v_cache);
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous(),
              "pages must be a contiguous int64 [max_pages] tensor");
  const int64_t R = q.size(0);
  TORCH_CHECK(kv_len >= R, "a span of ", R, " rows needs kv_len >= ", R, ", got ", kv_len);
  const int64_t* table = pages.data_ptr<int64_t>();
  std::vector<SpanRow> rows(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t hi = kv_len - R + 1 + r;
    rows[r] = {visible_from(kv_start, kv_lo, hi, window), hi};
    check_table(table, pages.size(0), kv_start, rows[r].lo, hi, k_cache.size(1), k_cache.size(0), r);
  }
  at::Tensor out = at::empty({R, q.size(1), v_cache.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    run_span<float>(q, k_cache, v_cache, table, kv_start, rows, static_cast<float>(scale), kMinParallel, out);
  else
    run_span<bf16>(q, k_cache, v_cache, table, kv_start, rows, static_cast<float>(scale), kMinParallel, out);
  return out;
}

// "avx512_bf16", "avx512", "avx2" or "scalar": which code this build holds.
std::string isa() {
#if defined(DEEPINFER_DPBF16)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_attention, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, Tensor kv_lens, Tensor? kv_start, "
        "Tensor? kv_lo, int? window, float scale) -> Tensor");
  m.def("paged_span(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int kv_len, int kv_start, int kv_lo, "
        "int? window, float scale) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.impl("paged_span", c10::DispatchKey::CPU, TORCH_FN(paged_span));
}
