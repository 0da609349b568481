// Mixture-of-Experts routing on CPUs: a sparse MLP block's router logits, softmax and top-k in one call, as
// transformers' Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral blocks compute them in bfloat16:
//   logits = bf16(x @ router.T)                  (router float32 [E, H] holding the checkpoint's 16-bit values; the
//                                                 dot products in float32, then rounded once to bfloat16)
//   p = softmax(logits) in float32;  top-k of p (largest first; equal values: the lower expert id first)
//   w = p[top-k] / sum(p[top-k]) when norm_topk_prob, else p[top-k]; rounded to bfloat16
// moe_route(x bfloat16 [T, H], router float32 [E, H], top_k, norm_topk_prob, logits float32 [T, E] or None)
//   -> (topk_weights bfloat16 [T, k], topk_ids int32 [T, k]).
// With ``logits`` given (a caller's float32 GEMM for many rows) the dot products are skipped; they are rounded to
// bfloat16 the same way. The selection compares the rounded logits (softmax is monotonic), so the routing of a token
// is the same whichever path computed its logits, up to the float32 summation order of its dot products.
// Work split: the experts' rows of the router over the threads (T <= 16 rows share each router row read).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

// float32 dot product of n values (four 16-lane partial sums where AVX-512 is compiled in)
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; i + 64 <= n; i += 64)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * u), _mm512_loadu_ps(b + i + 16 * u), acc[u]);
  for (; i + 16 <= n; i += 16) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc[0]);
  s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lt_moe_route(const at::Tensor& x_in, const at::Tensor& router_in, int64_t top_k,
                                                bool norm_topk_prob, const c10::optional<at::Tensor>& logits_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "moe_route: x must be a CPU bfloat16 [T, H], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(router_in.dim() == 2 && router_in.scalar_type() == at::kFloat && router_in.size(1) == x_in.size(1),
              "moe_route: router must be float32 [E, H] with H = ", x_in.size(1), ", got ", router_in.scalar_type(),
              " ", router_in.sizes());
  const int64_t T = x_in.size(0), H = x_in.size(1), E = router_in.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k must be in [1, ", E, "], got ", top_k);
  std::vector<float> logits(static_cast<size_t>(T * E));
  if (logits_in.has_value()) {
    const at::Tensor l = logits_in->to(at::kFloat).contiguous();
    TORCH_CHECK(l.dim() == 2 && l.size(0) == T && l.size(1) == E, "moe_route: logits must be [T=", T, ", E=", E,
                "], got ", l.sizes());
    const float* lp = l.data_ptr<float>();
    for (int64_t i = 0; i < T * E; ++i) logits[i] = round_bf16(lp[i]);
  } else {
    const at::Tensor x = x_in.to(at::kFloat).contiguous(), r = router_in.contiguous();
    const float* xp = x.data_ptr<float>();
    const float* rp = r.data_ptr<float>();
    at::parallel_for(0, E, 8, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        const float* re = rp + e * H;
        for (int64_t t = 0; t < T; ++t) logits[t * E + e] = round_bf16(dot(xp + t * H, re, H));
      }
    });
  }
  auto weights = at::empty({T, top_k}, x_in.options());
  auto ids = at::empty({T, top_k}, x_in.options().dtype(at::kInt));
  at::BFloat16* wp = weights.data_ptr<at::BFloat16>();
  int32_t* ip = ids.data_ptr<int32_t>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(static_cast<size_t>(E));
    std::vector<int32_t> sel(static_cast<size_t>(top_k));
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = logits.data() + t * E;
      const float m = *std::max_element(l, l + E);
      float s = 0.f;
      for (int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(l[e] - m));
      for (int64_t e = 0; e < E; ++e) p[e] /= s;
      // top-k by insertion: larger first, equal values keep the lower id first
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) {
        if (n == top_k && !(l[e] > l[sel[n - 1]])) continue;
        int64_t j = n < top_k ? n++ : n - 1;
        while (j > 0 && l[e] > l[sel[j - 1]]) {
          sel[j] = sel[j - 1];
          --j;
        }
        sel[j] = static_cast<int32_t>(e);
      }
      float tot = 0.f;
      for (int64_t j = 0; j < top_k; ++j) tot += p[sel[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        ip[t * top_k + j] = sel[j];
        wp[t * top_k + j] = c10::BFloat16(norm_topk_prob ? p[sel[j]] / tot : p[sel[j]]);
      }
    }
  });
  return {weights, ids};
}
