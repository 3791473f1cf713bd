// The compiled CPU decode step's own ops, for picollama/kernels/fused_step.py.
// decode_ops.py builds them.
//
// decode_attention(q, k_cache, v_cache, length, k_scale, v_scale) -> (B, H, D) float32.
// Each row's one query attends over the first `length` cached positions. Caches are float32,
// bfloat16 or int8. An int8 cache has one scale per token and head.
// It is written by hand. SDPA, Inductor's reductions, MKL's batched matmuls and FlexAttention
// all took 2-20x longer at batch 1 (docs/performance.md).
// Each KV head serves its whole query group. Scores take 16 keys at a time (AVX-512) and add up
// in fp32. Values are read a block at a time. Long caches are split into chunks over the
// threads, then merged by their maxima (flash-decoding).
//
// We include ATen's headers and torch/library.h, not torch/extension.h with all of torch and
// pybind11. So the build takes ~11 s instead of ~29 s on 2 cores.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <torch/library.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

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
constexpr int MAX_GROUP = 8;  // Most query heads per KV head (GQA's group).
constexpr int BLOCK = 64;      // Value rows per block. 4-16 KB at head_dim 64 stays in L1.

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

// One chunk [t0, t1) of one KV head, for its G <= MAX_GROUP queries q (G, C·W, pre-scaled fp32).
// It gives the chunk's softmax maxima m (G), sums l (G) and unnormalized outputs acc (G, C·W).
// Each key and value row is read once, for every query of the group. ks and vs are int8 rows'
// scales, else null.
template <int C, typename T>
void chunk(const float* q, const T* k, const T* v, const float* ks, const float* vs, int64_t t0,
           int64_t t1, int G, float* m, float* l, float* acc, float* s) {
  const int64_t n = t1 - t0;
  constexpr int D = C * W;
  vf qv[MAX_GROUP][C];
  float top[MAX_GROUP];
  for (int g = 0; g < G; g++) {
    for (int c = 0; c < C; c++) qv[g][c] = load(q + g * D + c * W);
    top[g] = -INFINITY;
  }
  int64_t t = 0;
#ifdef __AVX512F__
  for (; t + W <= n; t += W) {  // 16 keys at a time, summed by sums16
    for (int g = 0; g < G; g++) {
      __m512 a[W];
      for (int i = 0; i < W; i++) {
        const T* kt = k + (t0 + t + i) * D;
        vf dot = qv[g][0] * load(kt);
        for (int c = 1; c < C; c++) dot += qv[g][c] * load(kt + c * W);
        a[i] = reinterpret_cast<__m512>(dot);
      }
      vf x = reinterpret_cast<vf>(sums16(a));
      if (ks) x *= load(ks + t0 + t);
      std::memcpy(s + g * n + t, &x, sizeof x);
      top[g] = std::max(top[g], _mm512_reduce_max_ps(reinterpret_cast<__m512>(x)));
    }
  }
#endif
  for (; t < n; t++) {
    const T* kt = k + (t0 + t) * D;
    vf row[C];
    for (int c = 0; c < C; c++) row[c] = load(kt + c * W);
    for (int g = 0; g < G; g++) {
      vf a = qv[g][0] * row[0];
      for (int c = 1; c < C; c++) a += qv[g][c] * row[c];
      const float x = ks ? hsum(a) * ks[t0 + t] : hsum(a);
      s[g * n + t] = x;
      top[g] = x > top[g] ? x : top[g];
    }
  }
  for (int g = 0; g < G; g++) {
    float* sg = s + g * n;
    vf total = {};
    t = 0;
    for (; t + W <= n; t += W) {
      vf e = vexp(load(sg + t) - top[g]);
      std::memcpy(sg + t, &e, sizeof e);
      total += e;
    }
    l[g] = hsum(total);
    for (; t < n; t++) l[g] += sg[t] = std::exp(sg[t] - top[g]);
    m[g] = top[g];
  }
  // Values go BLOCK rows at a time, kept in L1. Each query's sums stay in registers.
  for (int g = 0; g < G; g++) std::memset(acc + g * D, 0, D * sizeof(float));
  for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
    const int64_t b1 = std::min(n, b0 + BLOCK);
    for (int g = 0; g < G; g++) {
      vf o[C];
      for (int c = 0; c < C; c++) o[c] = load(acc + g * D + c * W);
      for (int64_t t = b0; t < b1; t++) {
        const T* vt = v + (t0 + t) * D;
        const float p = vs ? s[g * n + t] * vs[t0 + t] : s[g * n + t];
        for (int c = 0; c < C; c++) o[c] += p * load(vt + c * W);
      }
      std::memcpy(acc + g * D, o, sizeof o);
    }
  }
}

template <int C, typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length,
                  const float* ks, const float* vs, const int64_t* lengths) {
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), cap = k.size(2);
  constexpr int D = C * W;
  const int G = H / KV;
  const float scale = 1.0f / std::sqrt(float(D));
  at::Tensor qs = q.to(at::kFloat).mul(scale).contiguous();
  // Chunks of at least 256 tokens, and enough of them for every thread.
  const int64_t heads = B * KV;
  const int64_t want = (2 * at::get_num_threads() + heads - 1) / heads;
  if (lengths) length = *std::max_element(lengths, lengths + B);
  const int64_t chunks = std::max<int64_t>(1, std::min(want, length / 256));
  const int64_t size = (length + chunks - 1) / chunks;
  std::vector<float> m(heads * chunks * G), l(heads * chunks * G), acc(heads * chunks * G * D);
  const float* qp = qs.data_ptr<float>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  at::parallel_for(0, heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(G * size);
    for (int64_t task = begin; task < end; task++) {
      const int64_t head = task / chunks, part = task % chunks;
      const int64_t b = head / KV, h = head % KV;
      const int64_t end = lengths ? lengths[b] : length;  // a chunk past it is empty
      const int64_t t0 = part * size, t1 = std::max(t0, std::min(end, t0 + size));
      const int64_t row = (b * KV + h) * cap, offset = row * D;
      chunk<C, T>(qp + (b * H + h * G) * D, kp + offset, vp + offset, ks ? ks + row : nullptr,
                  vs ? vs + row : nullptr, t0, t1, G, &m[task * G], &l[task * G],
                  &acc[task * G * D], s.data());
    }
  });
  at::Tensor out = q.new_empty({B, H, D}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t head = 0; head < heads; head++) {
    for (int g = 0; g < G; g++) {
      float top = -INFINITY, total = 0;
      for (int64_t part = 0; part < chunks; part++) {
        top = std::max(top, m[(head * chunks + part) * G + g]);
      }
      float* o = op + (head * G + g) * D;  // (b, kv head h, g) is query head h·G + g of row b
      std::fill(o, o + D, 0.0f);
      for (int64_t part = 0; part < chunks; part++) {
        const int64_t i = (head * chunks + part) * G + g;
        const float w = std::exp(m[i] - top);
        total += w * l[i];
        for (int d = 0; d < D; d++) o[d] += w * acc[i * D + d];
      }
      for (int d = 0; d < D; d++) o[d] /= total;
    }
  }
  return out;
}

template <typename T>
at::Tensor dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t n,
                    const int64_t* lengths, const float* ks = nullptr,
                    const float* vs = nullptr) {
  constexpr int U = 16 / W;  // Vectors per 16 floats.
  switch (q.size(2) / 16) {
    case 1: return attend<U, T>(q, k, v, n, ks, vs, lengths);
    case 2: return attend<2 * U, T>(q, k, v, n, ks, vs, lengths);
    case 3: return attend<3 * U, T>(q, k, v, n, ks, vs, lengths);
    case 4: return attend<4 * U, T>(q, k, v, n, ks, vs, lengths);
    case 5: return attend<5 * U, T>(q, k, v, n, ks, vs, lengths);
    case 6: return attend<6 * U, T>(q, k, v, n, ks, vs, lengths);
    case 7: return attend<7 * U, T>(q, k, v, n, ks, vs, lengths);
    case 8: return attend<8 * U, T>(q, k, v, n, ks, vs, lengths);
    default: TORCH_CHECK(false, "decode_attention: head_dim must be 16, 32, ..., 128");
  }
}

// q is (B, H, D). k and v are contiguous (B' >= B, KV, capacity, D). They are float32, bfloat16,
// or int8 with float32 scales k_scale, v_scale (B', KV, capacity). Rows attend to the first
// `length` positions. Given lengths (int64 (B,), each 1..capacity), row b attends to its first
// lengths[b] instead.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t length, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale,
                            const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: shapes");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dtype() == v.dtype(),
              "decode_attention: contiguous caches of one dtype");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(2) % 16 == 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: head_dim a multiple of 16, heads a multiple of KV heads");
  TORCH_CHECK(q.size(1) / k.size(1) <= MAX_GROUP, "decode_attention: at most 8 heads a KV head");
  TORCH_CHECK(length >= 1 && length <= k.size(2) && q.size(0) <= k.size(0),
              "decode_attention: length within the cache");
  const int64_t* rows = nullptr;
  at::Tensor own;  // The lengths as checked, contiguous int64.
  if (lengths) {
    own = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(own.dim() == 1 && own.size(0) == q.size(0), "decode_attention: a length a row");
    TORCH_CHECK(own.min().item<int64_t>() >= 1 && own.max().item<int64_t>() <= k.size(2),
                "decode_attention: lengths within the cache");
    rows = own.const_data_ptr<int64_t>();
  }
  if (k.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale && v_scale && k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->sizes() == k.sizes().slice(0, 3) &&
                    v_scale->sizes() == k_scale->sizes(),
                "decode_attention: int8 caches need float32 scales (batch, KV heads, capacity)");
    return dispatch<int8_t>(q, k, v, length, rows, k_scale->const_data_ptr<float>(),
                            v_scale->const_data_ptr<float>());
  }
  if (k.scalar_type() == at::kBFloat16) return dispatch<c10::BFloat16>(q, k, v, length, rows);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "decode_attention: float32, bfloat16 or int8");
  return dispatch<float>(q, k, v, length, rows);
}

// PyTorch's int4 kernel under our own name (inference.Int4Linear), so AOTInductor calls it as is.
// Its lowering of the aten op would make the group size a tensor constant. A step that reads the
// model's weights as user-managed constants is not given that constant.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                       const at::Tensor& scales_zeros) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros);
}

}  // namespace

TORCH_LIBRARY(picollama, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, SymInt length, Tensor? k_scale=None, "
      "Tensor? v_scale=None, Tensor? lengths=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(picollama, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("int4_linear", int4_linear);
}
