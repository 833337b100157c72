// Attention of one prefill chunk on the CPU, read in place from the page pool
// ([num_pages, page_size, kv_heads, dim]) through the sequence's page table: query t (at position
// start + t) sees keys 0 .. start + t, i.e. every cached key before the chunk (the tail of a
// prefix-cache hit, a later chunk of a chunked prefill) and causally the chunk's own keys, which
// the caller has already stored. One call, no mask tensor, no log-sum-exp merge.
//
// Work item: (kv head, block of 16 query rows), rows being (token, q head of the group): all 16
// rows share each key and value load (GQA). Vectorized over the rows, so the online softmax
// (running max, rescaled sum) needs no horizontal reductions: a tile is 16 rows by 16 keys.
// Scores are fp32 sums of exact bf16 products (AVX512-BF16 dot pairs); the probabilities are
// rounded to bf16, as torch's flash kernel does for bf16, so that P.V runs on dot pairs too, over
// values packed once per call into key pairs ([tile][key pair][Dv][2]). Only tiles that cross a
// row's causal limit are masked. Rows are independent and each is computed the same way whatever
// thread runs it, so the result does not depend on the thread count; items are dealt round-robin
// longest first, so the causal blocks' unequal lengths balance across threads.
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
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int64_t kRows = 16;  // query rows per work item: one vector lane each
constexpr int64_t kKeys = 16;  // keys per tile
constexpr int64_t kCols = 8;   // value columns accumulated in registers at a time
constexpr int64_t kGroup = 16;   // blocks of one kv head that walk the keys together
constexpr int64_t kChunk = 512;  // keys (a multiple of kKeys) every block of a group reads in turn

// 2^x as 2^n * 2^f, f in [-0.5, 0.5] by a degree-4 polynomial (relative error < 1e-5, far below
// the bf16 rounding of the probabilities; the FMAs share their pipes with the dot pairs);
// inputs below -126 give ~0.
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.2549599e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5856049e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4031252e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9313061e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999780e-1f));
  return _mm512_scalef_ps(p, n);
}

// Keys 0 .. kv_len-1 of kv head h: the row of key ``pos`` in the page pool.
struct Pages {
  const bf16* base;
  const int64_t* table;
  int64_t page_size, s0, s1, s2;
  const bf16* row(int64_t pos, int64_t h) const {
    return base + table[pos / page_size] * s0 + (pos % page_size) * s1 + h * s2;
  }
};

// The key rows of one tile of one kv head (keys at or past kv_len: the tile's first, masked by the
// caller), looked up once per call rather than per tile and block: a division per key.
void tile_key_rows(const Pages& k, int64_t h, int64_t j0, int64_t kv_len, const bf16** out) {
  for (int64_t j = 0; j < kKeys; ++j) out[j] = k.row(j0 + j < kv_len ? j0 + j : j0, h);
}

// Values of one tile of one kv head as [kKeys / 2][Dv][2]: the pairs the dot-pair instruction
// multiplies with a pair of probabilities. Keys at or past kv_len are zeros.
void pack_values(const Pages& v, int64_t h, int64_t j0, int64_t kv_len, int64_t Dv, bf16* out) {
  for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
    const int64_t a = j0 + 2 * jp, b = a + 1;
    const bf16* ra = a < kv_len ? v.row(a, h) : nullptr;
    const bf16* rb = b < kv_len ? v.row(b, h) : nullptr;
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + jp * Dv * 2);
    for (int64_t d = 0; d < Dv; d += 16) {
      const __m512i lo = ra ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + d)))
                            : _mm512_setzero_si512();
      const __m512i hi = rb ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + d)))
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Queries of one work item, laid out for the score loop as [D/2][16 rows][2]. Missing rows are
// zeros.
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
// registers; keys a row does not see are masked by the caller).
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

// acc[d] = acc[d] * alpha + sum_j p[j] v[j][d] over the tile, p as bf16 key pairs (no rescale
// where no row's running max moved: alpha is 1 there, the common case deep into the keys).
inline void tile_values(const __m512* p, __m512 alpha, bool rescale, const bf16* vp, int64_t Dv, float* acc) {
  // pair lanes: element 2i is row i of the even key, 2i+1 of the odd key
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512bh pp[kKeys / 2];
#pragma GCC unroll 8
  for (int64_t jp = 0; jp < kKeys / 2; ++jp)
    pp[jp] = (__m512bh)_mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(p[2 * jp + 1], p[2 * jp]));
  const int32_t* vpair = reinterpret_cast<const int32_t*>(vp);
  for (int64_t d = 0; d < Dv; d += kCols) {
    __m512 o[kCols];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kCols; ++c) {
      o[c] = _mm512_loadu_ps(acc + (d + c) * kRows);
      if (rescale) o[c] = _mm512_mul_ps(o[c], alpha);
    }
#pragma GCC unroll 8
    for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < kCols; ++c)
        o[c] = _mm512_dpbf16_ps(o[c], pp[jp], (__m512bh)_mm512_set1_epi32(vpair[jp * Dv + d + c]));
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < kCols; ++c) _mm512_storeu_ps(acc + (d + c) * kRows, o[c]);
  }
}

// One block of 16 query rows of one kv head, between key tiles: its packed queries, running
// max and sum (base 2), accumulator, causal limits.
struct Block {
  int64_t h, row0, n_rows, keys, unmasked;  // keys: tiles end before it; unmasked: no tile masked
  __m512 m, l;
  __m512i lim;  // per row: the last key it sees
  bf16* qp;     // [D/2][16][2]
  float* acc;   // [Dv][16]
};

// The block's online softmax over the key tiles starting in [j0, j1).
void block_tiles(Block& b, int64_t j0, int64_t j1, const bf16* const* krows, const bf16* vpack, int64_t tiles,
                 int64_t D, int64_t Dv, float sl2) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = b.m, l = b.l;
  for (; j0 < j1; j0 += kKeys) {
    __m512 s[kKeys];
    tile_scores(b.qp, krows + b.h * tiles * kKeys + j0, D, s);
    __mmask16 vis[kKeys];
    const bool masked = j0 + kKeys > b.unmasked;
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j)
      vis[j] = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j0 + j)), b.lim)
                      : static_cast<__mmask16>(0xFFFF);
    __m512 bm = m;
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j) {
      s[j] = _mm512_mask_mul_ps(ninf, vis[j], s[j], _mm512_set1_ps(sl2));
      bm = _mm512_max_ps(bm, s[j]);
    }
    // key 0 is visible to every row, so bm is finite from the first tile on; alpha ~0 there
    const bool rescale = _mm512_cmp_ps_mask(bm, m, _CMP_NEQ_OQ) != 0 || j0 == 0;
    const __m512 alpha = exp2_16(_mm512_sub_ps(m, bm));
    m = bm;
    l = _mm512_mul_ps(l, alpha);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j) {
      s[j] = _mm512_maskz_mov_ps(vis[j], exp2_16(_mm512_sub_ps(s[j], m)));
      l = _mm512_add_ps(l, s[j]);
    }
    tile_values(s, alpha, rescale, vpack + (b.h * tiles + j0 / kKeys) * kKeys * Dv, Dv, b.acc);
  }
  b.m = m;
  b.l = l;
}

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
         int64_t start, float scale, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), S = k_cache.size(1);
  const int64_t Dv = v_cache.size(3), G = Hq / Hkv, rows = T * G, blocks = (rows + kRows - 1) / kRows;
  const int64_t kv_len = start + T, tiles = (kv_len + kKeys - 1) / kKeys, tile_elems = kKeys * Dv;
  const Pages kp{k_cache.data_ptr<bf16>(), table, S, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const Pages vpg{v_cache.data_ptr<bf16>(), table, S, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const bf16* qd = q.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  // Left uninitialized (the loop below writes every element): a zero-filled vector cost a serial
  // pass over the whole context's values per call, which a short tail after a long cached prefix
  // pays in full.
  const at::Tensor vbuf = at::empty({Hkv * tiles * tile_elems}, q.options());
  bf16* const vpack = vbuf.data_ptr<bf16>();
  const std::unique_ptr<const bf16*[]> krows(new const bf16*[Hkv * tiles * kKeys]);  // [kv head][tile][key]
  at::parallel_for(0, Hkv * tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      tile_key_rows(kp, it / tiles, (it % tiles) * kKeys, kv_len, krows.get() + it * kKeys);
      pack_values(vpg, it / tiles, (it % tiles) * kKeys, kv_len, Dv, vpack + it * tile_elems);
    }
  });
  const float sl2 = scale * 1.44269504088896341f;  // scores in base 2: e^(s scale) = 2^(s sl2)
  const int64_t items = Hkv * blocks, nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nt, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<bf16> qbuf(kGroup * D * kRows);
    std::vector<float> abuf(kGroup * Dv * kRows);
    Block group[kGroup];
    for (int64_t tid = t_begin; tid < t_end; ++tid)
      for (int64_t h = 0; h < Hkv; ++h) {
        // this thread's blocks of head h: every nt-th item, longest (last rows) first
        std::vector<int64_t> mine;
        for (int64_t it = tid; it < items; it += nt)
          if (it % Hkv == h) mine.push_back(blocks - 1 - it / Hkv);
        for (size_t g0 = 0; g0 < mine.size(); g0 += kGroup) {
          const int64_t n = std::min<int64_t>(kGroup, mine.size() - g0);
          int64_t keys = 0;
          for (int64_t i = 0; i < n; ++i) {
            Block& b = group[i];
            b.h = h;
            b.row0 = mine[g0 + i] * kRows;
            b.n_rows = std::min(kRows, rows - b.row0);
            const int64_t t_first = b.row0 / G, t_last = (b.row0 + b.n_rows - 1) / G;
            alignas(64) int32_t lim[kRows];
            for (int64_t r = 0; r < kRows; ++r)
              lim[r] = static_cast<int32_t>(start + (r < b.n_rows ? (b.row0 + r) / G : t_last));
            b.lim = _mm512_load_si512(lim);
            b.keys = start + t_last + 1;
            b.unmasked = start + t_first + 1;
            b.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
            b.l = _mm512_setzero_ps();
            b.qp = qbuf.data() + i * D * kRows;
            b.acc = abuf.data() + i * Dv * kRows;
            pack_queries(qd, b.row0, b.n_rows, G, h, Hq, D, b.qp);
            std::fill(b.acc, b.acc + Dv * kRows, 0.f);
            keys = std::max(keys, b.keys);
          }
          // key chunks outer: a chunk's keys and values stay in cache for every block of the group
          for (int64_t c0 = 0; c0 < keys; c0 += kChunk)
            for (int64_t i = 0; i < n; ++i)
              block_tiles(group[i], c0, std::min(c0 + kChunk, group[i].keys), krows.get(), vpack, tiles, D, Dv,
                          sl2);
          for (int64_t i = 0; i < n; ++i) {
            const Block& b = group[i];
            alignas(64) float lr[kRows];
            _mm512_store_ps(lr, b.l);
            for (int64_t r = 0; r < b.n_rows; ++r) {
              const int64_t row = b.row0 + r;
              bf16* o = od + ((row / G) * Hq + h * G + row % G) * Dv;
              const float inv = 1.f / lr[r];
              for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<bf16>(b.acc[d * kRows + r] * inv);
            }
          }
        }
      }
  });
}
#endif

// out [T, Hq, Dv] bfloat16: queries q [T, Hq, D] at positions start .. start+T-1 over keys
// 0 .. start+T-1 of the page table ``pages`` (the chunk's own keys already stored), causally.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& pages, int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(0) > 0, "q must be a contiguous [T, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_pages, page_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' last dim must be dense");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), "K and V caches differ in pages or heads");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(2) % 2 == 0, "q and K differ in head dim, or it is odd");
  TORCH_CHECK(v_cache.size(3) % 16 == 0, "the value head dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "q heads must be a multiple of kv heads");
  TORCH_CHECK(start >= 0, "negative start");
  const int64_t S = k_cache.size(1), kv_len = start + q.size(0);
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous() &&
              pages.size(0) * S >= kv_len, "pages must be a contiguous int64 tensor covering every key");
  const int64_t* table = pages.data_ptr<int64_t>();
  for (int64_t p = 0; p < (kv_len + S - 1) / S; ++p)
    TORCH_CHECK(table[p] >= 0 && table[p] < k_cache.size(0), "page id out of range");
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  run(q, k_cache, v_cache, table, start, static_cast<float>(scale), out);
#else
  (void)scale;
  TORCH_CHECK(false, "prefill attention needs AVX512-BF16");
#endif
  return out;
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

TORCH_LIBRARY(deepinfer_prefill, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor pages, int start, float scale) -> Tensor");
  m.def("isa() -> str", &isa);
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
