// Linear layers on llama.cpp's block-quantized weights, for picollama/kernels/block_linear.py.
// block_linear.py packs the weights and builds this file.
//
// block_linear(x, levels, scales, out_features, isa) -> (B, out_features) in x's dtype.
// x is (B, in), float32 or bfloat16, with `in` a multiple of 32. Each block of 32 inputs of
// each row is rounded to int8 with one scale (amax / 127), as llama.cpp's q8_1 does. The block
// keeps the sum of its levels, for the minimum term of 4-bit weights. Its scale stays fp32
// (llama.cpp's is fp16).
// Weights come in tiles: 16 output rows by one block of 32 inputs. A tile's 16 rows sit
// interleaved, 4 inputs of each row in turn. So one 64-byte load holds 4 inputs of all 16 rows,
// and one AVX-512 VNNI instruction (dpbusd) adds their products into 16 int32 sums, a row a
// lane. llama.cpp's repacked Q4_0 (block_q4_0x8) interleaves 8 rows the same way.
//   levels (G, K, 512) uint8: Q8_0. Byte 64c + 4r + j is level + 128 of row r, input 4c + j.
//   levels (G, K, 256) uint8: Q4. Byte 64c + 4r + j holds row r's inputs 4c + j (low nibble)
//     and 16 + 4c + j (high nibble), as levels 0-15.
//   scales (G, K, 16) or (G, K, 32) int16: fp16 bits of each row's scale d, then Q4's minimum m.
// G = ceil(out / 16) tile rows, K = in / 32 blocks. A weight is d·(level - 128) (Q8_0) or
// d·level + m (Q4_1; Q4_0 has m = -8d). The scales are the GGUF file's own fp16 values.
// Each block's integer dot product is exact. It is scaled in fp32 with fused multiply-adds, in
// the same order on every path. So the AVX-512 VNNI, AVX2 and scalar paths agree bit for bit.
// Output rows are split over the threads. A row's sums never depend on the thread count or on
// the other rows of x.
//
// We include ATen's headers, torch/library.h and torch's pybind11 casters, not torch/extension.h
// with all of torch. The build takes ~8 s instead of ~29 s on 2 cores.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int ROWS = 16;   // Output rows a tile: one AVX-512 register of int32 sums.
constexpr int BLOCK = 32;  // Inputs a block (llama.cpp's QK8_0, QK4_1).
constexpr int MAX_B = 4;   // Rows of x a pass over the weights.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAS_VNNI = true;
#else
constexpr bool HAS_VNNI = false;
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr bool HAS_AVX2 = true;
#else
constexpr bool HAS_AVX2 = false;
#endif

struct Acts {  // x quantized: (B, K) blocks of 32 int8 levels, each with a scale and level sum.
  const int8_t* q;
  const float* d;
  const int32_t* sum;
  int64_t K;
};

// A pass over one tile row: the (NB, 16) outputs of x's rows b0 .. b0 + NB - 1.
typedef void (*Kernel)(const uint8_t*, const uint16_t*, const Acts&, int64_t, float*);

template <typename T>
void quantize_acts(const T* x, int64_t blocks, int8_t* q, float* d, int32_t* sum) {
  for (int64_t i = 0; i < blocks; ++i) {
    float v[BLOCK];
    float amax = 0;
    for (int j = 0; j < BLOCK; ++j) {
      v[j] = static_cast<float>(x[i * BLOCK + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float scale = amax / 127;
    const float inverse = scale != 0 ? 1 / scale : 0;
    int32_t total = 0;
    for (int j = 0; j < BLOCK; ++j) {
      const int level = static_cast<int>(std::nearbyint(v[j] * inverse));
      q[i * BLOCK + j] = static_cast<int8_t>(level);
      total += level;
    }
    d[i] = scale;
    sum[i] = total;
  }
}

inline float half(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

// Scalar paths: the reference the vector paths match bit for bit.
template <int NB>
void q8_scalar(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < ROWS; ++r) {
      float acc = 0;
      for (int64_t k = 0; k < a.K; ++k) {
        const uint8_t* tile = w + k * 512;
        const int8_t* q = a.q + ((b0 + b) * a.K + k) * BLOCK;
        int32_t dot = 0;
        for (int i = 0; i < BLOCK; ++i) dot += (tile[64 * (i / 4) + 4 * r + i % 4] - 128) * q[i];
        acc = std::fma(static_cast<float>(dot), half(s[k * 16 + r]) * a.d[(b0 + b) * a.K + k], acc);
      }
      out[b * ROWS + r] = acc;
    }
  }
}

template <int NB>
void q4_scalar(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < ROWS; ++r) {
      float acc = 0;
      for (int64_t k = 0; k < a.K; ++k) {
        const uint8_t* tile = w + k * 256;
        const int64_t at = (b0 + b) * a.K + k;
        const int8_t* q = a.q + at * BLOCK;
        int32_t dot = 0;
        for (int i = 0; i < 16; ++i) {
          const uint8_t byte = tile[64 * (i / 4) + 4 * r + i % 4];
          dot += (byte & 15) * q[i] + (byte >> 4) * q[16 + i];
        }
        acc = std::fma(static_cast<float>(dot), half(s[k * 32 + r]) * a.d[at], acc);
        acc = std::fma(half(s[k * 32 + 16 + r]), a.d[at] * static_cast<float>(a.sum[at]), acc);
      }
      out[b * ROWS + r] = acc;
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// AVX2: a tile as two halves of 8 rows. maddubs multiplies unsigned by signed bytes and adds
// pairs into int16. Q8_0 weights go through abs and sign, as llama.cpp does, so no pair
// overflows. Q4 levels are at most 15: 16 products of 15·127 still fit in an int16.
template <int NB>
void q8_avx2(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < a.K; ++k) {
      __m256i v[8];
      for (int c = 0; c < 8; ++c) {
        const auto* p = reinterpret_cast<const __m256i*>(w + k * 512 + 64 * c + 32 * h);
        v[c] = _mm256_xor_si256(_mm256_loadu_si256(p), flip);  // level + 128 -> signed level
      }
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * 16 + 8 * h)));
      for (int b = 0; b < NB; ++b) {
        const int64_t at = (b0 + b) * a.K + k;
        const auto* q = reinterpret_cast<const int32_t*>(a.q + at * BLOCK);
        __m256i dot = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(q[c]), v[c]);
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(v[c], v[c]), x);
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
        }
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d[at]));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[b]);
      }
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + b * ROWS + 8 * h, acc[b]);
  }
}

template <int NB>
void q4_avx2(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < a.K; ++k) {
      __m256i lo[4], hi[4];
      for (int c = 0; c < 4; ++c) {
        const auto* p = reinterpret_cast<const __m256i*>(w + k * 256 + 64 * c + 32 * h);
        const __m256i v = _mm256_loadu_si256(p);
        lo[c] = _mm256_and_si256(v, low);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const auto* sk = reinterpret_cast<const __m128i*>(s + k * 32 + 8 * h);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(sk));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(sk + 2));
      for (int b = 0; b < NB; ++b) {
        const int64_t at = (b0 + b) * a.K + k;
        const auto* q = reinterpret_cast<const int32_t*>(a.q + at * BLOCK);
        __m256i pairs = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(q[c])));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(q[4 + c])));
        }
        const __m256i dot = _mm256_madd_epi16(pairs, ones);
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.d[at]));
        acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[b]);
        const float low_sum = a.d[at] * static_cast<float>(a.sum[at]);
        acc[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(low_sum), acc[b]);
      }
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + b * ROWS + 8 * h, acc[b]);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// AVX-512 VNNI: dpbusd multiplies unsigned weight bytes by signed activation bytes and adds each
// lane's 4 products into its int32. Q8_0's +128 comes back out as 128 times the level sum.
template <int NB>
void q8_vnni(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; ++k, w += 512, s += 16) {
    __m512i v[8];
    for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(w + 64 * c);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (b0 + b) * a.K + k;
      const auto* q = reinterpret_cast<const int32_t*>(a.q + at * BLOCK);
      __m512i even = _mm512_set1_epi32(-128 * a.sum[at]);
      __m512i odd = _mm512_setzero_si512();  // Two chains, for latency.
      for (int c = 0; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, v[c], _mm512_set1_epi32(q[c]));
        odd = _mm512_dpbusd_epi32(odd, v[c + 1], _mm512_set1_epi32(q[c + 1]));
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      const __m512i dot = _mm512_add_epi32(even, odd);
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + b * ROWS, acc[b]);
}

template <int NB>
void q4_vnni(const uint8_t* w, const uint16_t* s, const Acts& a, int64_t b0, float* out) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; ++k, w += 256, s += 32) {
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(w + 64 * c);
      lo[c] = _mm512_and_si512(v, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const auto* sk = reinterpret_cast<const __m256i*>(s);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(sk));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(sk + 1));
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (b0 + b) * a.K + k;
      const auto* q = reinterpret_cast<const int32_t*>(a.q + at * BLOCK);
      __m512i first = _mm512_setzero_si512();
      __m512i second = _mm512_setzero_si512();  // Two chains, for latency.
      for (int c = 0; c < 4; ++c) {
        first = _mm512_dpbusd_epi32(first, lo[c], _mm512_set1_epi32(q[c]));
        second = _mm512_dpbusd_epi32(second, hi[c], _mm512_set1_epi32(q[4 + c]));
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
      const __m512i dot = _mm512_add_epi32(first, second);
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[b]);
      const float low_sum = a.d[at] * static_cast<float>(a.sum[at]);
      acc[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(low_sum), acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + b * ROWS, acc[b]);
}
#endif

#define BY_ROWS(f) {f<1>, f<2>, f<3>, f<4>}

// The kernel for a format (0: Q8_0, 1: Q4), path (0: the best built, 1: AVX2, 2: scalar) and
// number of x rows (1-4). Paths this build lacks fall back to the next one down.
Kernel pick(int format, int64_t isa, int64_t rows) {
  static const Kernel scalar[2][MAX_B] = {BY_ROWS(q8_scalar), BY_ROWS(q4_scalar)};
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  static const Kernel avx2[2][MAX_B] = {BY_ROWS(q8_avx2), BY_ROWS(q4_avx2)};
#else
  static const Kernel(*avx2)[MAX_B] = scalar;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  static const Kernel vnni[2][MAX_B] = {BY_ROWS(q8_vnni), BY_ROWS(q4_vnni)};
#else
  static const Kernel(*vnni)[MAX_B] = avx2;
#endif
  const Kernel(*table)[MAX_B] = isa == 2 ? scalar : isa == 1 ? avx2 : vnni;
  return table[format][rows - 1];
}

template <typename T>
void linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& scales,
            int64_t isa, at::Tensor& out) {
  const int64_t B = x.size(0), N = out.size(1), G = levels.size(0), K = levels.size(1);
  const int64_t tile = levels.size(2), per = scales.size(2);
  // The caller's thread keeps its buffers between calls. Tensors cost ~1 us each to allocate.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> sum;
  q.resize(B * K * BLOCK);
  d.resize(B * K);
  sum.resize(B * K);
  quantize_acts(x.const_data_ptr<T>(), B * K, q.data(), d.data(), sum.data());
  const Acts acts{q.data(), d.data(), sum.data(), K};
  const uint8_t* w = levels.const_data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<int16_t>());
  T* y = out.data_ptr<T>();
  const int format = tile == 512 ? 0 : 1;
  // A thread takes at least ~64 KB of weights. A fork costs ~1-2 us, a 64 KB read ~3 us.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (K * tile));
  at::parallel_for(0, G, grain, [&](int64_t begin, int64_t end) {
    float part[MAX_B * ROWS];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t rows = std::min<int64_t>(ROWS, N - g * ROWS);
      for (int64_t b0 = 0; b0 < B; b0 += MAX_B) {
        const int64_t nb = std::min<int64_t>(MAX_B, B - b0);
        pick(format, isa, nb)(w + g * K * tile, s + g * K * per, acts, b0, part);
        for (int64_t b = 0; b < nb; ++b)
          for (int64_t r = 0; r < rows; ++r)
            y[(b0 + b) * N + g * ROWS + r] = static_cast<T>(part[b * ROWS + r]);
      }
    }
  });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& scales,
                        int64_t out_features, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "block_linear: x must be (B, in), contiguous");
  TORCH_CHECK(levels.dim() == 3 && levels.is_contiguous() && levels.scalar_type() == at::kByte &&
                  (levels.size(2) == 512 || levels.size(2) == 256),
              "block_linear: levels must be (G, K, 512 or 256) uint8, contiguous");
  const int64_t per = levels.size(2) == 512 ? 16 : 32;
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.scalar_type() == at::kShort &&
                  scales.size(0) == levels.size(0) && scales.size(1) == levels.size(1) &&
                  scales.size(2) == per,
              "block_linear: scales must be (G, K, 16 or 32) int16 (fp16 bits), contiguous");
  TORCH_CHECK(x.size(1) == levels.size(1) * BLOCK, "block_linear: x has not in = 32 K inputs");
  TORCH_CHECK(out_features > (levels.size(0) - 1) * ROWS && out_features <= levels.size(0) * ROWS,
              "block_linear: out_features does not fit the tiles");
  TORCH_CHECK(isa >= 0 && isa <= 2, "block_linear: isa is 0 (best), 1 (AVX2) or 2 (scalar)");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    linear<c10::BFloat16>(x, levels, scales, isa, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "block_linear: x must be float32 or bfloat16");
    linear<float>(x, levels, scales, isa, out);
  }
  return out;
}

// The paths this build has: 2 with AVX-512 VNNI, 1 with AVX2 only, 0 scalar only.
int64_t block_isa() { return HAS_VNNI ? 2 : HAS_AVX2 ? 1 : 0; }

}  // namespace

// float_ops.cpp, built into this module too.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, int64_t isa);

TORCH_LIBRARY_FRAGMENT(picollama, m) {
  m.def(
      "block_linear(Tensor x, Tensor levels, Tensor scales, int out_features, int isa) -> "
      "Tensor");
  m.def("float_linear(Tensor x, Tensor weight, int isa) -> Tensor");
  m.def("block_isa() -> int", &block_isa);
}

TORCH_LIBRARY_IMPL(picollama, CPU, m) {
  m.impl("block_linear", block_linear);
  m.impl("float_linear", float_linear);
}

// Eager calls come here: ~0.6 us a call, against ~6 us through torch.ops' dispatcher. A decode
// step makes 121 of them for SmolLM2-135M. Compiled and exported steps call the op above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear", &block_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("float_linear", &float_linear, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("block_isa", &block_isa);
}
