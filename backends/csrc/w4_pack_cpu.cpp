// Load-time repacking of 4-bit weights on the CPU (bound in ext.cpp, used by backends/cpu_ext.py and
// lite/formats/awq.py): one parallel pass each instead of torch's chains of views, gathers and transposes.
//
// unpack_nibbles_t: int32 words [R, C] holding 8 nibbles each -> uint8 codes [C * 8, R] (transposed), column
//   c * 8 + j of the unpacked matrix taken from nibble order[j] of word c. With the AWQ GEMM order this turns a
//   checkpoint's qweight [K, N / 8] into the canonical codes [N, K] in one pass.
// pack_w4_tiles_codes: uint8 codes [N, K] in [0, 16) -> the packed codes of w4a16_gemm_cpu.cpp's tiled layout,
//   uint8 [N / 32, K / 4, 64]: byte (block, quad, sub * 32 + ch * 2 + pair) = code(n, 4 quad + pair) |
//   code(n, 4 quad + 2 + pair) << 4 with n = 32 block + 16 sub + ch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

at::Tensor lt_unpack_nibbles_t(const at::Tensor& packed, const at::Tensor& order) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kInt && packed.dim() == 2,
              "unpack_nibbles_t: packed must be a 2-D int32 CPU tensor, got ", packed.scalar_type(), " ",
              packed.sizes());
  TORCH_CHECK(order.device().is_cpu() && order.numel() == 8, "unpack_nibbles_t: order must hold 8 nibble positions");
  auto ord = order.to(at::kLong).contiguous();
  int sh[8];
  for (int j = 0; j < 8; ++j) {
    int64_t o = ord.data_ptr<int64_t>()[j];
    TORCH_CHECK(o >= 0 && o < 8, "unpack_nibbles_t: nibble position ", o, " is outside 0..7");
    sh[j] = static_cast<int>(4 * o);
  }
  auto p = packed.contiguous();
  const int64_t R = p.size(0), C = p.size(1);
  auto out = at::empty({C * 8, R}, p.options().dtype(at::kByte));
  if (R == 0 || C == 0) return out;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(p.data_ptr<int32_t>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  constexpr int64_t RB = 64, CB = 16;  // a 64 x 16-word block of the source (4 KiB) per step
  at::parallel_for(0, (C + CB - 1) / CB, 1, [&](int64_t b0, int64_t b1) {
    uint32_t col[RB];
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int64_t c_end = std::min(C, (cb + 1) * CB);
      for (int64_t r0 = 0; r0 < R; r0 += RB) {
        const int64_t rn = std::min(RB, R - r0);
        for (int64_t c = cb * CB; c < c_end; ++c) {
          for (int64_t r = 0; r < rn; ++r) col[r] = src[(r0 + r) * C + c];
          for (int j = 0; j < 8; ++j) {
            uint8_t* o = dst + (c * 8 + j) * R + r0;
            const int s = sh[j];
            for (int64_t r = 0; r < rn; ++r) o[r] = static_cast<uint8_t>((col[r] >> s) & 15u);
          }
        }
      }
    }
  });
  return out;
}

at::Tensor lt_pack_w4_tiles_codes(const at::Tensor& codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 2,
              "pack_w4_tiles_codes: codes must be a 2-D uint8 CPU tensor, got ", codes.scalar_type(), " ",
              codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 4 == 0, "pack_w4_tiles_codes: the tiled layout needs N % 32 == 0 and K % 4 == 0, "
              "got ", N, "x", K);
  auto c = codes.contiguous();
  auto out = at::empty({N / 32, K / 4, 64}, c.options());
  if (N == 0 || K == 0) return out;
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t Q = K / 4;
  at::parallel_for(0, N / 32, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* rows = src + nb * 32 * K;
      uint8_t* o = dst + nb * Q * 64;
      for (int64_t q = 0; q < Q; ++q, o += 64) {
        for (int i = 0; i < 32; ++i) {  // i = sub * 16 + ch: row n = 32 nb + i, bytes 2 i and 2 i + 1
          const uint8_t* w = rows + i * K + 4 * q;
          o[2 * i] = static_cast<uint8_t>((w[0] & 15) | ((w[2] & 15) << 4));
          o[2 * i + 1] = static_cast<uint8_t>((w[1] & 15) | ((w[3] & 15) << 4));
        }
      }
    }
  });
  return out;
}
