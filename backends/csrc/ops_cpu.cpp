// Fused CPU kernels for the per-token work of a decoder layer: one call instead of five to ten torch ops each.
//
// Numbers follow the torch reference ops of backends/torch_backend.py and backends/base.py: statistics and
// products in float32, results rounded to the tensor's dtype where the reference rounds (after each elementwise op).
// Reductions run in a different order than torch's, so 16-bit results may differ from the reference by one unit in
// the last place; float32 results by rounding only.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include "avx512_math.h"
#endif

namespace {

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }

// sum_j a[j] * b[j] in float32 over 16 independent lanes (vectorizable without reassociating a sum), then the lanes
// in a fixed order: the same result for the same inputs wherever it runs.
template <typename A, typename B>
inline float dot_lanes(const A* a, const B* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] += static_cast<float>(a[j + l]) * static_cast<float>(b[j + l]);
  for (; j < n; ++j) acc[j % 16] += static_cast<float>(a[j]) * static_cast<float>(b[j]);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  return s;
}

template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float ss = dot_lanes(x, x, n);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = rnd<T>(static_cast<float>(w[j]) * static_cast<float>(rnd<T>(static_cast<float>(x[j]) * r)));
  }
}

inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace

// x [T, H] (contiguous rows), weight [H] → [T, H] in x's dtype (RMSNorm, Zhang & Sennrich 2019)
at::Tensor lt_rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = weight_in.to(x_in.scalar_type()).contiguous();
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lt_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * h, wp, op + r * h, h, static_cast<float>(eps));
    });
  });
  return out;
}

// h = residual + x (rounded to the dtype), then rms_norm(h) → (normed, h)
std::tuple<at::Tensor, at::Tensor> lt_add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                   const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), w = weight_in.to(x_in.scalar_type()).contiguous();
  TORCH_CHECK(x.sizes() == res.sizes() && x.scalar_type() == res.scalar_type(), "x and residual must match");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto sum = at::empty_like(x), out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lt_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = res.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < h; ++j)
          sp[r * h + j] = rnd<scalar_t>(static_cast<float>(rp[r * h + j]) + static_cast<float>(xp[r * h + j]));
        rms_norm_row(sp + r * h, wp, op + r * h, h, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

namespace {

// silu(g) * u for the leading multiple of 16 elements (AVX-512 builds, not float64); returns how many were done
template <typename T>
int64_t silu_and_mul_lanes(const T* g, const T* u, T* o, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>) {
    using namespace lt_avx512;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 gv = load16(g + j);
      const __m512 e = exp_any(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      alignas(64) T s[16];
      store16(s, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store16(o + j, _mm512_mul_ps(load16(s), load16(u + j)));
    }
    return j;
  }
#endif
  return 0;
}

}  // namespace

// gate_up [T, 2I] (gate first) → silu(gate) * up [T, I] (SwiGLU, Shazeer 2020): silu rounded to the dtype, then the
// product rounded, as the torch ops F.silu(g) * u; with AVX-512 16 lanes at a time with its exp (about 2 ulp in float32).
at::Tensor lt_silu_and_mul(const at::Tensor& gu_in) {
  const at::Tensor gu = gu_in.contiguous();
  const int64_t two_i = gu.size(-1), inter = two_i / 2, rows = gu.numel() / two_i;
  auto sizes = gu.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "lt_silu_and_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(two_i), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* g = gp + r * two_i;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        int64_t j = silu_and_mul_lanes(g, u, o, inter);
        for (; j < inter; ++j) {
          const float gv = static_cast<float>(g[j]);
          const scalar_t s = rnd<scalar_t>(gv / (1.f + std::exp(-gv)));
          o[j] = rnd<scalar_t>(static_cast<float>(s) * static_cast<float>(u[j]));
        }
      }
    });
  });
  return out;
}

namespace {

// One head's rotate-half RoPE: out = x * cos + rotate_half(x) * sin, rounded to T after each op (as the torch ops)
template <typename T>
inline void rotate_row(const T* xr, const T* cr, const T* sr, T* orow, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float rot = j < half ? -static_cast<float>(xr[j + half]) : static_cast<float>(xr[j - half]);
    const T a = rnd<T>(static_cast<float>(xr[j]) * static_cast<float>(cr[j]));
    const T b = rnd<T>(static_cast<T>(rot) * static_cast<float>(sr[j]));
    orow[j] = rnd<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

}  // namespace

// Rotate-half RoPE (Su et al. 2021) of x [T, heads, D] (last dim contiguous, any row/head strides) with cos/sin
// [T, 1, D] in x's dtype → a new contiguous [T, heads, D]: x * cos + rotate_half(x) * sin, rounded after each op.
at::Tensor lt_rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with a contiguous last dim");
  const at::Tensor c = cos_in.to(x.scalar_type()).contiguous(), s = sin_in.to(x.scalar_type()).contiguous();
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(c.numel() == t * d && s.numel() == t * d, "cos/sin must be [T, 1, D]");
  auto out = at::empty({t, heads, d}, x.options());
  const int64_t st = x.stride(0), sh = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lt_rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t * heads, grain_rows(d), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t ti = i / heads, hi = i % heads;
        const scalar_t* xr = xp + ti * st + hi * sh;
        const scalar_t* cr = cp + ti * d;
        const scalar_t* sr = sp + ti * d;
        scalar_t* orow = op + i * d;
        rotate_row(xr, cr, sr, orow, d);
      }
    });
  });
  return out;
}

// RoPE of q and k plus the KV-cache write in one call: q [T, H, D], k/v [T, KVH, D] (last dim contiguous, any row and
// head strides, e.g. views into the fused QKV output), cos/sin [T, 1, D]; the rotated keys and the values go to
// k_cache/v_cache [KVH, S, D] (one layer of a 16/32-bit paged cache) at slots int64 [T]; returns the rotated q
// [T, H, D] (contiguous). The same numbers as rotary() followed by PagedKVCache.write.
at::Tensor lt_rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos_in,
                              const at::Tensor& sin_in, const at::Tensor& kc, const at::Tensor& vc,
                              const at::Tensor& slots_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.stride(2) == 1 && k.stride(2) == 1 &&
              v.stride(2) == 1, "q [T, H, D], k/v [T, KVH, D] with a contiguous last dim");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 && vc.sizes() == kc.sizes(),
              "k/v cache must be contiguous [KVH, S, D]");
  TORCH_CHECK(kc.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type() &&
              v.scalar_type() == q.scalar_type(), "q, k, v and the cache must share a dtype");
  const int64_t t = q.size(0), heads = q.size(1), d = q.size(2), kvh = k.size(1), s_all = kc.size(1);
  TORCH_CHECK(k.size(0) == t && k.size(2) == d && kc.size(0) == kvh && kc.size(2) == d, "shape mismatch");
  const at::Tensor c = cos_in.to(q.scalar_type()).contiguous(), sn = sin_in.to(q.scalar_type()).contiguous(),
                   slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(c.numel() == t * d && sn.numel() == t * d && slots.numel() == t, "cos/sin [T, 1, D], slots [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sl[i] >= 0 && sl[i] < s_all, "slot ", sl[i], " out of range");
  auto out = at::empty({t, heads, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "lt_rotary_kv_write", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = sn.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* kcp = kc.data_ptr<scalar_t>();
    scalar_t* vcp = vc.data_ptr<scalar_t>();
    const int64_t per = heads + kvh;
    at::parallel_for(0, t * per, grain_rows(d), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t ti = i / per, hi = i % per;
        const scalar_t* cr = cp + ti * d;
        const scalar_t* sr = sp + ti * d;
        if (hi < heads) {
          rotate_row(qp + ti * q.stride(0) + hi * q.stride(1), cr, sr, op + (ti * heads + hi) * d, d);
        } else {
          const int64_t hk = hi - heads;
          const int64_t dst = (hk * s_all + sl[ti]) * d;
          rotate_row(kp + ti * k.stride(0) + hk * k.stride(1), cr, sr, kcp + dst, d);
          const scalar_t* vr = vp + ti * v.stride(0) + hk * v.stride(1);
          std::copy(vr, vr + d, vcp + dst);
        }
      }
    });
  });
  return out;
}
