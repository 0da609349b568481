// AVX-512 helpers shared by liteturbo's CPU kernels: 16-lane loads/stores of float32, bfloat16 and float16 as
// float32 vectors, and exp. Include only under __AVX512F__.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

namespace lt_avx512 {
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for x <= 0 (scores minus their max; also right up to ~88, see exp_any): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its Taylor polynomial to degree 6 (relative error < 2e-7), times 2^n by scalef (inputs below -88 give
// exp(-88), about 6e-39: underflow to the subnormal range, as expf).
inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as c10::BFloat16 does (NaN kept NaN)
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}


// exp(x) for any float x (overflow to inf above ~88.7): exp_nonpos's polynomial without the sign assumption.
inline __m512 exp_any(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.8f));
  return exp_nonpos(x);
}

}  // namespace lt_avx512
