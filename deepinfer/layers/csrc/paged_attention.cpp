// Paged decode attention on the CPU: each decoding sequence's query heads attend over its keys
// and values read in place from the page pool ([num_pages, page_size, kv_heads, dim]) through
// its page table, so no layer copies K/V into a workspace first.
//
// Work item: (sequence, kv head, chunk of kSplit keys). The q heads of one kv head (GQA) share
// each key and value load: a block's keys are scored for each of them (from L1), then each value
// vector is loaded and widened once and added into every head's accumulator (up to four heads at
// a time, whose accumulators fill the registers). Within a chunk keys are scored kBlock at a
// time, with an online softmax in fp32 (running max, rescaled sum and accumulator); chunks are merged in order by a
// second pass. The split depends only on the context length, never on the thread count, so
// results are the same on any number of threads.
//
// Keys at positions [lo, len) are visible: lo = max(kv_start, kv_lo, len - window), the
// mask the torch path builds (kv_start: position of the page table's first key, ring views).
// Caches in float32 or bfloat16 (q and output in the same dtype); K and V may be views of one
// buffer (MLA: values are the leading part of each cached key), only the last dim must be dense.
//
// AVX-512: values are widened and accumulated 16 lanes at a time (the same per-lane arithmetic as
// the 8-lane AVX2 code). With AVX512-BF16, bf16 keys are scored by `vdpbf16ps` against the bf16
// query as it is (32 exact products per instruction, fp32 sums), the scale applied to each score.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEEPINFER_DPBF16 1
#endif

namespace {

constexpr int64_t kSplit = 256;  // keys per work item
constexpr int64_t kBlock = 32;   // keys scored before one rescale
constexpr int64_t kMinParallel = 8192;  // query-key pairs of a call worth a parallel region

using bf16 = c10::BFloat16;

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (Cephes' range reduction and polynomial; relative error ~1e-7).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#ifdef DEEPINFER_DPBF16
// s[t] = scale * (q . k[t]) for t < n, D % 32 == 0: bf16 pairs dotted by `vdpbf16ps`, four keys
// at a time so their dot chains overlap.
inline void dp_scores(const bf16* q, float scale, const bf16* const* k, int64_t n, int64_t D, float* s) {
  auto at = [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = at(q + d);
      a0 = _mm512_dpbf16_ps(a0, qv, at(k[t] + d));
      a1 = _mm512_dpbf16_ps(a1, qv, at(k[t + 1] + d));
      a2 = _mm512_dpbf16_ps(a2, qv, at(k[t + 2] + d));
      a3 = _mm512_dpbf16_ps(a3, qv, at(k[t + 3] + d));
    }
    s[t] = scale * _mm512_reduce_add_ps(a0), s[t + 1] = scale * _mm512_reduce_add_ps(a1);
    s[t + 2] = scale * _mm512_reduce_add_ps(a2), s[t + 3] = scale * _mm512_reduce_add_ps(a3);
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) a = _mm512_dpbf16_ps(a, at(q + d), at(k[t] + d));
    s[t] = scale * _mm512_reduce_add_ps(a);
  }
}
#endif

// s[t] = q . k[t] for t < n; four keys at a time, so the FMAs of one key do not wait on each other
template <typename T>
inline void scores(const float* q, const T* const* k, int64_t n, int64_t D, float* s) {
  int64_t t = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; t + 4 <= n; t += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, load8(k[t] + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k[t + 1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k[t + 2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k[t + 3] + d), a3);
      }
      s[t] = hsum(a0), s[t + 1] = hsum(a1), s[t + 2] = hsum(a2), s[t + 3] = hsum(a3);
    }
    for (; t < n; ++t) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k[t] + d), a);
      s[t] = hsum(a);
    }
  }
#endif
  for (; t < n; ++t) {
    float a = 0.f;
    for (int64_t d = 0; d < D; ++d) a += q[d] * static_cast<float>(k[t][d]);
    s[t] = a;
  }
}

// acc[0:Dv] = acc * c + sum_t p[t] * v[t]: 64 dims of acc stay in registers over the block's keys
template <typename T>
inline void accumulate(float* acc, float c, const float* p, const T* const* v, int64_t n, int64_t Dv) {
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 cw = _mm512_set1_ps(c);
  for (; d + 64 <= Dv; d += 64) {
    __m512 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm512_mul_ps(cw, _mm512_loadu_ps(acc + d + 16 * i));
    for (int64_t t = 0; t < n; ++t) {
      const __m512 pv = _mm512_set1_ps(p[t]);
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(pv, load16(v[t] + d + 16 * i), a[i]);
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + d + 16 * i, a[i]);
  }
#endif
#ifdef __AVX2__
  const __m256 cv = _mm256_set1_ps(c);
  for (; d + 64 <= Dv; d += 64) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d + 8 * i));
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pv = _mm256_set1_ps(p[t]);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pv, load8(v[t] + d + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d + 8 * i, a[i]);
  }
  for (; d + 8 <= Dv; d += 8) {
    __m256 a = _mm256_mul_ps(cv, _mm256_loadu_ps(acc + d));
    for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(v[t] + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
#endif
  for (; d < Dv; ++d) {
    float a = acc[d] * c;
    for (int64_t t = 0; t < n; ++t) a += p[t] * static_cast<float>(v[t][d]);
    acc[d] = a;
  }
}

// s[0:n] = exp(s - m); returns their sum (added in a fixed order)
inline float exp_sum(float* s, float m, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return total;
}

// The heads g0 .. g0 + GN - 1 of a kv head's G, four at a time: f(GN constant, g0).
template <typename F>
inline void head_chunks(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: f(std::integral_constant<int, 4>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 1>{}, g0); break;
    }
  }
}

#ifdef __AVX512F__
// For GN heads: acc_g[0:Dv] = acc_g * c[g] + sum_t p_g[t] * v[t] (acc_g = acc + g * row,
// p_g = p + g * kBlock), Dv % 64 == 0: each value vector is loaded and widened once for all GN
// heads; per head the same arithmetic as accumulate(), so the same bits.
template <int GN, typename T>
inline void accumulate_heads(float* acc, int64_t row, const float* c, const float* p, const T* const* v, int64_t n,
                             int64_t Dv) {
  for (int64_t d = 0; d < Dv; d += 64) {
    __m512 a[GN][4];
    for (int g = 0; g < GN; ++g) {
      const __m512 cw = _mm512_set1_ps(c[g]);
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_mul_ps(cw, _mm512_loadu_ps(acc + g * row + d + 16 * i));
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[4];
      for (int i = 0; i < 4; ++i) vv[i] = load16(v[t] + d + 16 * i);
      for (int g = 0; g < GN; ++g) {
        const __m512 pv = _mm512_set1_ps(p[g * kBlock + t]);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(pv, vv[i], a[g][i]);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * row + d + 16 * i, a[g][i]);
  }
}
#endif

struct Item {
  int64_t b, begin, end;  // sequence, positions [begin, end) of its keys
};

// Asks for the K and V rows of the block from pos0 ahead of use: the rows of a head are short
// (D values) runs spread over pages, which the hardware prefetcher does not follow.
template <typename T>
inline void prefetch_block(const Item& it, int64_t pos0, int64_t first, const int64_t* table, int64_t S, const T* k,
                           const at::IntArrayRef ks, int64_t D, const T* v, const at::IntArrayRef vs, int64_t Dv) {
#ifdef __AVX2__
  const int64_t n = std::min(kBlock, it.end - pos0);
  for (int64_t t = 0, p = (pos0 - first) / S, off = (pos0 - first) % S; t < n; ++t, off = off + 1 == S ? (++p, 0) : off + 1) {
    const int64_t page = table[p];
    const char* kr = reinterpret_cast<const char*>(k + page * ks[0] + off * ks[1]);
    const char* vr = reinterpret_cast<const char*>(v + page * vs[0] + off * vs[1]);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(kr + b, _MM_HINT_T0);
    for (int64_t b = 0; b < Dv * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(vr + b, _MM_HINT_T0);
  }
#endif
}

// One item of one kv head: partial[g] = (max, sum, acc[Dv]) over its keys.
template <typename T>
void attend_chunk(const Item& it, int64_t h, const T* q, const T* k, const T* v, const int64_t* pages,
                  const int64_t* kv_start, int64_t Hq, const at::IntArrayRef ks, const at::IntArrayRef vs,
                  int64_t G, int64_t D, int64_t Dv, int64_t S, int64_t width, float scale, float* part,
                  std::vector<float>& qf, std::vector<float>& sc, std::vector<float>& cs) {
  const int64_t row = Dv + 2;
  for (int64_t g = 0; g < G; ++g) {
    const T* qs = q + (it.b * Hq + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qs[d]) * scale;
    float* p = part + g * row;
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.f;
    std::fill(p + 2, p + 2 + Dv, 0.f);
  }
  const int64_t first = kv_start ? kv_start[it.b] : 0;
  const int64_t* table = pages + it.b * width;
  const T* krow[kBlock];
  const T* vrow[kBlock];
  for (int64_t pos0 = it.begin; pos0 < it.end; pos0 += kBlock) {
    const int64_t n = std::min(kBlock, it.end - pos0);
    // page and slot stepped key by key: a division per key costs as much as scoring it
    for (int64_t t = 0, p = (pos0 - first) / S, off = (pos0 - first) % S; t < n; ++t, off = off + 1 == S ? (++p, 0) : off + 1) {
      const int64_t page = table[p];
      krow[t] = k + page * ks[0] + off * ks[1] + h * ks[2];
      vrow[t] = v + page * vs[0] + off * vs[1] + h * vs[2];
    }
    prefetch_block(it, pos0 + kBlock, first, table, S, k + h * ks[2], ks, D, v + h * vs[2], vs, Dv);
    const T* qh = q + (it.b * Hq + h * G) * D;  // the G query rows of this kv head
    bool scored = false;
#ifdef DEEPINFER_DPBF16
    if constexpr (std::is_same_v<T, bf16>) {
      if (D % 32 == 0) {
        for (int64_t g = 0; g < G; ++g) dp_scores(qh + g * D, scale, krow, n, D, sc.data() + g * kBlock);
        scored = true;
      }
    }
#endif
    if (!scored)
      for (int64_t g = 0; g < G; ++g) scores(qf.data() + g * D, krow, n, D, sc.data() + g * kBlock);
    for (int64_t g = 0; g < G; ++g) {  // online softmax per head; its rescale factor into cs[g]
      float* s = sc.data() + g * kBlock;
      float* p = part + g * row;
      const float m_new = std::max(p[0], *std::max_element(s, s + n));
      cs[g] = std::exp(p[0] - m_new);  // 0 for the first block (max -inf)
      p[1] = p[1] * cs[g] + exp_sum(s, m_new, n);
      p[0] = m_new;
    }
#ifdef __AVX512F__
    if (Dv % 64 == 0) {
      head_chunks(G, [&](auto gn, int64_t g0) {
        accumulate_heads<decltype(gn)::value>(part + g0 * row + 2, row, cs.data() + g0, sc.data() + g0 * kBlock,
                                              vrow, n, Dv);
      });
      continue;
    }
#endif
    for (int64_t g = 0; g < G; ++g) accumulate(part + g * row + 2, cs[g], sc.data() + g * kBlock, vrow, n, Dv);
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
  const auto ks = k_cache.strides(), vs = v_cache.strides();
  // Items of fewer query-key pairs than kMinParallel together run on this thread: a parallel
  // region costs more than they do (and far more when another process holds a core).
  int64_t keys = 0;
  for (const Item& it : items) keys += it.end - it.begin;
  const int64_t grain = keys * Hq >= kMinParallel ? 1 : std::max<int64_t>(1, n_items * Hkv);
  at::parallel_for(0, n_items * Hkv, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), sc(G * kBlock), cs(G);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t i = w / Hkv, h = w % Hkv;
      attend_chunk(items[i], h, qp, kp, vp, pp, kv_start, Hq, ks, vs, G, D, Dv, S, width, scale,
                   part.data() + w * G * row, qf, sc, cs);
    }
  });
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hkv, grain == 1 ? 16 : std::max<int64_t>(1, B * Hkv), [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(Dv);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t b = w / Hkv, h = w % Hkv;
      for (int64_t g = 0; g < G; ++g) {
        float m = -std::numeric_limits<float>::infinity(), l = 0.f;
        for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i) m = std::max(m, part[((i * Hkv + h) * G + g) * row]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = first_item[b]; i < first_item[b + 1]; ++i) {
          const float* p = part.data() + ((i * Hkv + h) * G + g) * row;
          const float c = std::exp(p[0] - m);
          l += p[1] * c;
          for (int64_t d = 0; d < Dv; ++d) acc[d] += p[2 + d] * c;
        }
        T* o = op + (b * Hq + h * G + g) * Dv;
        const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros
        for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& pages, const at::Tensor& kv_lens, const std::optional<at::Tensor>& kv_start,
                        const std::optional<at::Tensor>& kv_lo, std::optional<int64_t> window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, Hq, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_pages, page_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' last dim must be dense");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3), "K and V caches differ in pages or heads");
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k_cache.size(2), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and K differ in head dim");
  TORCH_CHECK(Hq % Hkv == 0, "q heads must be a multiple of kv heads");
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
  const int64_t width = pages.size(1), num_pages = k_cache.size(0);
  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = start ? start[b] : 0;
    int64_t lo = std::max(first, low ? low[b] : int64_t{0});
    if (window) lo = std::max(lo, lens[b] - *window);
    const int64_t hi = lens[b];
    if (hi > lo) {
      TORCH_CHECK(hi - first <= width * S, "row ", b, ": ", hi - first, " keys but a page table of ", width, " pages");
      for (int64_t p = (lo - first) / S; p <= (hi - 1 - first) / S; ++p)
        TORCH_CHECK(table[b * width + p] >= 0 && table[b * width + p] < num_pages, "row ", b, ": page id out of range");
    }
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
  m.def("isa() -> str", &isa);
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
