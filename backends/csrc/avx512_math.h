// AVX-512 helpers shared by liteturbo's CPU kernels: 16-lane loads/stores of float32, bfloat16 and float16 as
// float32 vectors, exp, and the group sums of a bfloat16 row. Include only under __AVX512F__.
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

// X[g] = the sum of bfloat16 row x's inputs over group g, in float32 (group_size a multiple of 8): the W4A16
// kernels' zero-point term, one order of summation for the dense and the experts' kernels
inline void group_sums(const uint16_t* x, int64_t G, int64_t group_size, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* xg = x + g * group_size;
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= group_size; k += 16)
      acc = _mm512_add_ps(acc, lt_avx512::load16(reinterpret_cast<const at::BFloat16*>(xg + k)));
    float s = _mm512_reduce_add_ps(acc);
    if (k < group_size) {  // 8 left
      const __m256 v = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + k))), 16));
      s += _mm512_reduce_add_ps(_mm512_zextps256_ps512(v));
    }
    out[g] = s;
  }
}

}  // namespace lt_avx512
