// One-token attention over a KV cache for the compiled CPU decode step (picollama/inference.py):
// torch.ops.picollama.decode_attention(q, k_cache, v_cache, length) -> (B, H, D) float32.
// Written by hand because no maintained CPU kernel reads a long cache at the memory's speed at
// batch 1 (measured in docs/performance.md): each KV head's keys and values are read once for its
// whole query group, in L1-sized blocks, with fp32 accumulation; long caches are split in chunks
// over the threads and merged by their softmax maxima (flash-decoding).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// One vector register of floats: 16 with AVX-512, else 8 (AVX2; GCC lowers wider generic vectors
// on AVX2 through memory: 10x slower)
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
constexpr int MAX_GROUP = 8;  // query heads a KV head (GQA's group) at most

inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline vf load(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
#ifdef __AVX512F__  // what GCC 12 makes of the generic code splits the widening in halves
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

inline float hsum(vf a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(a));
#else
  float s = 0;
  for (int i = 0; i < W; i++) s += a[i];
  return s;
#endif
}

inline vf vexp(vf x) {  // e^x for x <= 0 (scores minus their maximum), rel. error ~1e-7
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
  vi pb;  // p · 2^n: n added to the exponent bits
  std::memcpy(&pb, &p, sizeof p);
  pb += __builtin_convertvector(n, vi) << 23;
  std::memcpy(&p, &pb, sizeof p);
  return p;
}

// One chunk [t0, t1) of one KV head for its G <= MAX_GROUP queries q (G, C·W, pre-scaled fp32):
// the chunk's softmax maxima m (G), sums l (G) and unnormalized outputs acc (G, C·W). Each key and
// value row is read once, for every query of the group.
template <int C, typename T>
void chunk(const float* q, const T* k, const T* v, int64_t t0, int64_t t1, int G, float* m,
           float* l, float* acc, float* s) {
  const int64_t n = t1 - t0;
  constexpr int D = C * W;
  vf qv[MAX_GROUP][C], o[MAX_GROUP][C] = {};
  float top[MAX_GROUP];
  for (int g = 0; g < G; g++) {
    for (int c = 0; c < C; c++) qv[g][c] = load(q + g * D + c * W);
    top[g] = -INFINITY;
  }
  for (int64_t t = 0; t < n; t++) {
    const T* kt = k + (t0 + t) * D;
    vf row[C];
    for (int c = 0; c < C; c++) row[c] = load(kt + c * W);
    for (int g = 0; g < G; g++) {
      vf a = qv[g][0] * row[0];
      for (int c = 1; c < C; c++) a += qv[g][c] * row[c];
      const float x = hsum(a);
      s[g * n + t] = x;
      top[g] = x > top[g] ? x : top[g];
    }
  }
  for (int g = 0; g < G; g++) {
    float* sg = s + g * n;
    vf total = {};
    int64_t t = 0;
    for (; t + W <= n; t += W) {
      vf e = vexp(load(sg + t) - top[g]);
      std::memcpy(sg + t, &e, sizeof e);
      total += e;
    }
    l[g] = hsum(total);
    for (; t < n; t++) l[g] += sg[t] = std::exp(sg[t] - top[g]);
    m[g] = top[g];
  }
  for (int64_t t = 0; t < n; t++) {
    const T* vt = v + (t0 + t) * D;
    vf row[C];
    for (int c = 0; c < C; c++) row[c] = load(vt + c * W);
    for (int g = 0; g < G; g++) {
      const float p = s[g * n + t];
      for (int c = 0; c < C; c++) o[g][c] += p * row[c];
    }
  }
  for (int g = 0; g < G; g++) std::memcpy(acc + g * D, o[g], sizeof o[g]);
}

template <int C, typename T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length) {
  const int64_t B = q.size(0), H = q.size(1), KV = k.size(1), cap = k.size(2);
  constexpr int D = C * W;
  const int G = H / KV;
  const float scale = 1.0f / std::sqrt(float(D));
  at::Tensor qs = (q.to(at::kFloat) * scale).contiguous();
  // chunks of at least 256 tokens, enough of them for every thread
  const int64_t heads = B * KV;
  const int64_t want = (2 * at::get_num_threads() + heads - 1) / heads;
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
      const int64_t t0 = part * size, t1 = std::min(length, t0 + size);
      const int64_t offset = (b * KV + h) * cap * D;
      chunk<C, T>(qp + (b * H + h * G) * D, kp + offset, vp + offset, t0, t1, G,
                  &m[task * G], &l[task * G], &acc[task * G * D], s.data());
    }
  });
  at::Tensor out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
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
at::Tensor dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t n) {
  constexpr int U = 16 / W;  // vectors a 16 floats
  switch (q.size(2) / 16) {
    case 1: return attend<U, T>(q, k, v, n);
    case 2: return attend<2 * U, T>(q, k, v, n);
    case 3: return attend<3 * U, T>(q, k, v, n);
    case 4: return attend<4 * U, T>(q, k, v, n);
    case 5: return attend<5 * U, T>(q, k, v, n);
    case 6: return attend<6 * U, T>(q, k, v, n);
    case 7: return attend<7 * U, T>(q, k, v, n);
    case 8: return attend<8 * U, T>(q, k, v, n);
    default: TORCH_CHECK(false, "decode_attention: head_dim must be 16, 32, ..., 128");
  }
}

// q (B, H, D); k, v (B' >= B, KV, capacity, D) contiguous, float32 or bfloat16; attends to the
// first `length` positions.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t length) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes(), "decode_attention: shapes");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.dtype() == v.dtype(),
              "decode_attention: contiguous caches of one dtype");
  TORCH_CHECK(q.size(2) == k.size(3) && q.size(2) % 16 == 0 && q.size(1) % k.size(1) == 0,
              "decode_attention: head_dim a multiple of 16, heads a multiple of KV heads");
  TORCH_CHECK(q.size(1) / k.size(1) <= MAX_GROUP, "decode_attention: at most 8 heads a KV head");
  TORCH_CHECK(length >= 1 && length <= k.size(2) && q.size(0) <= k.size(0),
              "decode_attention: length within the cache");
  if (k.scalar_type() == at::kBFloat16) return dispatch<c10::BFloat16>(q, k, v, length);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "decode_attention: float32 or bfloat16 caches");
  return dispatch<float>(q, k, v, length);
}

}  // namespace

TORCH_LIBRARY(picollama, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, SymInt length) -> Tensor");
}

TORCH_LIBRARY_IMPL(picollama, CPU, m) { m.impl("decode_attention", decode_attention); }
