// Lossy KV page codecs on CPU pages. Decode goes straight into the L1 pool: the bytes of n pages
// (the rows of a staging buffer, in the layout of page_bytes.py / codecs.py) become the pages'
// values in each owned buffer, with no intermediate tensors. Values are computed exactly as the
// torch decode does (float32 table lookup times float32 scale, clamped to the dtype's finite
// range, rounded to nearest even), with the tables handed in by the caller, so the results are
// bit-identical. Encode (fp8, fp4, mxfp4) repeats the torch encode's float32 steps in the same
// order, so its bytes are the torch encode's: the tier writers save pages without its dozen
// temporaries per page (FP4's table rounding was the slowest of them).
// One call runs on its caller's thread: the loader's reader threads each decode their own
// pages (an intra-op thread team per reader would oversubscribe the cores they share).

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

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

float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

float clamp_to(float v, float fmax) { return v > fmax ? fmax : (v < -fmax ? -fmax : v); }  // NaN stays

// fp8 block scales: float32 at unaligned offsets after the codes
struct FP8Scales {
  const uint8_t* bytes;
  float operator()(int64_t b) const { return load_f32(bytes + 4 * b); }
};
FP8Scales fp8_scales(const uint8_t* bytes) { return FP8Scales{bytes}; }

// -- stores of float32 values into the destination dtype (clamped first, as codecs._finish)
template <typename T> struct Out;
template <> struct Out<float> {
  static constexpr float kMax = FLT_MAX;
  static void put(float* o, float v) { *o = clamp_to(v, kMax); }
#ifdef __AVX2__
  static void put8(float* o, __m256 v) {
    const __m256 mx = _mm256_set1_ps(kMax);  // min/max return the second operand on NaN
    _mm256_storeu_ps(o, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), mx), _mm256_min_ps(mx, v)));
  }
#endif
};
template <> struct Out<c10::BFloat16> {
  static constexpr float kMax = 3.3895313892515355e38f;
  static void put(c10::BFloat16* o, float v) { *o = c10::BFloat16(clamp_to(v, kMax)); }
#ifdef __AVX2__
  static void put8(c10::BFloat16* o, __m256 v) {
    const __m256 mx = _mm256_set1_ps(kMax);
    v = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), mx), _mm256_min_ps(mx, v));
    const __m256i u = _mm256_castps_si256(v);  // round to nearest even, NaN -> 0x7FC0 (as c10)
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
  }
#endif
};
template <> struct Out<c10::Half> {
  static constexpr float kMax = 65504.0f;
  static void put(c10::Half* o, float v) { *o = c10::Half(clamp_to(v, kMax)); }
#ifdef __AVX2__
  static void put8(c10::Half* o, __m256 v) {
    const __m256 mx = _mm256_set1_ps(kMax);
    v = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), mx), _mm256_min_ps(mx, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
};

// How a block's codes sit in its bytes: one per byte (e4m3), or two (e2m1, even element low).
struct ByteCodes {
  static int64_t offset(int64_t i) { return i; }
  static int code(const uint8_t* c, int64_t i) { return c[i]; }
#ifdef __AVX2__
  static __m256i codes8(const uint8_t* c) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  }
#endif
};
struct NibbleCodes {
  static int64_t offset(int64_t i) { return i / 2; }
  static int code(const uint8_t* c, int64_t i) { return (i % 2) ? (c[i / 2] >> 4) : (c[i / 2] & 0x0F); }
#ifdef __AVX2__
  static __m256i codes8(const uint8_t* c) {
    uint32_t w;
    std::memcpy(&w, c, 4);
    const __m128i x = _mm_cvtsi32_si128(static_cast<int>(w));
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low)));
  }
#endif
};

// codes of m elements (Codes' packing) times scale(b) per block, looked up in table -> o[m]
template <typename Codes, typename T, typename Scale>
void block_values(const uint8_t* codes, int64_t m, int64_t block, const Scale& scale, const float* table, T* o) {
  for (int64_t b = 0; b < m / block; ++b) {
    const float s = scale(b);
    const uint8_t* c = codes + Codes::offset(b * block);
    T* out = o + b * block;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= block; i += 8)
      Out<T>::put8(out + i, _mm256_mul_ps(_mm256_i32gather_ps(table, Codes::codes8(c + Codes::offset(i)), 4), sv));
#endif
    for (; i < block; ++i) Out<T>::put(out + i, table[Codes::code(c, i)] * s);
  }
}

// One page row of one buffer into o (m elements of T).
template <typename T>
void decode_row(const Layout& L, const uint8_t* row, const float* e4m3, const float* e2m1, T* o,
                std::vector<float>& tmp) {
  const int64_t m = L.m, nb = m / L.block;
  if (L.codec == kFP8) {
    block_values<ByteCodes>(row, m, L.block, fp8_scales(row + m), e4m3, o);
    return;
  }
  if (L.codec == kFP4 || L.codec == kMXFP4) {
    tmp.resize(nb);
    const uint8_t* packed = row + (L.codec == kFP4 ? 4 : 0);
    const uint8_t* sb = packed + m / 2;
    if (L.codec == kFP4) {
      const float g = load_f32(row);
      for (int64_t b = 0; b < nb; ++b) tmp[b] = e4m3[sb[b]] * g;
    } else {
      for (int64_t b = 0; b < nb; ++b) {
        const uint32_t bits = sb[b] == 0 ? 0x00400000u : static_cast<uint32_t>(sb[b]) << 23;  // 2**-127
        std::memcpy(&tmp[b], &bits, 4);
      }
    }
    block_values<NibbleCodes>(packed, m, L.block, [&](int64_t b) { return tmp[b]; }, e2m1, o);
    return;
  }
  // kFP8C: float32 deviations (clamped to float32's range) + the bfloat16 mean, then the exact token
  const int64_t C = m / L.tokens;
  tmp.resize(m);
  block_values<ByteCodes>(row, m, L.block, fp8_scales(row + m), e4m3, tmp.data());
  const uint8_t* mean = row + m + nb * 4;
  const uint8_t* exact = mean + 2 * C;
  uint16_t idx;
  std::memcpy(&idx, exact + C * L.esz, 2);
  TORCH_CHECK(idx < L.tokens, "fp8c: exact token ", idx, " beyond the page's ", L.tokens, " tokens");
  for (int64_t c = 0; c < C; ++c) {
    uint16_t h;
    std::memcpy(&h, mean + 2 * c, 2);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float mf;
    std::memcpy(&mf, &bits, 4);
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
    const Layout L{codec, b[0].numel(), block, tokens, static_cast<int64_t>(b.element_size())};
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
  std::vector<float> tmp;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < nbuf; ++j) {
      const Layout& L = layouts[j];
      const uint8_t* row = base + i * width + offsets[j];
      const at::Tensor& b = buffers[j];
      switch (b.scalar_type()) {
        case at::kFloat: decode_row(L, row, t8, t4, b.data_ptr<float>() + pg[i] * L.m, tmp); break;
        case at::kBFloat16: decode_row(L, row, t8, t4, b.data_ptr<c10::BFloat16>() + pg[i] * L.m, tmp); break;
        default: decode_row(L, row, t8, t4, b.data_ptr<c10::Half>() + pg[i] * L.m, tmp); break;
      }
    }
  }
}

// -- encode: the torch encode's arithmetic (codecs.py), op for op in float32, so the bytes match

// abs max of one block; a NaN / Inf value raises (the torch encode refuses to persist such pages)
template <typename T>
float block_amax(const T* x, int64_t block) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < block; ++i) {
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

// e2m1 code of v: nearest even grid point, saturating at +-6 (minifloat.E2M1.encode)
uint8_t e2m1_code(float v) {
  static constexpr float kMids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const float a = std::fmin(std::fabs(v), 6.0f);
  int idx = 0;
  for (float mid : kMids) idx += mid < a;
  if (idx < 7 && a == kMids[idx] && (idx & 1)) ++idx;  // a tie goes to the even code
  return static_cast<uint8_t>(idx | (std::signbit(v) ? 8 : 0));
}

// e2m1 codes of block values x / d, two per byte
template <typename T>
void pack_e2m1(const T* x, int64_t block, float d, uint8_t* packed) {
  for (int64_t i = 0; i < block; i += 2)
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
      const float d = nonzero_or_one(scale);
      for (int64_t i = b * B; i < (b + 1) * B; ++i) row[i] = e4m3_code(static_cast<float>(x[i]) / d);
      std::memcpy(row + m + 4 * b, &scale, 4);
    }
  } else if (L.codec == kFP4) {
    float page_amax = 0.0f;
    for (int64_t b = 0; b < nb; ++b) page_amax = amax[b] > page_amax ? amax[b] : page_amax;
    const float g = page_amax / 2688.0f;  // 448 * 6
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
      const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
      float scale;
      std::memcpy(&scale, &bits, 4);
      row[m / 2 + b] = static_cast<uint8_t>(e + 127);
      pack_e2m1(x + b * B, B, scale, row + b * B / 2);
    }
  }
}

// data: per owned buffer, n pages [n, ...] -> rows [n, W], row i the concatenated encoded rows of
// page i in every buffer (page_bytes.encode_pages' layout). fp8c is not encoded here.
at::Tensor encode_pages(at::TensorList data, int64_t codec, int64_t block, const at::Tensor& e4m3) {
  TORCH_CHECK(codec == kFP8 || codec == kFP4 || codec == kMXFP4, "no native encode for codec id ", codec);
  TORCH_CHECK(e4m3.numel() == 256 && e4m3.scalar_type() == at::kFloat && e4m3.is_contiguous(),
              "e4m3 table must be float32 [256]");
  TORCH_CHECK(block > 0 && (codec == kFP8 || block % 2 == 0), "bad block size ", block);
  TORCH_CHECK(!data.empty(), "no buffers to encode");
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
      const at::Tensor& d = data[j];
      switch (d.scalar_type()) {
        case at::kFloat: encode_row(L, d.data_ptr<float>() + i * L.m, t8, row, amax); break;
        case at::kBFloat16: encode_row(L, d.data_ptr<c10::BFloat16>() + i * L.m, t8, row, amax); break;
        default: encode_row(L, d.data_ptr<c10::Half>() + i * L.m, t8, row, amax); break;
      }
      row += L.nbytes();
    }
  }
  return rows;
}

std::string isa() {
#ifdef __AVX2__
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
