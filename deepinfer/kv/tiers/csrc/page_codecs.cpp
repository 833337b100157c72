// Lossy KV page codecs on CPU pages, bit-identical to the torch ones (codecs.py, minifloat.py).
// Decode writes n pages' bytes (staging rows, page_bytes.py's layout) straight into each owned
// buffer of the L1 pool: float32 table value times float32 scale, clamped to the dtype's finite
// range, rounded to nearest even, with the caller's tables (page_blocks.h: AVX-512, AVX2 or
// scalar, without a table gather where the table allows). Encode (fp8, fp4, mxfp4) repeats the
// torch encode's float32 steps in its order, without its dozen temporaries per page. One call
// runs on its caller's thread: the loader's readers and the tier writers each run their own
// pages (an intra-op thread team per caller would oversubscribe the cores they share).

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "page_blocks.h"

namespace {

using namespace page_values;

enum CodecId : int64_t { kFP8 = 0, kFP8C = 1, kFP4 = 2, kMXFP4 = 3 };

struct Layout {  // one buffer's page row: what it holds and where
  int64_t codec, m, block, tokens, esz;
  int64_t nbytes() const {
    const int64_t nb = m / block;
    switch (codec) {
      case kFP8: return m + nb * 4;
      case kFP8C: return m + nb * 4 + (m / tokens) * (2 + esz) + 2;
      case kFP4: return 4 + m / 2 + nb;
      default: return m / 2 + nb;  // kMXFP4
    }
  }
};

// f(values) with a float32 / bfloat16 / float16 buffer's data pointer (the dtypes checked before)
template <typename F>
void on_values(const at::Tensor& b, const F& f) {
  switch (b.scalar_type()) {
    case at::kFloat: f(b.data_ptr<float>()); break;
    case at::kBFloat16: f(b.data_ptr<c10::BFloat16>()); break;
    default: f(b.data_ptr<c10::Half>()); break;
  }
}

// One page row of one buffer into o (m elements of T).
// E4M3: E4M3Values or TableValues (the e4m3 codes' values, equal either way: e4m3_from_bits).
template <typename T, typename E4M3>
void decode_row(const Layout& L, const uint8_t* row, const E4M3& e4m3, const E2M1Values& e2m1, T* o,
                std::vector<float>& tmp) {
  const int64_t m = L.m, nb = m / L.block;
  if (L.codec == kFP8) {
    block_values<ByteCodes>(row, m, L.block, row + m, e4m3, o);
    return;
  }
  if (L.codec == kFP4 || L.codec == kMXFP4) {
    tmp.resize(nb);
    const uint8_t* packed = row + (L.codec == kFP4 ? 4 : 0);
    const uint8_t* sb = packed + m / 2;
    if (L.codec == kFP4) {
      scaled_values(sb, nb, load_f32(row), e4m3, tmp.data());
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        tmp[b] = from_bits(sb[b] == 0 ? 0x00400000u : static_cast<uint32_t>(sb[b]) << 23);  // 0: 2**-127
      }
    }
    block_values<NibbleCodes>(packed, m, L.block, reinterpret_cast<const uint8_t*>(tmp.data()), e2m1, o);
    return;
  }
  // kFP8C: float32 deviations (clamped to float32's range) + the bfloat16 mean, then the exact token
  const int64_t C = m / L.tokens;
  tmp.resize(m);
  block_values<ByteCodes>(row, m, L.block, row + m, e4m3, tmp.data());
  const uint8_t* mean = row + m + nb * 4;
  const uint8_t* exact = mean + 2 * C;
  uint16_t idx;
  std::memcpy(&idx, exact + C * L.esz, 2);
  TORCH_CHECK(idx < L.tokens, "fp8c: exact token ", idx, " beyond the page's ", L.tokens, " tokens");
  for (int64_t c = 0; c < C; ++c) {
    uint16_t h;
    std::memcpy(&h, mean + 2 * c, 2);
    const float mf = from_bits(static_cast<uint32_t>(h) << 16);
    for (int64_t t = 0; t < L.tokens; ++t) Out<T>::put(o + t * C + c, tmp[t * C + c] + mf);
  }
  std::memcpy(o + idx * C, exact, C * L.esz);
}

// rows [n, W] uint8 (each the concatenated rows of the buffers), pages [n] int64: write page i's
// values into buffers[j][pages[i]] for every j.
void decode_into(const at::Tensor& rows, const at::Tensor& pages, at::TensorList buffers, int64_t codec,
                 int64_t block, int64_t tokens, const at::Tensor& e4m3, const at::Tensor& e2m1) {
  TORCH_CHECK(codec >= kFP8 && codec <= kMXFP4, "unknown codec id ", codec);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() && rows.is_cpu(),
              "rows must be contiguous CPU uint8 [n, page_nbytes]");
  TORCH_CHECK(pages.dim() == 1 && pages.scalar_type() == at::kLong && pages.is_contiguous()
              && pages.size(0) == rows.size(0), "pages must be a contiguous int64 [n] tensor");
  TORCH_CHECK(e4m3.numel() == 256 && e2m1.numel() == 16 && e4m3.scalar_type() == at::kFloat
              && e2m1.scalar_type() == at::kFloat && e4m3.is_contiguous() && e2m1.is_contiguous(),
              "tables must be float32 [256] (e4m3) and [16] (e2m1)");
  TORCH_CHECK(block > 0 && (codec == kFP8 || codec == kFP8C || block % 2 == 0), "bad block size ", block);
  const int64_t n = rows.size(0), nbuf = static_cast<int64_t>(buffers.size());
  std::vector<Layout> layouts;
  std::vector<int64_t> offsets;
  int64_t width = 0;
  for (const at::Tensor& b : buffers) {
    const auto st = b.scalar_type();
    TORCH_CHECK(b.is_cpu() && b.is_contiguous() && b.dim() >= 2
                && (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf),
                "buffers must be contiguous CPU float32/bfloat16/float16 [pages, ...]");
    const int64_t m = b.size(0) ? b.numel() / b.size(0) : 0;  // one page's elements
    const Layout L{codec, m, block, tokens, static_cast<int64_t>(b.element_size())};
    TORCH_CHECK(L.m % block == 0 && (codec != kFP8C || (tokens > 0 && L.m % tokens == 0)),
                "a page of ", L.m, " elements does not fit block ", block, " / tokens ", tokens);
    offsets.push_back(width);
    width += L.nbytes();
    layouts.push_back(L);
  }
  TORCH_CHECK(rows.size(1) == width, "page rows of ", rows.size(1), " bytes, the layout needs ", width);
  const int64_t* pg = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    for (const at::Tensor& b : buffers)
      TORCH_CHECK(pg[i] >= 0 && pg[i] < b.size(0), "page ", pg[i], " beyond the pool");
  const uint8_t* base = rows.data_ptr<uint8_t>();
  const float* t8 = e4m3.data_ptr<float>();
  const float* t4 = e2m1.data_ptr<float>();
  const E2M1Values e2m1v(t4);
  const auto run = [&](const auto& e4m3v) {
    std::vector<float> tmp;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < nbuf; ++j) {
        const Layout& L = layouts[j];
        const uint8_t* row = base + i * width + offsets[j];
        on_values(buffers[j], [&](auto* v) { decode_row(L, row, e4m3v, e2m1v, v + pg[i] * L.m, tmp); });
      }
    }
  };
  if (e4m3_from_bits(t8)) {
    run(E4M3Values{t8});
  } else {
    run(TableValues{t8});
  }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  _mm_sfence();  // the streaming stores (page_blocks.h) visible before the caller says the pages are in
#endif
}

// -- encode: the torch encode's arithmetic (codecs.py), op for op in float32, so the bytes match
// float32 of 8 stored values (exact for every dtype)
#ifdef __AVX2__
__m256 load8(const float* x) { return _mm256_loadu_ps(x); }
__m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__m256 load8(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
#endif

// abs max of one block; a NaN / Inf value raises (the torch encode refuses to persist such pages)
template <typename T>
float block_amax(const T* x, int64_t block) {
  float amax = 0.0f;
  bool finite = true;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(FLT_MAX);
  __m256 vmax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (; i + 8 <= block; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, load8(x + i));
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, top, _CMP_LE_OQ));
    vmax = _mm256_max_ps(vmax, a);
  }
  finite = _mm256_movemask_ps(ok) == 0xFF;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) amax = v > amax ? v : amax;  // max is exact in any order
#endif
  for (; i < block; ++i) {
    const float a = std::fabs(static_cast<float>(x[i]));
    finite &= a <= FLT_MAX;
    amax = a > amax ? a : amax;
  }
  TORCH_CHECK_VALUE(finite, "cannot encode a KV page with NaN or Inf values");
  return amax;
}

float nonzero_or_one(float s) { return s > 0.0f ? s : 1.0f; }
// e4m3 code of v clamped to +-448 (torch's float -> float8_e4m3fn conversion: nearest even)
uint8_t e4m3_code(float v) { return c10::Float8_e4m3fn(clamp_to(v, 448.0f)).x; }

// e2m1 code of v, nearest even grid point saturating at +-6 (minifloat.E2M1.encode): the count
// of grid midpoints below |v|, plus one on the ties whose count is odd, plus 8 for the sign bit
constexpr float kE2M1Mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
uint8_t e2m1_code(float v) {
  const float a = std::fmin(std::fabs(v), 6.0f);
  int idx = a == 0.75f || a == 1.75f || a == 3.5f;
  for (float mid : kE2M1Mids) idx += mid < a;
  return static_cast<uint8_t>(idx | (std::signbit(v) ? 8 : 0));
}

#ifdef __AVX2__
// e4m3_code of 8 finite values, as int32 lanes: c10's bit steps (fp8e4m3fn_from_fp32_value)
__m256i e4m3_codes8(__m256 v) {
  v = _mm256_max_ps(_mm256_set1_ps(-448.0f), _mm256_min_ps(_mm256_set1_ps(448.0f), v));
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(u, sign);
  const __m256i denorm_mask = _mm256_set1_epi32(141 << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm_mask))), denorm_mask);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i norm = _mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>((7u - 127u) << 23) + 0x7FFFF));
  norm = _mm256_min_epi32(_mm256_srli_epi32(_mm256_add_epi32(norm, odd), 20), _mm256_set1_epi32(0x7E));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
  const __m256i r = _mm256_and_si256(_mm256_blendv_epi8(norm, sub, small), _mm256_set1_epi32(0xFF));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// e2m1_code of 8 values, as int32 lanes
__m256i e2m1_codes8(__m256 v) {
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(6.0f));
  __m256i idx = _mm256_setzero_si256();
  for (float mid : kE2M1Mids)
    idx = _mm256_sub_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(mid), a, _CMP_LT_OQ)));
  const __m256 tie = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, _mm256_set1_ps(0.75f), _CMP_EQ_OQ),
                                               _mm256_cmp_ps(a, _mm256_set1_ps(1.75f), _CMP_EQ_OQ)),
                                  _mm256_cmp_ps(a, _mm256_set1_ps(3.5f), _CMP_EQ_OQ));
  idx = _mm256_sub_epi32(idx, _mm256_castps_si256(tie));
  return _mm256_or_si256(idx, _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(v), 31), 3));
}

// the low byte of each int32 lane, in order: 8 bytes
void store_bytes8(__m256i r, uint8_t* o) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i b = _mm256_shuffle_epi8(r, pick);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o),
                   _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// nibble codes in int32 lanes: lane 2k's low byte becomes lane 2k | lane 2k+1 << 4
__m256i nibble_pairs(__m256i r) { return _mm256_or_si256(r, _mm256_srli_epi64(r, 28)); }
#endif

// e4m3 codes of block values x / d
template <typename T>
void e4m3_block(const T* x, int64_t block, float d, uint8_t* codes) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 dv = _mm256_set1_ps(d);
  for (; i + 8 <= block; i += 8) store_bytes8(e4m3_codes8(_mm256_div_ps(load8(x + i), dv)), codes + i);
#endif
  for (; i < block; ++i) codes[i] = e4m3_code(static_cast<float>(x[i]) / d);
}

// e2m1 codes of block values x / d, two per byte
template <typename T>
void pack_e2m1(const T* x, int64_t block, float d, uint8_t* packed) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 dv = _mm256_set1_ps(d);
  for (; i + 8 <= block; i += 8) {
    alignas(8) uint8_t bytes[8];  // the pairs at 0, 2, 4, 6
    store_bytes8(nibble_pairs(e2m1_codes8(_mm256_div_ps(load8(x + i), dv))), bytes);
    for (int k = 0; k < 4; ++k) packed[(i >> 1) + k] = bytes[2 * k];
  }
#endif
  for (; i < block; i += 2)
    packed[i / 2] = e2m1_code(static_cast<float>(x[i]) / d) | (e2m1_code(static_cast<float>(x[i + 1]) / d) << 4);
}

// One buffer's page (m values) into its row: fp8, fp4 or mxfp4 (Layout's byte order).
template <typename T>
void encode_row(const Layout& L, const T* x, const float* e4m3, uint8_t* row, std::vector<float>& amax) {
  const int64_t m = L.m, B = L.block, nb = m / B;
  amax.resize(nb);
  for (int64_t b = 0; b < nb; ++b) amax[b] = block_amax(x + b * B, B);
  if (L.codec == kFP8) {
    for (int64_t b = 0; b < nb; ++b) {
      const float scale = amax[b] / 448.0f;
      e4m3_block(x + b * B, B, nonzero_or_one(scale), row + b * B);
      std::memcpy(row + m + 4 * b, &scale, 4);
    }
  } else if (L.codec == kFP4) {
    const float g = (nb ? *std::max_element(amax.begin(), amax.end()) : 0.0f) / 2688.0f;  // 448 * 6
    const float gs = nonzero_or_one(g), t = 6.0f * gs;
    std::memcpy(row, &g, 4);
    uint8_t* sb = row + 4 + m / 2;
    for (int64_t b = 0; b < nb; ++b) {
      sb[b] = e4m3_code(amax[b] / t);
      pack_e2m1(x + b * B, B, nonzero_or_one(e4m3[sb[b]] * gs), row + 4 + b * B / 2);
    }
  } else {  // kMXFP4: scale 2**ceil(log2(amax / 6)), exponent kept in -126..127
    for (int64_t b = 0; b < nb; ++b) {
      int ex;
      const float mant = std::frexp(amax[b] / 6.0f, &ex);
      const int e = std::min(127, std::max(-126, mant == 0.5f ? ex - 1 : ex));
      row[m / 2 + b] = static_cast<uint8_t>(e + 127);
      pack_e2m1(x + b * B, B, from_bits(static_cast<uint32_t>(e + 127) << 23), row + b * B / 2);
    }
  }
}

// data: per owned buffer, n pages [n, ...] -> rows [n, W], row i the concatenated encoded rows of
// page i in every buffer (page_bytes.encode_pages' layout). fp8c is not encoded here.
at::Tensor encode_pages(at::TensorList data, int64_t codec, int64_t block, const at::Tensor& e4m3) {
  TORCH_CHECK((codec == kFP8 || codec == kFP4 || codec == kMXFP4) && e4m3.numel() == 256 && e4m3.is_contiguous()
              && e4m3.scalar_type() == at::kFloat, "no native encode of codec ", codec, " or a bad e4m3 table");
  TORCH_CHECK(block > 0 && (codec == kFP8 || block % 2 == 0) && !data.empty(), "bad block ", block, " or no buffers");
  const int64_t n = data[0].size(0);
  std::vector<Layout> layouts;
  int64_t width = 0;
  for (const at::Tensor& d : data) {
    const auto st = d.scalar_type();
    TORCH_CHECK(d.is_cpu() && d.is_contiguous() && d.dim() >= 1 && d.size(0) == n
                && (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf),
                "buffers must be contiguous CPU float32/bfloat16/float16 [n, ...] of the same n");
    const Layout L{codec, n ? d.numel() / n : 0, block, 0, static_cast<int64_t>(d.element_size())};
    TORCH_CHECK(L.m % block == 0, "a page of ", L.m, " elements does not fit block ", block);
    width += L.nbytes();
    layouts.push_back(L);
  }
  at::Tensor rows = at::empty({n, width}, at::kByte);
  uint8_t* base = rows.data_ptr<uint8_t>();
  const float* t8 = e4m3.data_ptr<float>();
  std::vector<float> amax;
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* row = base + i * width;
    for (size_t j = 0; j < data.size(); ++j) {
      const Layout& L = layouts[j];
      on_values(data[j], [&](auto* v) { encode_row(L, v + i * L.m, t8, row, amax); });
      row += L.nbytes();
    }
  }
  return rows;
}

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY(deepinfer_kv_codecs, m) {
  m.def("decode_into(Tensor rows, Tensor pages, Tensor(a!)[] buffers, int codec, int block, int tokens, "
        "Tensor e4m3, Tensor e2m1) -> ()", &decode_into);
  m.def("encode_pages(Tensor[] data, int codec, int block, Tensor e4m3) -> Tensor", &encode_pages);
  m.def("isa() -> str", &isa);
}
