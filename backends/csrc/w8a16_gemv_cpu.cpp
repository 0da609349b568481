// Weight-only int8 GEMV for a few rows (the int8 lm_head of decode steps), bound in ext.cpp and used by
// backends/torch_backend.py: y[m, n] = bf16(s[n] * sum_k x[m, k] * q[n, k]) for bf16 x [M, K], int8 codes (symmetric,
// per output channel) and scales [N]. Threads split N. Two kernels:
//
// w8a16_tiles_gemv (AVX-512 VNNI; any M): the codes in the tiled layout q [N/4, K/32, 4, 32] (channel block b holds
// channels 4b .. 4b + 3; for each 32 inputs, their 4 x 32 codes are 128 contiguous bytes), so each thread reads one
// sequential stream (row-major codes give it four short interleaved streams, which the hardware prefetchers follow
// poorly when rows are 2 KB: in a one-off A/B of the same VNNI loop on both layouts, whose code was not kept, 23 vs
// 33 GB/s at 49,152 x 2,048 on the EPYC here; bench/lm_head.py compares this kernel with int8pack and w8a16_gemv). Each row of x is held as int16 fixed point,
// x ~ xs[m] * xq[m, k] with xs[m] = max_k |x[m, k]| / 32767 (15 bits: a bf16 x has 8 significant bits, so the
// rounding, at most xs / 2, is below a bf16 rounding for every element within 2^7 of the row's largest), and
// VPDPWSSD sums q (widened to int16 in registers, exact) x xq exactly in int32, two products per lane per
// instruction; the int32 sums move to float32 every 4,096 inputs (|sum| <= 256 x 128 x 32767 < 2^31 in between),
// and y = bf16(s[n] * xs[m] * sum). Two instructions per 32 weights per row; all rows of the call share each block
// of codes while it is in L1, four rows per pass. The sums are exact integers until the flush, so a row's result
// does not depend on the other rows of the call.
//
// w8a16_gemv (AVX-512 F/BW; 1-4 rows): row-major q [N, K]; the codes are widened to float32 (exact) and multiplied
// with x in float32 (vpmovsxbd + vcvtdq2ps + FMA, three instructions per 16 weights: bound by arithmetic), four
// channels at a time sharing each load of x; the sum is float32 and the scale is applied once per channel. The
// numbers torch's aten::_weight_int8pack_mm computes, faster at one row (bench/lm_head.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "avx512_math.h"
#define LT_W8_GEMV 1
#else
#define LT_W8_GEMV 0
#endif

bool has_w8_gemv() { return LT_W8_GEMV != 0; }

#if LT_W8_GEMV
namespace {

inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// channels [n0, n1) of R rows; xf float32 [R, K], K a multiple of 16
template <int R>
void w8_rows(const float* xf, const int8_t* q, const float* s, at::BFloat16* y, int64_t ldy, int64_t K, int64_t n0,
             int64_t n1) {
  constexpr int C = 4;
  int64_t n = n0;
  for (; n + C <= n1; n += C) {
    __m512 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
    const int8_t* w0 = q + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      __m512 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(xf + r * K + k);
      for (int c = 0; c < C; ++c) {
        const __m512 w = widen16(w0 + c * K + k);
        for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(w, xv[r], acc[c][r]);
      }
    }
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) y[r * ldy + n + c] = c10::BFloat16(_mm512_reduce_add_ps(acc[c][r]) * s[n + c]);
  }
  for (; n < n1; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 w = widen16(q + n * K + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xf + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[r]) * s[n]);
  }
}

#if defined(__AVX512VNNI__)
#define LT_W8_TILES 1
constexpr int64_t kFlush = 4096;  // inputs summed in int32 before the float32 accumulators take them

// rows [0, R) of xq int16 [*, K] against channel block qb ([K/32, 4, 32] codes of channels n .. n + 3)
template <int R>
void w8_tiles_block(const int16_t* xq, const float* xs, const int8_t* qb, const float* s, at::BFloat16* y,
                    int64_t ldy, int64_t K, int64_t n) {
  __m512 facc[4][R];
  for (int c = 0; c < 4; ++c)
    for (int r = 0; r < R; ++r) facc[c][r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
    const int64_t k1 = std::min(K, k0 + kFlush);
    __m512i acc[4][R];
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_si512();
    const int8_t* w = qb + k0 * 4;
    for (int64_t k = k0; k < k1; k += 32, w += 128) {
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(xq + r * K + k);
      for (int c = 0; c < 4; ++c) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
        for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpwssd_epi32(acc[c][r], wv, xv[r]);
      }
    }
    for (int c = 0; c < 4; ++c)
      for (int r = 0; r < R; ++r) facc[c][r] = _mm512_add_ps(facc[c][r], _mm512_cvtepi32_ps(acc[c][r]));
  }
  for (int c = 0; c < 4; ++c)
    for (int r = 0; r < R; ++r)
      y[r * ldy + n + c] = c10::BFloat16(_mm512_reduce_add_ps(facc[c][r]) * (s[n + c] * xs[r]));
}
#else
#define LT_W8_TILES 0
#endif

}  // namespace
#else
#define LT_W8_TILES 0
#endif

bool has_w8_tiles() { return LT_W8_TILES != 0; }

// x bfloat16 [M, K] → bfloat16 [M, N]; q int8 [N/4, K/32, 4, 32] (the layout above), scales [N]. Raises when built
// without AVX-512 VNNI.
at::Tensor w8a16_tiles_gemv(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 && x_in.size(0) >= 1,
              "w8a16_tiles_gemv: x must be a 2-D bfloat16 CPU tensor with rows, got ", x_in.scalar_type(), " ",
              x_in.sizes());
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 4 && q.size(2) == 4 &&
                  q.size(3) == 32 && q.is_contiguous(),
              "w8a16_tiles_gemv: q must be contiguous int8 [N/4, K/32, 4, 32], got ", q.scalar_type(), " ", q.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = q.size(0), N = NB * 4;
  TORCH_CHECK(q.size(1) * 32 == K, "w8a16_tiles_gemv: x has ", K, " columns but q has ", q.size(1) * 32);
  TORCH_CHECK(scales.numel() == N, "w8a16_tiles_gemv: scales must hold one value per output channel (", N, "), got ",
              scales.numel());
  auto y = at::empty({M, N}, x.options());
#if LT_W8_TILES
  // each row as int16 fixed point: x[m, k] ~ xs[m] * xq[m, k] (see the top of the file)
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sf = scales.to(at::kFloat).contiguous().view({N});
  auto xq16 = at::empty({M, K}, x.options().dtype(at::kShort));
  std::vector<float> xs(static_cast<size_t>(M));
  const float* xp = xf.data_ptr<float>();
  int16_t* xqp = xq16.data_ptr<int16_t>();
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[m * K + k]));
    xs[m] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t k = 0; k < K; ++k)
      xqp[m * K + k] = static_cast<int16_t>(std::nearbyint(std::min(32767.f, std::max(-32767.f, xp[m * K + k] * inv))));
  }
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* qb = qp + b * 4 * K;
      for (int64_t m = 0; m < M; m += 4) {  // the block's 4 x K codes stay in L1 across the row groups
        const int16_t* xm = xqp + m * K;
        switch (std::min<int64_t>(M - m, 4)) {
          case 4: w8_tiles_block<4>(xm, xs.data() + m, qb, sp, yp + m * N, N, K, 4 * b); break;
          case 3: w8_tiles_block<3>(xm, xs.data() + m, qb, sp, yp + m * N, N, K, 4 * b); break;
          case 2: w8_tiles_block<2>(xm, xs.data() + m, qb, sp, yp + m * N, N, K, 4 * b); break;
          default: w8_tiles_block<1>(xm, xs.data() + m, qb, sp, yp + m * N, N, K, 4 * b); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "w8a16_tiles_gemv needs a build with AVX-512 VNNI (has_w8_tiles() is false)");
#endif
  return y;
}

at::Tensor w8a16_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "w8a16_gemv: x must be a 2-D bfloat16 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "w8a16_gemv: takes 1-4 rows, got ", x.size(0),
              " (more rows: the tiled dequantize + matmul path)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              "w8a16_gemv: q must be a contiguous 2-D int8 CPU tensor [N, K], got ", q.scalar_type(), " ", q.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "w8a16_gemv: x has ", K, " columns but q has ", q.size(1));
  TORCH_CHECK(K % 16 == 0, "w8a16_gemv: in_features must be a multiple of 16, got ", K);
  TORCH_CHECK(scales.numel() == N, "w8a16_gemv: scales must hold one value per output channel (", N, "), got ",
              scales.numel());
#if LT_W8_GEMV
  const auto xf = x.to(at::kFloat).contiguous();
  const auto sf = scales.to(at::kFloat).contiguous().view({N});
  auto y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: w8_rows<1>(xp, qp, sp, yp, N, K, n0, n1); break;
      case 2: w8_rows<2>(xp, qp, sp, yp, N, K, n0, n1); break;
      case 3: w8_rows<3>(xp, qp, sp, yp, N, K, n0, n1); break;
      default: w8_rows<4>(xp, qp, sp, yp, N, K, n0, n1); break;
    }
  });
  return y;
#else
  TORCH_CHECK(false, "w8a16_gemv: not compiled in (needs AVX-512 F/BW); use aten._weight_int8pack_mm");
  return at::Tensor();
#endif
}
