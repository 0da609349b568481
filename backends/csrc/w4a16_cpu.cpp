// W4A16 GEMM for CPUs: y[m, n] = sum_k x[m, k] * (q[n, k] - z[n, g(k)]) * s[n, g(k)]
//
// Weight layout (built by backends/cpu_ext.py:pack_w4_cpu): for each output row n and each block of 64 input
// channels b, 32 bytes; byte j holds channel 64b + j in its low nibble and channel 64b + 32 + j in its high nibble.
// zoff[n, g] = 16 - z[n, g] (int16), scales[n, g] float32, groups of `group_size` (a multiple of 32) channels.
//
// AVX-512 BF16 path: the 64 codes of a block are widened to 16-bit lanes, offset by zoff and mapped through a
// 32-entry table to the exact bfloat16 value of (q - z) (VPERMW), then multiplied with bfloat16 activations by
// VDPBF16PS into float32; each group's partial sum is scaled by s in float32. The codes of a weight row are
// unpacked once per call into an L1-resident buffer and reused for every activation row, so a row's result does
// not depend on how many rows the call has (the same operations in the same order for every row).
// Portable path (AVX2 or anything else): the same definition in float32, written for the compiler to vectorize.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LT_AVX512BF16 1
#else
#define LT_AVX512BF16 0
#endif

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoff,
                  int64_t group_size) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "packed must be uint8 [N, K/2]");
  TORCH_CHECK(x.size(1) == packed.size(1) * 2, "x has ", x.size(1), " input channels, the weight ", packed.size(1) * 2);
  TORCH_CHECK(x.size(1) % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(group_size % 32 == 0 && x.size(1) % group_size == 0, "group_size must be a multiple of 32 dividing K");
  const int64_t groups = x.size(1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == packed.size(0) && scales.size(1) == groups,
              "scales must be float32 [N, K/group_size]");
  TORCH_CHECK(zoff.scalar_type() == at::kShort && zoff.size(0) == packed.size(0) && zoff.size(1) == groups,
              "zoff must be int16 [N, K/group_size]");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && zoff.is_contiguous(), "weights must be contiguous");
}

#if LT_AVX512BF16
// (q - z) for one block of 64 codes as two vectors of 32 bfloat16: channels [0, 32) and [32, 64)
inline void unpack_block(const uint8_t* p, __m512i off_lo, __m512i off_hi, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i nib = _mm512_set1_epi16(0x0F);
  lo = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(v, nib), off_lo), table);
  hi = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(v, 4), off_hi), table);
}

at::Tensor mm_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoff,
                     int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / group_size, B = K / 64;
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int16_t* zp = zoff.data_ptr<int16_t>();
  float* op = out.data_ptr<float>();
  // table[i] = bfloat16(i - 16): exact for the integers -16..15
  alignas(64) uint16_t tab[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i - 16);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    tab[i] = static_cast<uint16_t>(u >> 16);
  }
  const __m512i table = _mm512_load_si512(reinterpret_cast<const void*>(tab));
  const int64_t halves_per_group = group_size / 32;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<__m512i> buf(static_cast<size_t>(2 * B));  // one weight row as bfloat16 (q - z)
    std::vector<__m512> acc_m;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wp + n * (K / 2);
      const float* s = sp + n * G;
      const int16_t* z = zp + n * G;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t g_lo = (2 * b) / halves_per_group, g_hi = (2 * b + 1) / halves_per_group;
        unpack_block(row + 32 * b, _mm512_set1_epi16(z[g_lo]), _mm512_set1_epi16(z[g_hi]), table, buf[2 * b],
                     buf[2 * b + 1]);
      }
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* xr = xp + m * K;
        __m512 acc = _mm512_setzero_ps();
        if (halves_per_group >= 2) {  // whole blocks per group: one scale per group
          const int64_t blocks_per_group = halves_per_group / 2;
          for (int64_t g = 0; g < G; ++g) {
            __m512 t = _mm512_setzero_ps();
            for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
              const __m512i x0 = _mm512_loadu_si512(reinterpret_cast<const void*>(xr + 64 * b));
              const __m512i x1 = _mm512_loadu_si512(reinterpret_cast<const void*>(xr + 64 * b + 32));
              t = _mm512_dpbf16_ps(t, (__m512bh)buf[2 * b], (__m512bh)x0);
              t = _mm512_dpbf16_ps(t, (__m512bh)buf[2 * b + 1], (__m512bh)x1);
            }
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[g]), acc);
          }
        } else {  // group_size 32: each half block is its own group
          for (int64_t h = 0; h < 2 * B; ++h) {
            const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(xr + 32 * h));
            const __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)buf[h], (__m512bh)xv);
            acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[h]), acc);
          }
        }
        op[m * N + n] = _mm512_reduce_add_ps(acc);
      }
    }
  });
  return out;
}
#endif

// The same definition in float32, vectorizable by the compiler (AVX2 builds and the fallback for non-bf16 input).
at::Tensor mm_portable(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zoff, int64_t group_size) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / group_size, B = K / 64;
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int16_t* zp = zoff.data_ptr<int16_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> w(static_cast<size_t>(K));  // (q - z) of one row, float32
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = wp + n * (K / 2);
      for (int64_t b = 0; b < B; ++b) {
        for (int j = 0; j < 32; ++j) {
          const uint8_t byte = row[32 * b + j];
          const int64_t c0 = 64 * b + j, c1 = 64 * b + 32 + j;
          w[c0] = static_cast<float>((byte & 15) - 16 + zp[n * G + c0 / group_size]);
          w[c1] = static_cast<float>((byte >> 4) - 16 + zp[n * G + c1 / group_size]);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float t = 0.f;
          const float* wg = w.data() + g * group_size;
          const float* xg = xr + g * group_size;
          for (int64_t k = 0; k < group_size; ++k) t += wg[k] * xg[k];
          acc += t * sp[n * G + g];
        }
        op[m * N + n] = acc;
      }
    }
  });
  return out;
}

}  // namespace

// x [M, K] (bfloat16 uses the AVX-512 BF16 kernel where compiled; other dtypes the float32 path) → float32 [M, N]
at::Tensor w4a16_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zoff,
                    int64_t group_size) {
  check_inputs(x, packed, scales, zoff, group_size);
#if LT_AVX512BF16
  if (x.scalar_type() == at::kBFloat16) return mm_avx512(x.contiguous(), packed, scales, zoff, group_size);
#endif
  return mm_portable(x, packed, scales, zoff, group_size);
}

bool has_avx512_bf16() { return LT_AVX512BF16 != 0; }
