// A prompt's chunk of queries attending over the KV cache, for sampling's prefill on a CPU.
// decode_ops.py builds it with decode_ops.cpp. prefill.py puts it in SDPA's place.
//
// prefill_attention(q, k, v, mask, bf16) -> (B, H, T, D) float32, as
// F.scaled_dot_product_attention with its default scale 1/sqrt(D):
//   q (B, H, T, D); k, v (B, KV, S, D), H a multiple of KV; float32 or bfloat16.
//   mask: bool (B or 1, T, S), true where a query sees a key. None: causal from the end, so
//   query t sees keys 0 .. S - T + t (a chunk after S - T cached positions; S = T is SDPA's
//   is_causal). A query that sees no key gives zeros, as SDPA does.
//   bf16: products take bf16 inputs, where the build has AVX512-BF16 (else fp32's, as without).
// Why not SDPA: its CPU flash kernel multiplies through MKL, which on AMD CPUs runs at less than
// half the speed of these tiles. A chunk of 156 queries after 1,409 kept positions (SmolLM2-135M)
// took 3.7 ms a layer through it on two Zen 5 cores, 1.5 ms here and 1.0 with bf16 products
// (docs/serving.md).
// How: each KV head's keys are transposed once, so a score tile holds ROWS queries by 2 vectors
// of keys, added up in fp32 registers over the head dimension. A tile of rows keeps its scores
// (ROWS x S floats) for an exact two-pass softmax. Values are then read row by row, for several
// query rows at once. Rows are a KV head's queries, its group's heads side by side, so that
// each key serves G heads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace picollama_vectors;

constexpr int ROWS = W == 16 ? 12 : 4;  // query rows of a score tile: 24 accumulators
constexpr int KEYS = 2 * W;            // keys of a score tile

template <typename Q>
struct Tile {  // up to ROWS query rows of one KV head
  const Q* q[ROWS];          // pre-scaled; rows past n repeat the last
  float* out[ROWS];          // null past n
  const bool* mask[ROWS];    // the row's mask over keys, or null
  int64_t limit[ROWS];       // the row sees no key from here on
  int n;
};

// Products as the kernel takes them. Q is float, or with bf16 products a pair: two bf16 in 32
// bits, the even element low, so that vdpbf16ps adds both products at once (twice fp32's rate).
// Each bf16 product is exact in fp32, and every sum is fp32's.
template <typename Q>
constexpr int PER = std::is_same_v<Q, float> ? 1 : 2;  // elements in a Q

inline vf madd(vf acc, float x, vf y) { return acc + x * y; }

#ifdef __AVX512BF16__
inline vf madd(vf acc, uint32_t x, vf y) {
  const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)));
  return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), xs,
                                               reinterpret_cast<__m512bh>(y)));
}
#endif

inline uint32_t pair_of(float even, float odd) {  // each rounded to nearest even
  return c10::BFloat16(even).x | static_cast<uint32_t>(c10::BFloat16(odd).x) << 16;
}

// Scores of the tile's rows against keys [j, j + KEYS): kt holds them transposed, (D / PER, KEYS).
// Sums run over 32 dimensions at a time in registers, then add up in s: shorter chains round
// less (one 64-long chain erred 1.9x as much at head_dim 64).
// Not inlined: GCC 12 then keeps the sums in registers. Inlined, it stored them every step.
template <typename Q>
__attribute__((noinline)) void score(const Tile<Q>& tile, const Q* kt, int64_t j, int D, float* s,
                                     int64_t ls) {
  constexpr int CHAIN = 32 / PER<Q>;
  for (int d0 = 0; d0 < D / PER<Q>; d0 += CHAIN) {
    vf acc[ROWS][2] = {};
    for (int d = d0; d < d0 + CHAIN; d++) {
      const vf k0 = load(kt + d * KEYS), k1 = load(kt + d * KEYS + W);
      for (int r = 0; r < ROWS; r++) {
        const Q x = tile.q[r][d];
        acc[r][0] = madd(acc[r][0], x, k0);
        acc[r][1] = madd(acc[r][1], x, k1);
      }
    }
    for (int r = 0; r < tile.n; r++) {
      float* out = s + r * ls + j;
      if (d0) {
        acc[r][0] += load(out);
        acc[r][1] += load(out + W);
      }
      std::memcpy(out, acc[r], sizeof acc[r]);
    }
  }
}

// Lanes where W bools are true, as a vector comparison's result.
inline vi seen(const bool* mask) {
  typedef uint8_t vb __attribute__((vector_size(W)));
  vb b;
  std::memcpy(&b, mask, sizeof b);
  return __builtin_convertvector(b, vi) != 0;
}

// Row s[0, end) of scores to probabilities: -inf where masked or at `limit` and past it.
// Returns 1 / their sum, 0 when the row sees no key.
inline float softmax(float* s, int64_t limit, int64_t end, const bool* mask) {
  vf tops = {};
  tops -= INFINITY;
  int64_t j = 0;
  for (; j + W <= limit; j += W) {
    vf x = load(s + j);
    if (mask) {
      x = seen(mask + j) ? x : -INFINITY;
      std::memcpy(s + j, &x, sizeof x);
    }
    tops = x > tops ? x : tops;
  }
  float top = hmax(tops);
  for (; j < limit; j++) {
    if (mask && !mask[j]) s[j] = -INFINITY;
    top = std::max(top, s[j]);
  }
  std::fill(s + limit, s + end, 0.0f);
  if (top == -INFINITY) {
    std::fill(s, s + limit, 0.0f);
    return 0.0f;
  }
  vf total = {};
  for (j = 0; j + W <= limit; j += W) {
    const vf x = load(s + j);
    const vf e = x == -INFINITY ? 0.0f : vexp(x - top);
    std::memcpy(s + j, &e, sizeof e);
    total += e;
  }
  float sum = hsum(total);
  for (; j < limit; j++) sum += s[j] = std::exp(s[j] - top);
  return 1.0f / sum;
}

// Row p[0, end) of probabilities as bf16 pairs in out, a zero after an odd end.
inline void pair_up(const float* p, int64_t end, uint32_t* out) {
  int64_t j = 0;
#ifdef __AVX512BF16__
  for (; j + 2 * W <= end; j += 2 * W) {
    const __m512bh h = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(load(p + j + W)),
                                           reinterpret_cast<__m512>(load(p + j)));
    std::memcpy(out + j / 2, &h, sizeof h);
  }
#endif
  for (; j < end; j += 2) out[j / 2] = pair_of(p[j], j + 1 < end ? p[j + 1] : 0.0f);
}

// Outputs of P rows: probabilities p (P rows of lp) times values v (steps rows of C·W), scaled.
// A step is a key, or with bf16 products a pair of keys.
// Not inlined, as score().
template <int C, int P, typename Q>
__attribute__((noinline)) void weigh(const Q* p, int64_t lp, const Q* v, int64_t steps,
                                     float* const* out, const float* inverse, int n) {
  vf o[P][C] = {};
  for (int64_t j = 0; j < steps; j++) {
    vf row[C];
    for (int c = 0; c < C; c++) row[c] = load(v + j * C * W + c * W);
    for (int r = 0; r < P; r++) {
      const Q w = p[r * lp + j];
      for (int c = 0; c < C; c++) o[r][c] = madd(o[r][c], w, row[c]);
    }
  }
  for (int r = 0; r < n; r++) {
    for (int c = 0; c < C; c++) o[r][c] *= inverse[r];
    std::memcpy(out[r], o[r], sizeof o[r]);
  }
}

// p: the tile's probabilities as bf16 pairs (ROWS x ls / 2), with bf16 products.
template <int C, typename Q>
void attend_tile(const Tile<Q>& tile, const Q* kt, const Q* v, float* s, uint32_t* p,
                 int64_t ls) {
  constexpr int P = std::max(1, (W == 16 ? 24 : 8) / C);  // rows a pass over the values
  static_assert(ROWS % P == 0, "passes over the values cover the tile's rows");
  const int64_t end = *std::max_element(tile.limit, tile.limit + tile.n);
  for (int64_t j = 0; j < end; j += KEYS) score(tile, kt + j * C * W / PER<Q>, j, C * W, s, ls);
  float inverse[ROWS];
  for (int r = 0; r < tile.n; r++) {
    inverse[r] = softmax(s + r * ls, tile.limit[r], end, tile.mask[r]);
    if constexpr (PER<Q> == 2) pair_up(s + r * ls, end, p + r * ls / 2);
  }
  for (int r = 0; r < tile.n; r += P) {
    const int n = std::min(P, tile.n - r);
    if constexpr (PER<Q> == 2) {
      weigh<C, P>(p + r * ls / 2, ls / 2, v, (end + 1) / 2, tile.out + r, inverse + r, n);
    } else {
      weigh<C, P>(s + r * ls, ls, v, end, tile.out + r, inverse + r, n);
    }
  }
}

// Element d of a key or query, as Q: a float, or elements 2d and 2d + 1 as a bf16 pair.
template <typename Q, typename T>
inline Q element(const T* x, int64_t d) {
  if constexpr (PER<Q> == 1) {
    return static_cast<float>(x[d]);
  } else {
    return pair_of(static_cast<float>(x[2 * d]), static_cast<float>(x[2 * d + 1]));
  }
}

// One (batch row, KV head)'s keys, each score tile's transposed: (ld / KEYS, D / PER, KEYS) of
// Q, ld being S rounded up to whole tiles, the padding zeros. Its values in vq: (S, D) floats,
// or (S / 2 rounded up, D) pairs of keys, the last one's second zero for an odd S. Values that
// are float32 already are read in place. Returns the values.
template <typename Q, typename T>
const Q* widen(const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t h, int64_t ld, Q* kt,
               Q* vq) {
  const int64_t S = k.size(2), D = k.size(3), E = D / PER<Q>;
  const T* kp = k.const_data_ptr<T>() + b * k.stride(0) + h * k.stride(1);
  const T* vp = v.const_data_ptr<T>() + b * v.stride(0) + h * v.stride(1);
  std::fill(kt + S / KEYS * KEYS * E, kt + ld * E, Q{});
  for (int64_t j = 0; j < S; j++) {
    Q* column = kt + j / KEYS * KEYS * E + j % KEYS;
    for (int64_t d = 0; d < E; d++) column[d * KEYS] = element<Q>(kp + j * D, d);
  }
  if constexpr (std::is_same_v<T, Q>) {
    return vp;
  } else if constexpr (PER<Q> == 1) {
    for (int64_t j = 0; j < S * D; j++) vq[j] = static_cast<float>(vp[j]);
  } else {
    for (int64_t j = 0; j < S; j += 2) {
      for (int64_t d = 0; d < D; d++) {
        const float next = j + 1 < S ? static_cast<float>(vp[(j + 1) * D + d]) : 0.0f;
        vq[j / 2 * D + d] = pair_of(static_cast<float>(vp[j * D + d]), next);
      }
    }
  }
  return vq;
}

struct Limit {
  int64_t limit;  // the row sees no key from here on
  bool masked;    // and some before it, as its mask says
};

// Each mask row's limit: causal from the end without a mask. A row whose mask is true up to some
// key and false after it (a causal mask's) needs no masking inside its limit.
std::vector<Limit> row_limits(const bool* mask, int64_t rows, int64_t T, int64_t S) {
  std::vector<Limit> limits(rows * T);
  for (int64_t i = 0; i < rows * T; i++) {
    if (!mask) {
      limits[i] = {S - T + i + 1, false};
      continue;
    }
    const bool* row = mask + i * S;
    const void* off = std::memchr(row, 0, S);
    const int64_t end = off ? static_cast<const bool*>(off) - row : S;
    const bool prefix = !std::memchr(row + end, 1, S - end);
    limits[i] = {prefix ? end : S, !prefix};
  }
  return limits;
}

template <int C, typename Q>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const bool* mask, int64_t mask_batch) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), KV = k.size(1), S = k.size(2);
  constexpr int D = C * W, E = D / PER<Q>;  // E: a key's elements of Q
  const int64_t G = H / KV, ld = (S + KEYS - 1) / KEYS * KEYS, SV = (S + PER<Q> - 1) / PER<Q>;
  const auto dtype = PER<Q> == 1 ? at::kFloat : at::kBFloat16;
  const at::Tensor qs = q.to(at::kFloat).mul(1.0 / std::sqrt(double(D))).to(dtype).contiguous();
  at::Tensor out = at::empty({B, H, T, D}, q.options().dtype(at::kFloat));
  const bool wide = k.scalar_type() == at::kFloat;
  std::vector<Q> kt(B * KV * E * ld), vals(wide && PER<Q> == 1 ? 0 : B * KV * SV * D);
  std::vector<const Q*> values(B * KV);
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      Q *kti = &kt[i * E * ld], *vi = vals.empty() ? nullptr : &vals[i * SV * D];
      values[i] = wide ? widen<Q, float>(k, v, i / KV, i % KV, ld, kti, vi)
                       : widen<Q, c10::BFloat16>(k, v, i / KV, i % KV, ld, kti, vi);
    }
  });
  const std::vector<Limit> limits = row_limits(mask, std::max<int64_t>(mask_batch, 1), T, S);
  // A task is a tile of one (batch row, KV head). Its rows go query by query, the group's heads
  // side by side. Tasks alternate from both ends, so each thread's range mixes short causal
  // rows with long ones.
  const int64_t rows = T * G, tiles = (rows + ROWS - 1) / ROWS;
  const Q* qp = reinterpret_cast<const Q*>(qs.const_data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KV * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(ROWS * ld);
    std::vector<uint32_t> p(PER<Q> == 2 ? ROWS * ld / 2 : 0);
    for (int64_t task = begin; task < end; task++) {
      const int64_t head = task / tiles, i = task % tiles;
      const int64_t b = head / KV, h = head % KV;
      const int64_t first = (i % 2 ? tiles - 1 - i / 2 : i / 2) * ROWS;
      Tile<Q> tile;
      tile.n = int(std::min<int64_t>(ROWS, rows - first));
      for (int r = 0; r < ROWS; r++) {
        const int64_t row = first + std::min(r, tile.n - 1), t = row / G;
        const int64_t offset = ((b * H + h * G + row % G) * T + t) * D;
        tile.q[r] = qp + offset / PER<Q>;
        tile.out[r] = r < tile.n ? op + offset : nullptr;
        const Limit& seen = limits[(mask_batch > 1 ? b : 0) * T + t];
        tile.mask[r] = seen.masked ? mask + ((mask_batch > 1 ? b : 0) * T + t) * S : nullptr;
        tile.limit[r] = seen.limit;
      }
      attend_tile<C>(tile, &kt[head * E * ld], values[head], s.data(), p.data(), ld);
    }
  });
  return out;
}

template <typename Q>
at::Tensor by_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const bool* mask, int64_t mask_batch) {
  constexpr int U = 16 / W;  // Vectors per 16 floats.
  switch (q.size(3) / 16 * (q.size(3) % 16 == 0)) {
    case 2: return attend<2 * U, Q>(q, k, v, mask, mask_batch);
    case 4: return attend<4 * U, Q>(q, k, v, mask, mask_batch);
    case 6: return attend<6 * U, Q>(q, k, v, mask, mask_batch);
    case 8: return attend<8 * U, Q>(q, k, v, mask, mask_batch);
    default: TORCH_CHECK(false, "prefill_attention: head_dim must be 32, 64, 96 or 128");
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, bool bf16) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "prefill_attention: float32 or bfloat16 keys and values of one dtype");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && v.stride(3) == 1 &&
                  v.stride(2) == v.size(3),
              "prefill_attention: each head's keys and values contiguous");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
              "prefill_attention: a KV head for every group of query heads");
  TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= k.size(2), "prefill_attention: T <= S");
  const bool* m = nullptr;
  int64_t mask_batch = 0;
  at::Tensor own;  // The mask as checked, contiguous.
  if (mask) {
    own = mask->contiguous();
    TORCH_CHECK(own.scalar_type() == at::kBool && own.dim() == 3 && own.size(1) == q.size(2) &&
                    own.size(2) == k.size(2) && (own.size(0) == 1 || own.size(0) == q.size(0)),
                "prefill_attention: a bool mask (B or 1, T, S)");
    m = own.const_data_ptr<bool>();
    mask_batch = own.size(0);
  }
#ifdef __AVX512BF16__
  if (bf16) return by_head_dim<uint32_t>(q, k, v, m, mask_batch);
#endif
  return by_head_dim<float>(q, k, v, m, mask_batch);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(picollama, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool bf16=False) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(picollama, CPU, m) { m.impl("prefill_attention", prefill_attention); }
