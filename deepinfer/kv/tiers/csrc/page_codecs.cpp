// Lossy KV page decode straight into the L1 pool: the bytes of n pages (the rows of a staging
// buffer, in the layout of page_bytes.py / codecs.py) become the pages' values in each owned
// buffer, with no intermediate tensors. Values are computed exactly as the torch decode does
// (float32 table lookup times float32 scale, clamped to the dtype's finite range, rounded to
// nearest even), with the tables handed in by the caller, so the results are bit-identical.
// One call runs on its caller's thread: the loader's reader threads each decode their own
// pages (an intra-op thread team per reader would oversubscribe the cores they share).

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cfloat>
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

// codes [m] (one byte each) times one float32 scale per block (unaligned bytes) -> o[m]
template <typename T>
void fp8_values(const uint8_t* codes, const uint8_t* scale_bytes, int64_t m, int64_t block,
                const float* e4m3, T* o) {
  for (int64_t b = 0; b < m / block; ++b) {
    const float s = load_f32(scale_bytes + 4 * b);
    const uint8_t* c = codes + b * block;
    T* out = o + b * block;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= block; i += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i)));
      Out<T>::put8(out + i, _mm256_mul_ps(_mm256_i32gather_ps(e4m3, idx, 4), sv));
    }
#endif
    for (; i < block; ++i) Out<T>::put(out + i, e4m3[c[i]] * s);
  }
}

// packed e2m1 (even element in the low nibble) times one float32 scale per block -> o[m]
template <typename T>
void fp4_values(const uint8_t* packed, const float* block_scale, int64_t m, int64_t block,
                const float* e2m1, T* o) {
  for (int64_t b = 0; b < m / block; ++b) {
    const float s = block_scale[b];
    const uint8_t* p = packed + b * block / 2;
    T* out = o + b * block;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 sv = _mm256_set1_ps(s);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (; i + 8 <= block; i += 8) {
      uint32_t w;
      std::memcpy(&w, p + i / 2, 4);
      const __m128i x = _mm_cvtsi32_si128(static_cast<int>(w));
      const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
      const __m256i idx = _mm256_cvtepu8_epi32(nib);
      Out<T>::put8(out + i, _mm256_mul_ps(_mm256_i32gather_ps(e2m1, idx, 4), sv));
    }
#endif
    for (; i < block; ++i) {
      const uint8_t byte = p[i / 2];
      Out<T>::put(out + i, e2m1[(i % 2) ? (byte >> 4) : (byte & 0x0F)] * s);
    }
  }
}

// One page row of one buffer into o (m elements of T).
template <typename T>
void decode_row(const Layout& L, const uint8_t* row, const float* e4m3, const float* e2m1, T* o,
                std::vector<float>& tmp) {
  const int64_t m = L.m, nb = m / L.block;
  if (L.codec == kFP8) {
    fp8_values<T>(row, row + m, m, L.block, e4m3, o);
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
    fp4_values<T>(packed, tmp.data(), m, L.block, e2m1, o);
    return;
  }
  // kFP8C: float32 deviations (clamped to float32's range) + the bfloat16 mean, then the exact token
  const int64_t C = m / L.tokens;
  tmp.resize(m);
  fp8_values<float>(row, row + m, m, L.block, e4m3, tmp.data());
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
  m.def("isa() -> str", &isa);
}
