// Weight-only int8 GEMV for a few rows (the int8 lm_head of a decode step), bound in ext.cpp and used by
// backends/torch_backend.py: y[m, n] = bf16(s[n] * sum_k x[m, k] * q[n, k]) for bf16 x [M, K] (M <= 4), int8
// q [N, K] (symmetric, per output channel) and float scales [N]. The codes are widened in registers
// (vpmovsxbd + vcvtdq2ps: exact) and multiplied with x in float32, four channels at a time with every row sharing
// each widened vector; the sum is float32 and the scale is applied once per channel. Threads split N.
//
// torch's aten::_weight_int8pack_mm computes the same numbers (float32 accumulation, one scale per channel) but at
// one row reads ~16 GB/s of int8 codes on the AVX-512 EPYC here, where a copy moves ~40 GB/s (bench/lm_head.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

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

}  // namespace
#endif

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
