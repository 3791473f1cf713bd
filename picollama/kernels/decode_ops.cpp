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

#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace picollama_vectors;

constexpr int MAX_GROUP = 8;  // Most query heads per KV head (GQA's group).
constexpr int BLOCK = 64;      // Value rows per block. 4-16 KB at head_dim 64 stays in L1.

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
