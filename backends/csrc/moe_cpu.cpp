// Mixture-of-Experts W4A16 on CPUs with AVX-512 BF16: the experts of one layer in one call, over the tiled layout of
// w4a16_gemm_cpu.cpp (see the layout comment there) stacked on a leading expert dim E:
//   packed uint8 [E, N/32, K/4, 64], zeros int16 [E, N/32, G, 2, 16], scales bfloat16 [E, N/32, G, 2, 16]
// (G = K / group_size), i.e. torch.stack of each expert's backends/cpu_ext.py:pack_w4_tiles.
//
// w4a16_experts_mm(x [P, K], expert_ids int32 [P], ...) -> [P, N]: row p = x[p] @ W[expert_ids[p]].T. The caller
// sorts the rows by expert (routing: token t's top-k choices become k rows); a run of consecutive rows with the same
// expert reads that expert's weight once per run. Correctness does not depend on the order, only the bytes read do.
// act=True (ik_llama.cpp's fused -fmoe gate/up): the weight is gate and up concatenated on the output dim (N = 2I,
// gate rows first, I a multiple of 32) and the result is [P, I] = silu(gate) * up. Rounding: gate and up stay the
// float32 sums (never rounded to bfloat16), silu(g) = g / (1 + exp(-g)) is computed in float32 (the AVX-512 exp of
// avx512_math.h, relative error < 2e-7) and the product silu(g) * u, in float32, is the one value rounded to
// bfloat16 (nearest even, as VCVTNEPS2BF16: float32 subnormals flush to zero). The unfused
// silu_and_mul(w4a16(...)) rounds g and u first, so the two differ by what rounding g and u to bfloat16 changes
// (half an ulp of each, through silu's derivative) plus an ulp of the result (tests/test_moe_kernels.py holds it to
// that bound element by element).
//
// The arithmetic of each row is that of the dense kernels: runs of at most max_gemv_rows rows (default 5, as the
// torch backend's tiles_min_rows = 6) take w4a16_tiles_gemv's technique (the codes read in place as bfloat16 128 + q,
// the weight never rounded, up to 4 rows sharing each decoded vector), longer runs w4a16_tiles_mm's (each 32-channel
// block of the expert dequantized once into an L2-resident buffer, each weight rounded once to bfloat16 from
// (q - z) * s, then VDPBF16PS over 8 rows at a time, float32 sums in k order). A row's result therefore depends only
// on whether its run is short or long, never on the other rows or the thread split (max_gemv_rows = 0: every row the
// many-row arithmetic, bit-identical to w4a16_tiles_mm of that expert alone). The helpers below are
// w4a16_gemm_cpu.cpp's with one change: the tile kernels return float32 sums (for the fused SiLU epilogue) instead of
// storing bfloat16.
//
// Work split: a unit is (a run's chunk of rows, one block of 32 output channels); with act=True the pair (gate block
// c, up block c + I/32), whose float32 sums meet in a small tile to emit silu * up. Long runs are cut into balanced
// chunks whose activations take at most ~512 KB (they stay in L2 beside the dequantized block). The units of all
// experts go to the threads together: each thread takes the next range of consecutive units from an atomic counter,
// a share of what is left (guided scheduling: long contiguous weight streams first, which the hardware prefetchers
// follow -- handing out single units in turn read decode weights from memory ~1.5x slower --, then smaller ranges that
// even out units of unequal cost). Batch-1 decode of 8 experts x 24-64 blocks keeps every core busy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <tuple>
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

constexpr int kMmRows = 8;     // rows per register block of the many-row path
constexpr int kGemvRows = 4;   // rows sharing one decoded weight vector in the few-row path
constexpr int64_t kChunkBytes = 512 * 1024;  // activations of one chunk of a long run
constexpr int64_t kRangeBytes = 1 << 20;      // weight bytes of the longest range of units a thread takes at once

// bf16 pairs of one channel block for all K (w4a16_gemm_cpu.cpp's expand_block): buf[p * 2 + b] = 16 channels x
// (k = 2p, 2p + 1) of sub-block b, each weight bf16((q - z) * s) with (q - z) * s in float32
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

// R rows (stride K) x the expanded block -> float32 sums t[r * 32 + n] (w4a16_gemm_cpu.cpp's block_rows)
template <int R>
void mm_tile(const uint16_t* x, int64_t K, const __m512i* buf, float* t) {
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
    _mm512_storeu_ps(t + r * 32, acc[r][0]);
    _mm512_storeu_ps(t + r * 32 + 16, acc[r][1]);
  }
}

void mm_rows(const uint16_t* x, int rows, int64_t K, const __m512i* buf, float* t) {
  switch (rows) {
    case 8: mm_tile<8>(x, K, buf, t); break;
    case 7: mm_tile<7>(x, K, buf, t); break;
    case 6: mm_tile<6>(x, K, buf, t); break;
    case 5: mm_tile<5>(x, K, buf, t); break;
    case 4: mm_tile<4>(x, K, buf, t); break;
    case 3: mm_tile<3>(x, K, buf, t); break;
    case 2: mm_tile<2>(x, K, buf, t); break;
    default: mm_tile<1>(x, K, buf, t); break;
  }
}

// R rows x one block with the codes read in place (w4a16_gemm_cpu.cpp's gemv_block): per group the float32 sums
// D = sum (128 + q) x by VDPBF16PS, then y += s * (D - (128 + z) * X) with X the group's float32 sum of x.
// U independent accumulator sets hide VDPBF16PS's latency when R is small.
template <int R, int U>
void gemv_tile(const uint16_t* x, const float* xsum, int64_t K, int64_t G, int64_t group_size, const uint8_t* packed,
               const int16_t* zeros, const at::BFloat16* scales, float* t) {
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
    _mm512_storeu_ps(t + r * 32, tot[r][0]);
    _mm512_storeu_ps(t + r * 32 + 16, tot[r][1]);
  }
}

void gemv_rows(const uint16_t* x, const float* xsum, int rows, int64_t K, int64_t G, int64_t group_size,
               const uint8_t* packed, const int16_t* zeros, const at::BFloat16* scales, float* t) {
  switch (rows) {
    case 4: gemv_tile<4, 1>(x, xsum, K, G, group_size, packed, zeros, scales, t); break;
    case 3: gemv_tile<3, 1>(x, xsum, K, G, group_size, packed, zeros, scales, t); break;
    case 2: gemv_tile<2, 2>(x, xsum, K, G, group_size, packed, zeros, scales, t); break;
    default: gemv_tile<1, 2>(x, xsum, K, G, group_size, packed, zeros, scales, t); break;
  }
}

// rows x 32 float32 sums -> bfloat16 (nearest even)
inline void emit_plain(const float* t, int rows, at::BFloat16* out, int64_t ld) {
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld + 16 * h),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(t + r * 32 + 16 * h)));
}

// rows x 32: bfloat16(silu(g) * u) from the float32 sums of gate and up
inline void emit_silu(const float* tg, const float* tu, int rows, at::BFloat16* out, int64_t ld) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m512 g = _mm512_loadu_ps(tg + r * 32 + 16 * h), u = _mm512_loadu_ps(tu + r * 32 + 16 * h);
      const __m512 e = lt_avx512::exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld + 16 * h), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

struct Chunk {
  int64_t expert, row0, rows;
  bool gemv;
};

}  // namespace
#endif

#if LT_W4_TILES
namespace {

// One pass of the experts over rows sorted by expert (the body of w4a16_experts_mm on raw pointers): x [P, K] bf16,
// ids [P] in [0, E), the stacked tiles with NB blocks of 32 output channels per expert; out [P, act ? NB*16 : NB*32].
void experts_pass(const uint16_t* xp, int64_t P, int64_t K, const int32_t* idp, const uint8_t* wp, const int16_t* zp,
                  const at::BFloat16* sp, int64_t NB, int64_t group_size, bool act, int64_t max_gemv_rows,
                  at::BFloat16* op) {
  const int64_t G = K / group_size;
  const int64_t NU = act ? NB / 2 : NB;  // units per chunk
  const int64_t NO = NU * 32;            // output width
  // runs of one expert, long ones cut into balanced chunks of at most chunk_rows
  const int64_t chunk_rows = std::max<int64_t>(kMmRows, kChunkBytes / (2 * K) / kMmRows * kMmRows);
  std::vector<Chunk> chunks;
  bool any_gemv = false;
  for (int64_t p0 = 0; p0 < P;) {
    int64_t p1 = p0 + 1;
    while (p1 < P && idp[p1] == idp[p0]) ++p1;
    const int64_t n = p1 - p0;
    if (n <= max_gemv_rows) {
      chunks.push_back({idp[p0], p0, n, true});
      any_gemv = true;
    } else {
      const int64_t pieces = (n + chunk_rows - 1) / chunk_rows, each = (n + pieces - 1) / pieces;
      for (int64_t r = p0; r < p1; r += each) chunks.push_back({idp[p0], r, std::min(each, p1 - r), false});
    }
    p0 = p1;
  }
  std::vector<float> xsum;  // [P, G], the rows of short runs only
  if (any_gemv) {
    xsum.resize(static_cast<size_t>(P * G));
    for (const Chunk& ch : chunks)
      if (ch.gemv)
        for (int64_t p = ch.row0; p < ch.row0 + ch.rows; ++p) lt_avx512::group_sums(xp + p * K, G, group_size, &xsum[p * G]);
  }
  const int64_t units = static_cast<int64_t>(chunks.size()) * NU;
  const int64_t block_bytes = (K / 4) * 64, block_groups = G * 32;
  // a range of at most ~1 MB of weights (per row group of 4 / 8 rows): long enough for the prefetchers, short
  // enough that a thread the OS takes off its core mid-range delays the call by little
  const int64_t max_take = std::max<int64_t>(1, kRangeBytes / (block_bytes * (act ? 2 : 1)));
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<__m512i> buf;  // the many-row path's expanded block(s): K/2 pairs x 2 sub-blocks (act: twice)
    alignas(64) float tg[kMmRows * 32], tu[kMmRows * 32];
    int64_t u = 0, end = 0;
    for (;;) {
      if (u == end) {  // grab the next range: a share of what is left (guided), at least one unit
        int64_t cur = next.load(std::memory_order_relaxed), take;
        do {
          if (cur >= units) break;
          take = std::max<int64_t>(1, std::min((units - cur) / (2 * workers), max_take));
        } while (!next.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed));
        if (cur >= units) break;
        u = cur, end = std::min(units, cur + take);
      }
      const Chunk& ch = chunks[static_cast<size_t>(u / NU)];
      const int64_t c = u % NU;
      const int64_t bg = ch.expert * NB + c, bu = bg + NU;  // gate (or only) block, up block (act)
      at::BFloat16* o = op + ch.row0 * NO + c * 32;
      const uint16_t* xr = xp + ch.row0 * K;
      if (ch.gemv) {
        for (int64_t m = 0; m < ch.rows; m += kGemvRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kGemvRows, ch.rows - m));
          const float* xs = xsum.data() + (ch.row0 + m) * G;
          gemv_rows(xr + m * K, xs, rows, K, G, group_size, wp + bg * block_bytes, zp + bg * block_groups,
                    sp + bg * block_groups, tg);
          if (act) {
            gemv_rows(xr + m * K, xs, rows, K, G, group_size, wp + bu * block_bytes, zp + bu * block_groups,
                      sp + bu * block_groups, tu);
            emit_silu(tg, tu, rows, o + m * NO, NO);
          } else {
            emit_plain(tg, rows, o + m * NO, NO);
          }
        }
      } else {
        if (buf.empty()) buf.resize(static_cast<size_t>((act ? 2 : 1) * K));
        __m512i* bufg = buf.data();
        __m512i* bufu = bufg + K;
        expand_block(wp + bg * block_bytes, zp + bg * block_groups, sp + bg * block_groups, K, group_size, bufg);
        if (act)
          expand_block(wp + bu * block_bytes, zp + bu * block_groups, sp + bu * block_groups, K, group_size, bufu);
        for (int64_t m = 0; m < ch.rows; m += kMmRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMmRows, ch.rows - m));
          mm_rows(xr + m * K, rows, K, bufg, tg);
          if (act) {
            mm_rows(xr + m * K, rows, K, bufu, tu);
            emit_silu(tg, tu, rows, o + m * NO, NO);
          } else {
            emit_plain(tg, rows, o + m * NO, NO);
          }
        }
      }
      ++u;
    }
  });
}

}  // namespace
#endif

bool has_w4_experts() { return LT_W4_TILES != 0; }

namespace {

// The stacked tiles' checks shared by both entry points; returns (E, NB, G).
std::tuple<int64_t, int64_t, int64_t> check_tiles(const char* what, int64_t K, const at::Tensor& packed,
                                                  const at::Tensor& zeros, const at::Tensor& scales,
                                                  int64_t group_size) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(3) == 64 &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              what, ": packed must be contiguous uint8 [E, N/32, K/4, 64]");
  const int64_t E = packed.size(0), NB = packed.size(1);
  TORCH_CHECK(packed.size(2) * 4 == K, what, ": the input has ", K, " channels, the weight ", packed.size(2) * 4);
  TORCH_CHECK(K > 0, what, ": the input must have channels");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && K % group_size == 0,
              what, ": group_size must be a multiple of 8 dividing K (", K, "), got ", group_size);
  const int64_t G = K / group_size;
  TORCH_CHECK(zeros.scalar_type() == at::kShort && zeros.sizes() == at::IntArrayRef({E, NB, G, 2, 16}) &&
                  zeros.is_contiguous(),
              what, ": zeros must be contiguous int16 [E, N/32, G, 2, 16] = [", E, ", ", NB, ", ", G, ", 2, 16], got ",
              zeros.scalar_type(), " ", zeros.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.sizes() == at::IntArrayRef({E, NB, G, 2, 16}) &&
                  scales.is_contiguous(),
              what, ": scales must be contiguous bfloat16 [E, N/32, G, 2, 16] = [", E, ", ", NB, ", ", G,
              ", 2, 16], got ", scales.scalar_type(), " ", scales.sizes());
  return {E, NB, G};
}

}  // namespace

// x bfloat16 [P, K], expert_ids int32 [P] in [0, E) → bfloat16 [P, N] (act: [P, N/2] = silu(gate) * up); see the
// comment at the top. Raises when built without AVX-512 BF16.
at::Tensor w4a16_experts_mm(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& packed,
                            const at::Tensor& zeros, const at::Tensor& scales, int64_t group_size, bool act,
                            int64_t max_gemv_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "x must be a CPU bfloat16 [P, K]");
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kInt && ids_in.device().is_cpu(),
              "expert_ids must be a CPU int32 [P]");
  TORCH_CHECK(ids_in.size(0) == x_in.size(0), "expert_ids has ", ids_in.size(0), " entries, x ", x_in.size(0), " rows");
  const at::Tensor x = x_in.contiguous(), ids = ids_in.contiguous();
  const int64_t P = x.size(0), K = x.size(1);
  const auto [E, NB, G] = check_tiles("w4a16_experts_mm", K, packed, zeros, scales, group_size);
  (void)G;
  TORCH_CHECK(!act || NB % 2 == 0, "act=True needs the gate and up halves of N = ", NB * 32,
              " each a multiple of 32 (N a multiple of 64)");
  TORCH_CHECK(max_gemv_rows >= 0, "max_gemv_rows must be >= 0");
  const int64_t NO = (act ? NB / 2 : NB) * 32;  // output width
  auto out = at::empty({P, NO}, x.options());
  const int32_t* idp = ids.data_ptr<int32_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "expert_ids[", p, "] = ", idp[p], " is outside [0, ", E, ")");
  if (P == 0 || NO == 0) return out;
#if LT_W4_TILES
  experts_pass(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), P, K, idp, packed.data_ptr<uint8_t>(),
               zeros.data_ptr<int16_t>(), scales.data_ptr<at::BFloat16>(), NB, group_size, act, max_gemv_rows,
               out.data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "w4a16_experts_mm needs a build with AVX-512 BF16 (this build has has_w4_experts() == False)");
#endif
  return out;
}

// The whole routed-experts operation of a sparse MLP block in one call: x bfloat16 [T, H], topk_ids int32 or int64
// [T, k] in [0, E), topk_weights bfloat16 [T, k] -> bfloat16 [T, H] with
//   out[t] = bf16( sum_j float(w[t, j]) * float(y[t, j]) ),  y[t, j] = down_e(silu(gate_e(x[t])) * up_e(x[t])) (bf16)
// e = topk_ids[t, j], the sum in float32 in slot order j = 0..k-1. The (token, slot) rows are sorted by expert
// (a stable counting sort: a token's rows keep their order within an expert), gathered, sent through the gate+up
// pass (act=True) and the down pass of w4a16_experts_mm's arithmetic, and summed per token: the same numbers as
// w4a16_experts_mm twice plus a float32 weighted sum, without the Python between them.
at::Tensor w4a16_moe(const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& w_in,
                     const at::Tensor& gu_packed, const at::Tensor& gu_zeros, const at::Tensor& gu_scales,
                     int64_t gu_group_size, const at::Tensor& d_packed, const at::Tensor& d_zeros,
                     const at::Tensor& d_scales, int64_t d_group_size, int64_t max_gemv_rows) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "w4a16_moe: x must be a CPU bfloat16 [T, H]");
  TORCH_CHECK(ids_in.dim() == 2 && (ids_in.scalar_type() == at::kInt || ids_in.scalar_type() == at::kLong) &&
                  ids_in.size(0) == x_in.size(0),
              "w4a16_moe: topk_ids must be int32 or int64 [T, k] with T = x's rows (", x_in.size(0), "), got ",
              ids_in.scalar_type(), " ", ids_in.sizes());
  TORCH_CHECK(w_in.sizes() == ids_in.sizes() && w_in.scalar_type() == at::kBFloat16,
              "w4a16_moe: topk_weights must be bfloat16 of topk_ids' shape ", ids_in.sizes(), ", got ",
              w_in.scalar_type(), " ", w_in.sizes());
  TORCH_CHECK(max_gemv_rows >= 0, "w4a16_moe: max_gemv_rows must be >= 0");
  const at::Tensor x = x_in.contiguous(), ids = ids_in.to(at::kInt).contiguous(), w = w_in.contiguous();
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), P = T * k;
  const auto [E, NB, G] = check_tiles("w4a16_moe gate_up", H, gu_packed, gu_zeros, gu_scales, gu_group_size);
  (void)G;
  TORCH_CHECK(NB % 2 == 0, "w4a16_moe: gate_up's N = ", NB * 32, " must be gate and up of a multiple of 32 each");
  const int64_t I = NB / 2 * 32;
  const auto [E2, NBd, Gd] = check_tiles("w4a16_moe down", I, d_packed, d_zeros, d_scales, d_group_size);
  (void)Gd;
  TORCH_CHECK(E2 == E && NBd * 32 == H, "w4a16_moe: down must be [E=", E, ", H/32=", H / 32, ", ...], got [", E2,
              ", ", NBd, ", ...]");
  const int32_t* idp = ids.data_ptr<int32_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "w4a16_moe: topk_ids holds ", idp[p], ", outside [0, ", E, ")");
  auto out = at::empty({T, H}, x.options());
  if (T == 0 || H == 0) return out;
#if LT_W4_TILES
  // stable counting sort of the (token, slot) rows by expert; pos[t * k + j] = the row's place in sorted order
  std::vector<int32_t> sorted_ids(P), pos(P), src(P);
  {
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t p = 0; p < P; ++p) ++start[idp[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < P; ++p) {
      const int64_t s = start[idp[p]]++;
      sorted_ids[s] = idp[p], pos[p] = static_cast<int32_t>(s), src[s] = static_cast<int32_t>(p / k);
    }
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto xs = at::empty({P, H}, x.options());
  uint16_t* xsp = reinterpret_cast<uint16_t*>(xs.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 256, [&](int64_t a, int64_t b) {
    for (int64_t s = a; s < b; ++s) std::copy(xp + src[s] * H, xp + src[s] * H + H, xsp + s * H);
  });
  auto h = at::empty({P, I}, x.options());
  experts_pass(xsp, P, H, sorted_ids.data(), gu_packed.data_ptr<uint8_t>(), gu_zeros.data_ptr<int16_t>(),
               gu_scales.data_ptr<at::BFloat16>(), NB, gu_group_size, true, max_gemv_rows, h.data_ptr<at::BFloat16>());
  auto y = at::empty({P, H}, x.options());
  experts_pass(reinterpret_cast<const uint16_t*>(h.data_ptr<at::BFloat16>()), P, I, sorted_ids.data(),
               d_packed.data_ptr<uint8_t>(), d_zeros.data_ptr<int16_t>(), d_scales.data_ptr<at::BFloat16>(), NBd,
               d_group_size, false, max_gemv_rows, y.data_ptr<at::BFloat16>());
  const at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t)
      for (int64_t c = 0; c < H; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; ++j)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(wp[t * k + j])),
                                lt_avx512::load16(yp + pos[t * k + j] * H + c), acc);
        lt_avx512::store16(op + t * H + c, acc);
      }
  });
#else
  TORCH_CHECK(false, "w4a16_moe needs a build with AVX-512 BF16 (this build has has_w4_experts() == False)");
#endif
  return out;
}
