// Linear layers on float32 or bfloat16 weights, for picollama/kernels/float_linear.py.
// block_linear.py builds this file with block_ops.cpp into one module, which registers it.
//
// float_linear(x, weight, isa) -> (B, out) in x's dtype.
// x is (B, in), float32 or bfloat16. weight is (out, in), row-major, float32 or bfloat16, as
// nn.Linear keeps it. So a tied output layer reads the embedding itself. A pass reads one row
// and multiplies it by up to 4 rows of x. Each thread reads its rows in order: one contiguous
// stream, which the hardware prefetcher follows. Passes over 4 rows at once (4 streams of
// 2.3 KB each for SmolLM2) read 35 against 43 GB/s from memory on 2 Zen 5 cores. Only a row's
// end is read with masked loads: masking every 512-bit load streamed 15-35 against 48-53 GB/s.
// Sums are float32. With bfloat16 weights x is first rounded to bfloat16 (to nearest even), as
// llama.cpp does for its BF16 products. Each product of two bfloat16 values is exact in
// float32, so the paths differ only in the order of their sums:
//   best: AVX-512, with AVX512_BF16's dpbf16 for bfloat16 weights where the CPU has it (32
//     inputs an instruction), else bfloat16 widened to float32 by a shift.
//   AVX2: 8 inputs at a time, bfloat16 widened by a shift. scalar: one input at a time.
// Paths this build lacks fall back to the next one down. Output rows are split over the
// threads. A row's sums never depend on the thread count or on the other rows of x.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace picollama_float {

constexpr int C = 4;      // Independent sums a row, for the latency of fused multiply-adds.
constexpr int MAX_B = 4;  // Rows of x a pass.
constexpr int PAD = 128;  // x's rows are padded with zeros to a multiple of this (32 C).

struct Xs {          // x as the kernels read it: (B, ld), zero-padded.
  const float* f;    // float32: bfloat16-rounded for bfloat16 weights.
  const uint16_t* h; // bfloat16 bits, for dpbf16.
  int64_t ld;
};

// A pass: weight row w (`in` long) by x's rows b0 .. b0 + NB - 1, into out (NB).
typedef void (*Kernel)(const void*, int64_t, const Xs&, int64_t, float*);

inline float widen(float v) { return v; }
inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &word, 4);
  return v;
}

template <typename W, int NB>
void scalar(const void* weights, int64_t in, const Xs& x, int64_t b0, float* out) {
  const W* w = static_cast<const W*>(weights);
  for (int b = 0; b < NB; ++b) {
    const float* xb = x.f + (b0 + b) * x.ld;
    float acc = 0;
    for (int64_t i = 0; i < in; ++i) acc = std::fma(widen(w[i]), xb[i], acc);
    out[b] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename W, int NB>
void avx2(const void* weights, int64_t in, const Xs& x, int64_t b0, float* out) {
  const W* w = static_cast<const W*>(weights);
  __m256 acc[NB][C];
  for (int b = 0; b < NB; ++b)
    for (int c = 0; c < C; ++c) acc[b][c] = _mm256_setzero_ps();
  const int64_t whole = in / (8 * C) * (8 * C);
  for (int64_t i = 0; i < whole; i += 8 * C) {
    for (int c = 0; c < C; ++c) {
      const __m256 v = load8(w + i + 8 * c);
      for (int b = 0; b < NB; ++b) {
        const __m256 xv = _mm256_loadu_ps(x.f + (b0 + b) * x.ld + i + 8 * c);
        acc[b][c] = _mm256_fmadd_ps(v, xv, acc[b][c]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[b][0], acc[b][1]),
                                     _mm256_add_ps(acc[b][2], acc[b][3]));
    float s = sum8(sum);
    for (int64_t i = whole; i < in; ++i) s = std::fma(widen(w[i]), x.f[(b0 + b) * x.ld + i], s);
    out[b] = s;
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) {
  return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i bits = m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi16(m, p);
  const __m512i words = _mm512_cvtepu16_epi32(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// The first n of `lanes` lanes, for a load at the end of a row.
template <typename M>
inline M first(int64_t n, int lanes) {
  return n >= lanes ? static_cast<M>(~0ull) : n <= 0 ? 0 : static_cast<M>((1ull << n) - 1);
}

template <typename W, int NB>
void avx512(const void* weights, int64_t in, const Xs& x, int64_t b0, float* out) {
  const W* w = static_cast<const W*>(weights);
  __m512 acc[NB][C];
  for (int b = 0; b < NB; ++b)
    for (int c = 0; c < C; ++c) acc[b][c] = _mm512_setzero_ps();
  const float* xs = x.f + b0 * x.ld;
  const int64_t ld = x.ld;
  const int64_t whole = in / (16 * C) * (16 * C);
  for (int64_t i = 0; i < whole; i += 16 * C) {
    for (int c = 0; c < C; ++c) {
      const __m512 v = load16(w + i + 16 * c, 0xFFFF);
      for (int b = 0; b < NB; ++b)
        acc[b][c] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xs + b * ld + i + 16 * c), acc[b][c]);
    }
  }
  for (int64_t at = whole; at < in; at += 16) {  // The row's end, in masked loads.
    const __m512 v = load16(w + at, first<__mmask16>(in - at, 16));
    for (int b = 0; b < NB; ++b)
      acc[b][0] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xs + b * ld + at), acc[b][0]);
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]),
                                     _mm512_add_ps(acc[b][2], acc[b][3]));
    out[b] = _mm512_reduce_add_ps(sum);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// dpbf16 adds lane j's products of inputs 2j and 2j + 1 into its float32 sum.
template <int NB>
void dpbf16(const void* weights, int64_t in, const Xs& x, int64_t b0, float* out) {
  const uint16_t* w = static_cast<const uint16_t*>(weights);
  __m512 acc[NB][C];
  for (int b = 0; b < NB; ++b)
    for (int c = 0; c < C; ++c) acc[b][c] = _mm512_setzero_ps();
  const uint16_t* xs = x.h + b0 * x.ld;
  const int64_t ld = x.ld;
  const int64_t whole = in / (32 * C) * (32 * C);
  for (int64_t i = 0; i < whole; i += 32 * C) {
    for (int c = 0; c < C; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(w + i + 32 * c);
      for (int b = 0; b < NB; ++b) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs + b * ld + i + 32 * c);
        acc[b][c] = _mm512_dpbf16_ps(acc[b][c], v, xv);
      }
    }
  }
  for (int64_t at = whole; at < in; at += 32) {  // The row's end, in masked loads.
    const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(first<__mmask32>(in - at, 32), w + at);
    for (int b = 0; b < NB; ++b) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs + b * ld + at);  // Padded.
      acc[b][0] = _mm512_dpbf16_ps(acc[b][0], v, xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]),
                                     _mm512_add_ps(acc[b][2], acc[b][3]));
    out[b] = _mm512_reduce_add_ps(sum);
  }
}
#endif

#define BY_ROWS(f) {f<1>, f<2>, f<3>, f<4>}

// The kernel for a weight type (0: float32, 1: bfloat16), path (0: best, 1: AVX2, 2: scalar) and
// number of x rows (1-4).
Kernel pick(int type, int64_t isa, int64_t rows) {
  static const Kernel low[2][MAX_B] = {{scalar<float, 1>, scalar<float, 2>, scalar<float, 3>,
                                        scalar<float, 4>},
                                       {scalar<uint16_t, 1>, scalar<uint16_t, 2>,
                                        scalar<uint16_t, 3>, scalar<uint16_t, 4>}};
#if defined(__AVX2__) && defined(__FMA__)
  static const Kernel mid[2][MAX_B] = {
      {avx2<float, 1>, avx2<float, 2>, avx2<float, 3>, avx2<float, 4>},
      {avx2<uint16_t, 1>, avx2<uint16_t, 2>, avx2<uint16_t, 3>, avx2<uint16_t, 4>}};
#else
  static const Kernel(*mid)[MAX_B] = low;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  static const Kernel top[2][MAX_B] = {
      {avx512<float, 1>, avx512<float, 2>, avx512<float, 3>, avx512<float, 4>},
#if defined(__AVX512BF16__)
      BY_ROWS(dpbf16)};
#else
      {avx512<uint16_t, 1>, avx512<uint16_t, 2>, avx512<uint16_t, 3>, avx512<uint16_t, 4>}};
#endif
#else
  static const Kernel(*top)[MAX_B] = mid;
#endif
  const Kernel(*table)[MAX_B] = isa == 2 ? low : isa == 1 ? mid : top;
  return table[type][rows - 1];
}

template <typename T>
void linear(const at::Tensor& x, const at::Tensor& weight, int64_t isa, at::Tensor& out) {
  const int64_t B = x.size(0), in = x.size(1), N = weight.size(0);
  const int64_t ld = (in + PAD - 1) / PAD * PAD;
  const bool half = weight.scalar_type() == at::kBFloat16;
  // The caller's thread keeps its buffers between calls. Tensors cost ~1 us each to allocate.
  thread_local std::vector<float> xf;
  thread_local std::vector<uint16_t> xh;
  xf.assign(B * ld, 0.0f);
  xh.assign(half ? B * ld : 0, 0);
  const T* source = x.const_data_ptr<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < in; ++i) {
      const float v = static_cast<float>(source[b * in + i]);
      if (half) {
        const c10::BFloat16 rounded(v);  // To nearest even.
        xh[b * ld + i] = rounded.x;
        xf[b * ld + i] = static_cast<float>(rounded);
      } else {
        xf[b * ld + i] = v;
      }
    }
  const Xs xs{xf.data(), xh.data(), ld};
  const auto* w = static_cast<const char*>(weight.const_data_ptr());
  const int64_t row_bytes = in * weight.element_size();
  T* y = out.data_ptr<T>();
  // A thread takes at least ~64 KB of weights. A fork costs ~1-2 us, a 64 KB read ~3 us.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / row_bytes);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float part[MAX_B];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b0 = 0; b0 < B; b0 += MAX_B) {
        const int64_t nb = std::min<int64_t>(MAX_B, B - b0);
        pick(half ? 1 : 0, isa, nb)(w + n * row_bytes, in, xs, b0, part);
        for (int64_t b = 0; b < nb; ++b) y[(b0 + b) * N + n] = static_cast<T>(part[b]);
      }
    }
  });
}

}  // namespace picollama_float

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "float_linear: x must be (B, in), contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "float_linear: weight must be (out, in) float32 or bfloat16, contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "float_linear: x and weight differ in inputs");
  TORCH_CHECK(isa >= 0 && isa <= 2, "float_linear: isa is 0 (best), 1 (AVX2) or 2 (scalar)");
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) == 0 || weight.size(0) == 0) return out;
  if (x.scalar_type() == at::kBFloat16) {
    picollama_float::linear<c10::BFloat16>(x, weight, isa, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "float_linear: x must be float32 or bfloat16");
    picollama_float::linear<float>(x, weight, isa, out);
  }
  return out;
}
