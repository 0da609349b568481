// Paged attention for CPUs over a 16/32-bit KV cache, for every kind of query row a step holds: prefill rows (causal,
// each row sees its own prefix), chunked-prefill rows after cached context, and decode rows of many sequences.
//
// q [R, H, D]; k/v cache [KVH, S, D] (one layer, head-major, slot = block * block_size + offset);
// block_tables int32 [NS, MB] (sequence s's token t lives in slot block_tables[s, t / bs] * bs + t % bs);
// row_seq int32 [R] (the sequence of query row r), row_len int32 [R] (row r attends to tokens 0 .. row_len[r] - 1
// of its sequence: a causal prefill row at position p has row_len p + 1) → out [R, H, D] in q's dtype.
// Scores, softmax and the weighted sum of values in float32 (softmax: max-subtracted exp, one division);
// the query heads of a grouped-query group share each load of their KV head's keys and values.
//
// Work items are (row, KV head) pairs, ordered so that the long and the short rows of a causal prefill alternate
// (a contiguous split of the items then gives each thread about the same work). With AVX-512 the key and value rows
// are converted to float32 16 lanes at a time and exp is a degree-6 polynomial with scalef (about 2 ulp); other
// builds use the portable loop.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include "avx512_math.h"
#define LT_ATTN_AVX512 1
#else
#define LT_ATTN_AVX512 0
#endif

namespace {

// The cache slot of token t of a sequence whose block table is `table` (blocks of bs tokens).
inline int64_t slot_of(const int32_t* table, int64_t t, int64_t bs) {
  return static_cast<int64_t>(table[t / bs]) * bs + t % bs;
}

constexpr int64_t kBlockRows = 16;    // prefill rows that share each transposed key tile
constexpr int64_t kMinTiledRows = 4;  // fewer rows: one dot product per token and head

#if LT_ATTN_AVX512
using namespace lt_avx512;
constexpr int kMaxGroup = 16;   // query heads per KV head handled in registers
constexpr int kMaxChunks = 16;  // head_dim up to 256

// Scores of one row's g query heads over its n tokens: sc[gi * lda + t] = scale * q_gi . k_t (one dot product per
// token and head, reduced across lanes).
template <typename T>
void qk_row(const T* q, const T* kp, const int32_t* table, int64_t bs, int64_t n, int64_t g, int64_t d, int64_t s_all,
            int64_t hk, float scale, float* sc, int64_t lda) {
  const int64_t chunks = d / 16;
  __m512 qv[kMaxGroup][kMaxChunks];
  for (int64_t gi = 0; gi < g; ++gi)
    for (int64_t c = 0; c < chunks; ++c) qv[gi][c] = _mm512_mul_ps(load16(q + gi * d + 16 * c), _mm512_set1_ps(scale));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slot_of(table, t, bs);
    const T* kr = kp + (hk * s_all + slot) * d;
    __m512 kv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(kr + 16 * c);
    for (int64_t gi = 0; gi < g; ++gi) {
      __m512 a = _mm512_mul_ps(qv[gi][0], kv[0]);
      for (int64_t c = 1; c < chunks; ++c) a = _mm512_fmadd_ps(qv[gi][c], kv[c], a);
      sc[gi * lda + t] = _mm512_reduce_add_ps(a);
    }
  }
}

// P row-heads at once against a transposed key tile kt [d][16]: acc[p] = sum_c qs[p][c] * kt[c] (16 tokens per vector,
// no cross-lane reduction), stored to sc[p * lda + t0 ..].
template <int P>
inline void qk_tile_heads(const float* qs, int64_t d, const float* kt, float* sc, int64_t lda, int64_t t0) {
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m512 kv = _mm512_loadu_ps(kt + 16 * c);
    for (int p = 0; p < P; ++p) acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(qs[p * d + c]), kv, acc[p]);
  }
  for (int p = 0; p < P; ++p) _mm512_storeu_ps(sc + p * lda + t0, acc[p]);
}

inline void qk_tile(int64_t heads, const float* qs, int64_t d, const float* kt, float* sc, int64_t lda, int64_t t0) {
  int64_t p = 0;
  for (; p + 8 <= heads; p += 8) qk_tile_heads<8>(qs + p * d, d, kt, sc + p * lda, lda, t0);
  switch (heads - p) {
    case 7: qk_tile_heads<7>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 6: qk_tile_heads<6>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 5: qk_tile_heads<5>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 4: qk_tile_heads<4>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 3: qk_tile_heads<3>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 2: qk_tile_heads<2>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    case 1: qk_tile_heads<1>(qs + p * d, d, kt, sc + p * lda, lda, t0); break;
    default: break;
  }
}

// Scores of nb consecutive rows of one sequence (a prefill block; row i sees n_i tokens) for the g query heads of KV
// head hk: every 16-token key tile is converted and transposed once and shared by all nb * g row-heads.
// sc[(i * g + gi) * lda + t]; q rows nb x [h, d] (row stride qstride).
template <typename T>
void qk_block(const T* q, int64_t qstride, int64_t nb, int64_t n_max, const T* kp, const int32_t* table, int64_t bs,
              int64_t g, int64_t d, int64_t s_all, int64_t hk, float scale, float* sc, int64_t lda, float* qs,
              float* kt, float* tmp) {
  const int64_t chunks = d / 16;
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t gi = 0; gi < g; ++gi)
      for (int64_t c = 0; c < chunks; ++c)
        _mm512_storeu_ps(qs + (i * g + gi) * d + 16 * c,
                         _mm512_mul_ps(load16(q + i * qstride + gi * d + 16 * c), _mm512_set1_ps(scale)));
  alignas(64) int32_t idx[16];
  for (int j = 0; j < 16; ++j) idx[j] = static_cast<int32_t>(j * d);
  const __m512i vidx = _mm512_load_si512(idx);
  for (int64_t t0 = 0; t0 < n_max; t0 += 16) {
    const int64_t tt = std::min<int64_t>(16, n_max - t0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j < tt) {
        const int64_t slot = slot_of(table, t0 + j, bs);
        const T* kr = kp + (hk * s_all + slot) * d;
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(tmp + j * d + 16 * c, load16(kr + 16 * c));
      } else {
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(tmp + j * d + 16 * c, _mm512_setzero_ps());
      }
    }
    for (int64_t c = 0; c < d; ++c) _mm512_storeu_ps(kt + 16 * c, _mm512_i32gather_ps(vidx, tmp + c, 4));
    qk_tile(nb * g, qs, d, kt, sc, lda, t0);
  }
}

// exp(s - max) of one row-head's n scores in place, zero from n up to the next multiple of 16; returns 1 / sum.
inline float softmax_exp(float* s, int64_t n) {
  const int64_t w16 = ((n + 15) / 16) * 16;
  for (int64_t t = n; t < w16; ++t) s[t] = -std::numeric_limits<float>::infinity();
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < w16; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < w16; t += 16) {
    const __mmask16 valid = t + 16 <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1u);
    const __m512 em = _mm512_maskz_mov_ps(valid, exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + t), m)));
    _mm512_storeu_ps(s + t, em);
    sum = _mm512_add_ps(sum, em);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Softmax of one row-head's n scores in place, normalized (probabilities), zero from n up to width.
inline void softmax_probs(float* s, int64_t n, int64_t width) {
  const int64_t w16 = ((n + 15) / 16) * 16;
  const __m512 inv = _mm512_set1_ps(softmax_exp(s, n));
  for (int64_t t = 0; t < w16; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  for (int64_t t = w16; t < width; ++t) s[t] = 0.f;
}

// R row-heads' probabilities (rows of probs, stride lda) times the values vf [n, 16 * C] (float32): each value row
// is loaded once for the R row-heads, accumulators stay in registers. out[r] = row-head r's [16 * C] result.
template <int R, int C, typename T>
void pv_group(const float* probs, int64_t lda, const float* vf, int64_t n, T* const* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vf + t * 16 * C + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * lda + t]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(out[r] + 16 * c, acc[r][c]);
}

// Softmax and P x V for a prefill block (nb rows of one sequence, g heads each; scores in sc[(i * g + gi) * lda]):
// the block's values are converted to float32 once, then row-heads go through pv_group R at a time. Head dims of 64
// and 128 (C = 4, 8); returns false for others (the caller then runs softmax_pv row by row).
template <typename T>
bool softmax_pv_block(const T* vp, const int32_t* table, int64_t bs, const int32_t* lens, int64_t nb, int64_t g,
                      int64_t d, int64_t s_all, int64_t hk, float* sc, int64_t lda, T* out, int64_t out_row_stride,
                      std::vector<float>& vf) {
  if (d != 64 && d != 128) return false;
  const int64_t n_max = lens[nb - 1];
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t gi = 0; gi < g; ++gi) softmax_probs(sc + (i * g + gi) * lda, lens[i], lda);
  vf.resize(static_cast<size_t>(n_max * d));
  for (int64_t t = 0; t < n_max; ++t) {
    const int64_t slot = slot_of(table, t, bs);
    const T* vr = vp + (hk * s_all + slot) * d;
    for (int64_t c = 0; c < d / 16; ++c) _mm512_storeu_ps(vf.data() + t * d + 16 * c, load16(vr + 16 * c));
  }
  const int64_t heads = nb * g;
  const int R = d == 64 ? 6 : 3;
  T* outs[8];
  for (int64_t p0 = 0; p0 < heads; p0 += R) {
    const int64_t cnt = std::min<int64_t>(R, heads - p0);
    for (int64_t r = 0; r < cnt; ++r) {
      const int64_t i = (p0 + r) / g, gi = (p0 + r) % g;
      outs[r] = out + i * out_row_stride + gi * d;
    }
    const int64_t n = lens[(p0 + cnt - 1) / g];  // the group's longest row (rows grow by one token each)
    const float* pr = sc + p0 * lda;
    if (d == 64) {
      switch (cnt) {
        case 6: pv_group<6, 4>(pr, lda, vf.data(), n, outs); break;
        case 5: pv_group<5, 4>(pr, lda, vf.data(), n, outs); break;
        case 4: pv_group<4, 4>(pr, lda, vf.data(), n, outs); break;
        case 3: pv_group<3, 4>(pr, lda, vf.data(), n, outs); break;
        case 2: pv_group<2, 4>(pr, lda, vf.data(), n, outs); break;
        default: pv_group<1, 4>(pr, lda, vf.data(), n, outs); break;
      }
    } else {
      switch (cnt) {
        case 3: pv_group<3, 8>(pr, lda, vf.data(), n, outs); break;
        case 2: pv_group<2, 8>(pr, lda, vf.data(), n, outs); break;
        default: pv_group<1, 8>(pr, lda, vf.data(), n, outs); break;
      }
    }
  }
  return true;
}

// Softmax over each head's n scores (sc[gi * lda ..]) and the weighted sum of the values, for one row.
template <typename T>
void softmax_pv(const T* vp, const int32_t* table, int64_t bs, int64_t n, int64_t g, int64_t d, int64_t s_all,
                int64_t hk, float* sc, int64_t lda, T* out) {
  const int64_t chunks = d / 16;
  float inv[kMaxGroup];
  for (int64_t gi = 0; gi < g; ++gi) inv[gi] = softmax_exp(sc + gi * lda, n);
  __m512 acc[kMaxGroup][kMaxChunks];
  for (int64_t gi = 0; gi < g; ++gi)
    for (int64_t c = 0; c < chunks; ++c) acc[gi][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slot_of(table, t, bs);
    const T* vr = vp + (hk * s_all + slot) * d;
    __m512 vv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) vv[c] = load16(vr + 16 * c);
    for (int64_t gi = 0; gi < g; ++gi) {
      const __m512 p = _mm512_set1_ps(sc[gi * lda + t]);
      for (int64_t c = 0; c < chunks; ++c) acc[gi][c] = _mm512_fmadd_ps(p, vv[c], acc[gi][c]);
    }
  }
  for (int64_t gi = 0; gi < g; ++gi)
    for (int64_t c = 0; c < chunks; ++c)
      store16(out + gi * d + 16 * c, _mm512_mul_ps(acc[gi][c], _mm512_set1_ps(inv[gi])));
}
#endif

// The portable definition (any head_dim, builds without AVX-512).
template <typename T>
void attend_portable(const T* q, const T* kp, const T* vp, const int32_t* table, int64_t bs, int64_t n, int64_t g,
                     int64_t d, int64_t s_all, int64_t hk, float scale, float* sc, T* out, int64_t out_head_stride) {
  std::vector<float> qf(static_cast<size_t>(g * d)), acc(static_cast<size_t>(g * d), 0.f);
  for (int64_t i = 0; i < g * d; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = slot_of(table, t, bs);
    const T* kr = kp + (hk * s_all + slot) * d;
    for (int64_t gi = 0; gi < g; ++gi) {
      float a = 0.f;
      for (int64_t c = 0; c < d; ++c) a += qf[gi * d + c] * static_cast<float>(kr[c]);
      sc[gi * n + t] = a;
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    float* s = sc + gi * n;
    const float mx = *std::max_element(s, s + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = slot_of(table, t, bs);
      const T* vr = vp + (hk * s_all + slot) * d;
      for (int64_t c = 0; c < d; ++c) acc[gi * d + c] += s[t] * static_cast<float>(vr[c]);
    }
    for (int64_t c = 0; c < d; ++c) out[gi * out_head_stride + c] = static_cast<T>(acc[gi * d + c] * inv);
  }
}

}  // namespace

at::Tensor lt_paged_attention(const at::Tensor& q_in, const at::Tensor& kc, const at::Tensor& vc,
                              const at::Tensor& tables_in, int64_t block_size, const at::Tensor& row_seq_in,
                              const at::Tensor& row_len_in, double scale) {
  const at::Tensor q = q_in.contiguous(), tables = tables_in.to(at::kInt).contiguous(),
                   row_seq = row_seq_in.to(at::kInt).contiguous(), row_len = row_len_in.to(at::kInt).contiguous();
  TORCH_CHECK(q.dim() == 3, "q must be [R, H, D]");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 && vc.sizes() == kc.sizes(),
              "k/v cache must be contiguous [KVH, S, D] of the same shape");
  TORCH_CHECK(kc.scalar_type() == q.scalar_type() && vc.scalar_type() == q.scalar_type(), "cache dtype must equal q's");
  const int64_t r_all = q.size(0), h = q.size(1), d = q.size(2), kvh = kc.size(0), s_all = kc.size(1);
  TORCH_CHECK(kc.size(2) == d && h % kvh == 0, "q has ", h, " heads of ", d, ", the cache ", kvh, " of ", kc.size(2));
  TORCH_CHECK(tables.dim() == 2 && row_seq.numel() == r_all && row_len.numel() == r_all, "shape mismatch");
  TORCH_CHECK(block_size >= 1 && s_all % block_size == 0, "block_size must divide the cache's slots");
  const int64_t g = h / kvh, ns = tables.size(0), mb = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* rs = row_seq.data_ptr<int32_t>();
  const int32_t* rl = row_len.data_ptr<int32_t>();
  int64_t max_len = 1;
  for (int64_t r = 0; r < r_all; ++r) {
    TORCH_CHECK(rs[r] >= 0 && rs[r] < ns, "row ", r, ": sequence index ", rs[r], " out of range");
    TORCH_CHECK(rl[r] >= 1 && rl[r] <= mb * block_size, "row ", r, ": context length ", rl[r], " out of range");
    const int32_t* row_table = tp + rs[r] * mb;
    for (int64_t b = 0; b < (rl[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(row_table[b] >= 0 && (row_table[b] + 1) * block_size <= s_all, "row ", r, ": block ",
                  row_table[b], " out of range");
    max_len = std::max<int64_t>(max_len, rl[r]);
  }
  // work units: runs of up to kBlockRows consecutive rows of one sequence at consecutive positions (a prefill),
  // each row alone otherwise (decode)
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < r_all; ++r) {
    if (starts.empty() || r - starts.back() >= kBlockRows || rs[r] != rs[r - 1] || rl[r] != rl[r - 1] + 1)
      starts.push_back(r);
  }
  const int64_t blocks = static_cast<int64_t>(starts.size());
  starts.push_back(r_all);
  auto out = at::empty_like(q);
  const int64_t items = blocks * kvh;
  const int64_t lda_max = ((max_len + 15) / 16) * 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "lt_paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> sc;
      std::vector<float> work;
      std::vector<float> vf;
      for (int64_t i = i0; i < i1; ++i) {
        // alternate the two ends of the block list: blocks of a causal prefill grow in cost with their index
        const int64_t k = i / kvh, hk = i % kvh;
        const int64_t blk = (k % 2 == 0) ? k / 2 : blocks - 1 - k / 2;
        const int64_t r0 = starts[blk], nb = starts[blk + 1] - r0;
        const int32_t* table = tp + rs[r0] * mb;
        const float sc_f = static_cast<float>(scale);
#if LT_ATTN_AVX512
        if constexpr (!std::is_same_v<scalar_t, double>) {
          if (d % 16 == 0 && d <= 16 * kMaxChunks && g <= kMaxGroup) {
            const int64_t n_max = rl[r0 + nb - 1];
            const int64_t lda = ((n_max + 15) / 16) * 16;
            sc.resize(static_cast<size_t>(nb * g * lda));
            if (nb >= kMinTiledRows) {
              work.resize(static_cast<size_t>(nb * g * d + 32 * d + 16));
              qk_block<scalar_t>(qp + (r0 * h + hk * g) * d, h * d, nb, n_max, kp, table, block_size, g, d, s_all,
                                 hk, sc_f, sc.data(), lda, work.data(), work.data() + nb * g * d,
                                 work.data() + nb * g * d + 16 * d);
              if (softmax_pv_block<scalar_t>(vp, table, block_size, rl + r0, nb, g, d, s_all, hk, sc.data(), lda,
                                             op + (r0 * h + hk * g) * d, h * d, vf))
                continue;
            } else {
              for (int64_t j = 0; j < nb; ++j)
                qk_row<scalar_t>(qp + ((r0 + j) * h + hk * g) * d, kp, table, block_size, rl[r0 + j], g, d, s_all,
                                 hk, sc_f, sc.data() + j * g * lda, lda);
            }
            for (int64_t j = 0; j < nb; ++j)
              softmax_pv<scalar_t>(vp, table, block_size, rl[r0 + j], g, d, s_all, hk, sc.data() + j * g * lda, lda,
                                   op + ((r0 + j) * h + hk * g) * d);
            continue;
          }
        }
#endif
        sc.resize(static_cast<size_t>(g * lda_max));
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t r = r0 + j;
          attend_portable<scalar_t>(qp + (r * h + hk * g) * d, kp, vp, table, block_size, rl[r], g, d, s_all, hk,
                                    sc_f, sc.data(), op + (r * h + hk * g) * d, d);
        }
      }
    });
  });
  return out;
}
