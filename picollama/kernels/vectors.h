// The vector helpers the hand-written attention kernels share: decode_ops.cpp's
// decode_attention and prefill_attention.cpp's prefill_attention. GCC's generic vectors, one
// register wide, so the same code builds for AVX-512 and AVX2.
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace picollama_vectors {

// One vector register of floats: 16 with AVX-512, else 8. On AVX2, GCC lowers wider generic
// vectors through memory, which is 10x slower.
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline vf load(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift.
#ifdef __AVX512F__  // GCC 12 splits the generic widening in halves, so use intrinsics.
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vf>(_mm512_slli_epi32(w, 16));
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf r;
  std::memcpy(&r, &w, sizeof r);
  return r;
#endif
}

inline vf load(const uint32_t* p) {  // bf16 pairs (prefill_attention.cpp), as a vf's bits
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline vf load(const int8_t* p) {
#ifdef __AVX512F__
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#else
  typedef int8_t vb __attribute__((vector_size(W)));
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vf);
#endif
}

inline float hsum(vf a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(a));
#else
  float s = 0;
  for (int i = 0; i < W; i++) s += a[i];
  return s;
#endif
}

inline float hmax(vf a) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(a));
#else
  float m = a[0];
  for (int i = 1; i < W; i++) m = a[i] > m ? a[i] : m;
  return m;
#endif
}

#ifdef __AVX512F__
// The 16 sums of a[0..15]'s lanes, in order, by four rounds of shuffles and adds. That is 45
// operations for 16 dot products. Sixteen horizontal sums would take ~7 each.
inline __m512 sums16(const __m512* a) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; i++) {  // per 128-bit lane: a[2i] at 0 and 2, a[2i+1] at 1 and 3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; i++) {  // per 128-bit lane: a[4i..4i+3] once each
    __m512 x = pairs[2 * i], y = pairs[2 * i + 1];
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; i++) {  // lanes: a[8i..8i+3] twice, then a[8i+4..8i+7] twice
    __m512 x = quads[2 * i], y = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

inline vf vexp(vf x) {  // e^x for x <= 0 (scores minus their maximum). Rel. error ~1e-7.
  x = x < -87.0f ? -87.0f : x;
  vf n = x * 1.44269504f + 12582912.0f - 12582912.0f;  // round(x / ln 2)
  vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
  vf p = 1.0f / 720 + r * (1.0f / 5040);
  p = 1.0f / 120 + r * p;
  p = 1.0f / 24 + r * p;
  p = 1.0f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  vi pb;  // p · 2^n, by adding n to the exponent bits.
  std::memcpy(&pb, &p, sizeof p);
  pb += __builtin_convertvector(n, vi) << 23;
  std::memcpy(&p, &pb, sizeof p);
  return p;
}

}  // namespace picollama_vectors
