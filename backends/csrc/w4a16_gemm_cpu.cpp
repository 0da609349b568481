// W4A16 GEMM on CPUs with AVX-512 BF16, two kernels over one packed weight layout (below):
//
// w4a16_tiles_gemv (a few rows: batch-1 and small-batch decode, where the weight bytes read are the cost). The codes
// are read straight from the packed layout, 64 bytes (32 channels x 4 input channels) per step, and turned into
// bfloat16 without arithmetic: OR-ing the exponent bits 0x4300 onto a code q in [0, 16) gives the bfloat16 number
// 128 + q exactly. VDPBF16PS then sums D[n, g] = sum_{k in g} (128 + q[n, k]) x[k] in float32 per group, and
//   y[n] = sum_g s[n, g] * (D[n, g] - (128 + z[n, g]) * X[g]),   X[g] = sum_{k in g} x[k] (float32),
// which is sum_k (q - z) * s * x with the weight never rounded (the products are exact in float32; the sums are
// float32). Up to 4 rows share each decoded weight vector; channel blocks are split over the threads.
//
// w4a16_tiles_mm (many rows): y[m, n] = sum_k x[m, k] * bf16((q[n, k] - z[n, g]) * s[n, g]).
// Each weight tile (32 output channels x all input channels) is dequantized once per call into an L2-resident
// buffer in the VNNI pair layout (a 32-bit lane holds channel n's weights for input channels 2p and 2p + 1), then
// multiplied with every activation row by VDPBF16PS, 8 rows x 32 channels per register block, accumulating in
// float32 over k in order. A row's result therefore does not depend on how many rows the call has. Each weight is
// rounded once to bfloat16 from (q - z) * s computed in float32 (s held in bfloat16, as the int4pack decode path
// holds it).
//
// Packed layout (built by backends/cpu_ext.py:pack_w4_tiles): packed uint8 [N/32, K/4, 64]: for channel block c,
// input quad j (channels 4j .. 4j + 3) and sub-block b (channels 32c + 16b .. + 15), byte 32b + w holds
// code(n = 32c + 16b + w/2, k = 4j + w%2) in its low nibble and code(n, k = 4j + 2 + w%2) in its high nibble.
// zeros int16 [N/32, G, 2, 16] and scales bfloat16 [N/32, G, 2, 16]: z and s of channel 32c + 16b + i at index i
// (spread to the pair lanes in registers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define LT_W4_TILES 1
#else
#define LT_W4_TILES 0
#endif

#if LT_W4_TILES
namespace {

constexpr int kRows = 8;

// bf16 pairs of one channel block for all K: buf[p * 2 + b] = 16 channels x (k = 2p, 2p + 1) of sub-block b
void expand_block(const uint8_t* packed, const int16_t* zeros, const at::BFloat16* scales, int64_t K, int64_t group_size,
                  __m512i* buf) {
  const __m512i nib = _mm512_set1_epi16(0x0F);
  const int64_t quads_per_group = group_size / 4;
  alignas(64) int16_t pair_idx[32];
  alignas(64) int32_t lo_idx[16], hi_idx[16];
  for (int i = 0; i < 32; ++i) pair_idx[i] = static_cast<int16_t>(i / 2);
  for (int i = 0; i < 16; ++i) lo_idx[i] = i / 2, hi_idx[i] = 8 + i / 2;
  const __m512i pidx = _mm512_load_si512(pair_idx), lidx = _mm512_load_si512(lo_idx), hidx = _mm512_load_si512(hi_idx);
  for (int64_t j = 0; j < K / 4; ++j) {
    const int64_t g = j / quads_per_group;
    for (int b = 0; b < 2; ++b) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 64 * j + 32 * b)));
      const __m512i z = _mm512_permutexvar_epi16(
          pidx, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(zeros + (g * 2 + b) * 16))));
      const __m512 s16 = lt_avx512::load16(scales + (g * 2 + b) * 16);
      const __m512 s_lo = _mm512_permutexvar_ps(lidx, s16), s_hi = _mm512_permutexvar_ps(hidx, s16);
      for (int half = 0; half < 2; ++half) {  // low nibbles: k-pair 2j, high nibbles: k-pair 2j + 1
        const __m512i q = half == 0 ? _mm512_and_si512(v, nib) : _mm512_srli_epi16(v, 4);
        const __m512i d = _mm512_sub_epi16(q, z);
        const __m512 f_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(d))), s_lo);
        const __m512 f_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(d, 1))), s_hi);
        buf[(2 * j + half) * 2 + b] = (__m512i)_mm512_cvtne2ps_pbh(f_hi, f_lo);
      }
    }
  }
}

inline void store_row(at::BFloat16* out, __m512 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(a));
}

template <int R>
void block_rows(const uint16_t* x, int64_t K, const __m512i* buf, at::BFloat16* out, int64_t N) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)buf[2 * p], w1 = (__m512bh)buf[2 * p + 1];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * K + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_row(out + r * N, acc[r][0]);
    store_row(out + r * N + 16, acc[r][1]);
  }
}

void run_rows(const uint16_t* x, int64_t M, int64_t K, const __m512i* buf, at::BFloat16* out, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) block_rows<kRows>(x + m * K, K, buf, out + m * N, N);
  switch (M - m) {
    case 7: block_rows<7>(x + m * K, K, buf, out + m * N, N); break;
    case 6: block_rows<6>(x + m * K, K, buf, out + m * N, N); break;
    case 5: block_rows<5>(x + m * K, K, buf, out + m * N, N); break;
    case 4: block_rows<4>(x + m * K, K, buf, out + m * N, N); break;
    case 3: block_rows<3>(x + m * K, K, buf, out + m * N, N); break;
    case 2: block_rows<2>(x + m * K, K, buf, out + m * N, N); break;
    case 1: block_rows<1>(x + m * K, K, buf, out + m * N, N); break;
    default: break;
  }
}

// ---- few rows: codes read in place ------------------------------------------------------------------------------
constexpr int kGemvRows = 4;

// U independent accumulator sets (quads j with j % U == u) hide VDPBF16PS's latency when R is small
template <int R, int U>
void gemv_block(const uint16_t* x, const float* xsum, int64_t K, int64_t G, int64_t group_size, const uint8_t* packed,
                const int16_t* zeros, const at::BFloat16* scales, at::BFloat16* out, int64_t N) {
  const __m512i nib = _mm512_set1_epi16(0x0F), one28 = _mm512_set1_epi16(0x4300);
  const int64_t quads = group_size / 4;
  __m512 tot[R][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[R][2][2 * U];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 2 * U; ++h) acc[r][b][h] = _mm512_setzero_ps();
    const uint8_t* p = packed + g * quads * 64;
    const uint16_t* xg = x + g * group_size;
    for (int64_t j = 0; j < quads; j += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const uint8_t* pj = p + (j + u) * 64;
        const __m512i v0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pj)));
        const __m512i v1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pj + 32)));
        // 0xEA: (a & b) | c -- low nibble | 0x4300; the high nibble is alone after the shift
        const __m512bh w0l = (__m512bh)_mm512_ternarylogic_epi32(v0, nib, one28, 0xEA);
        const __m512bh w0h = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v0, 4), one28);
        const __m512bh w1l = (__m512bh)_mm512_ternarylogic_epi32(v1, nib, one28, 0xEA);
        const __m512bh w1h = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v1, 4), one28);
        for (int r = 0; r < R; ++r) {
          int32_t lo, hi;  // x pairs (4j, 4j + 1) and (4j + 2, 4j + 3)
          __builtin_memcpy(&lo, xg + r * K + 4 * (j + u), 4);
          __builtin_memcpy(&hi, xg + r * K + 4 * (j + u) + 2, 4);
          const __m512bh xl = (__m512bh)_mm512_set1_epi32(lo), xh = (__m512bh)_mm512_set1_epi32(hi);
          acc[r][0][2 * u] = _mm512_dpbf16_ps(acc[r][0][2 * u], w0l, xl);
          acc[r][0][2 * u + 1] = _mm512_dpbf16_ps(acc[r][0][2 * u + 1], w0h, xh);
          acc[r][1][2 * u] = _mm512_dpbf16_ps(acc[r][1][2 * u], w1l, xl);
          acc[r][1][2 * u + 1] = _mm512_dpbf16_ps(acc[r][1][2 * u + 1], w1h, xh);
        }
      }
    }
    for (int b = 0; b < 2; ++b) {
      const __m512 s = lt_avx512::load16(scales + (g * 2 + b) * 16);
      const __m512 z = _mm512_add_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zeros + (g * 2 + b) * 16)))),
          _mm512_set1_ps(128.f));
      for (int r = 0; r < R; ++r) {
        __m512 d = acc[r][b][0];
        for (int h = 1; h < 2 * U; ++h) d = _mm512_add_ps(d, acc[r][b][h]);
        d = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r * G + g]), d);
        tot[r][b] = _mm512_fmadd_ps(s, d, tot[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store_row(out + r * N, tot[r][0]);
    store_row(out + r * N + 16, tot[r][1]);
  }
}

void gemv_rows(const uint16_t* x, const float* xsum, int64_t M, int64_t K, int64_t G, int64_t group_size,
               const uint8_t* packed, const int16_t* zeros, const at::BFloat16* scales, at::BFloat16* out, int64_t N) {
  for (int64_t m = 0; m < M; m += kGemvRows) {
    const uint16_t* xm = x + m * K;
    const float* sm = xsum + m * G;
    at::BFloat16* om = out + m * N;
    switch (std::min<int64_t>(M - m, kGemvRows)) {
      case 4: gemv_block<4, 1>(xm, sm, K, G, group_size, packed, zeros, scales, om, N); break;
      case 3: gemv_block<3, 1>(xm, sm, K, G, group_size, packed, zeros, scales, om, N); break;
      case 2: gemv_block<2, 2>(xm, sm, K, G, group_size, packed, zeros, scales, om, N); break;
      default: gemv_block<1, 2>(xm, sm, K, G, group_size, packed, zeros, scales, om, N); break;
    }
  }
}

}  // namespace
#endif

bool has_w4_tiles() { return LT_W4_TILES != 0; }

// x bfloat16 [M, K] → bfloat16 [M, N]; see the layout above. Raises when built without AVX-512 BF16.
at::Tensor w4a16_tiles_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& zeros,
                          const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 64 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/32, K/4, 64]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 32;
  TORCH_CHECK(packed.size(1) * 4 == K, "x has ", K, " input channels, the weight ", packed.size(1) * 4);
  TORCH_CHECK(group_size % 4 == 0 && K % group_size == 0, "group_size must be a multiple of 4 dividing K");
  const int64_t G = K / group_size;
  TORCH_CHECK(zeros.scalar_type() == at::kShort && zeros.numel() == NB * G * 32 && zeros.is_contiguous(),
              "zeros must be int16 [N/32, G, 2, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == NB * G * 32 && scales.is_contiguous(),
              "scales must be bfloat16 [N/32, G, 2, 16]");
  auto out = at::empty({M, N}, x.options());
#if LT_W4_TILES
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int16_t* zp = zeros.data_ptr<int16_t>();
  const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t c0, int64_t c1) {
    std::vector<__m512i> buf(static_cast<size_t>(K));  // K/2 pairs x 2 sub-blocks
    for (int64_t c = c0; c < c1; ++c) {
      expand_block(wp + c * (K / 4) * 64, zp + c * G * 32, sp + c * G * 32, K, group_size, buf.data());
      run_rows(xp, M, K, buf.data(), op + c * 32, N);
    }
  });
#else
  TORCH_CHECK(false, "w4a16_tiles_mm needs a build with AVX-512 BF16");
#endif
  return out;
}

// x bfloat16 [M, K] (a few rows) → bfloat16 [M, N]; the same weight tensors as w4a16_tiles_mm, group_size a multiple
// of 8 (two quads per step for one or two rows). Raises when built without AVX-512 BF16.
at::Tensor w4a16_tiles_gemv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& zeros,
                            const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 64 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/32, K/4, 64]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 32;
  TORCH_CHECK(packed.size(1) * 4 == K, "x has ", K, " input channels, the weight ", packed.size(1) * 4);
  TORCH_CHECK(group_size % 8 == 0 && K % group_size == 0, "group_size must be a multiple of 8 dividing K");
  const int64_t G = K / group_size;
  TORCH_CHECK(zeros.scalar_type() == at::kShort && zeros.numel() == NB * G * 32 && zeros.is_contiguous(),
              "zeros must be int16 [N/32, G, 2, 16]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == NB * G * 32 && scales.is_contiguous(),
              "scales must be bfloat16 [N/32, G, 2, 16]");
  auto out = at::empty({M, N}, x.options());
#if LT_W4_TILES
  // X[m, g]: the sum of row m's inputs over group g, in float32
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xsum(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m) lt_avx512::group_sums(xp + m * K, G, group_size, xsum.data() + m * G);
  const float* sp32 = xsum.data();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int16_t* zp = zeros.data_ptr<int16_t>();
  const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      gemv_rows(xp, sp32, M, K, G, group_size, wp + c * (K / 4) * 64, zp + c * G * 32, sp + c * G * 32, op + c * 32, N);
  });
#else
  TORCH_CHECK(false, "w4a16_tiles_gemv needs a build with AVX-512 BF16");
#endif
  return out;
}
