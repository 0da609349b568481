// Python bindings of liteturbo's CPU kernels (built by backends/cpu_ext.py).
#include <torch/extension.h>

#include <tuple>

bool has_w4_tiles();
at::Tensor w4a16_tiles_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& zeros,
                            const at::Tensor& scales, int64_t group_size);
at::Tensor w4a16_tiles_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& zeros,
                          const at::Tensor& scales, int64_t group_size);
bool has_w4_experts();
at::Tensor w4a16_experts_mm(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& packed,
                            const at::Tensor& zeros, const at::Tensor& scales, int64_t group_size, bool act,
                            int64_t max_gemv_rows);
at::Tensor w4a16_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gu_packed, const at::Tensor& gu_zeros, const at::Tensor& gu_scales,
                     int64_t gu_group_size, const at::Tensor& d_packed, const at::Tensor& d_zeros,
                     const at::Tensor& d_scales, int64_t d_group_size, int64_t max_gemv_rows);
std::tuple<at::Tensor, at::Tensor> lt_moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                                bool norm_topk_prob, const c10::optional<at::Tensor>& logits);
bool has_w8_gemv();
at::Tensor w8a16_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
bool has_w8_tiles();
at::Tensor w8a16_tiles_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
at::Tensor lt_unpack_nibbles_t(const at::Tensor& packed, const at::Tensor& order);
at::Tensor lt_pack_w4_tiles_codes(const at::Tensor& codes);
at::Tensor lt_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> lt_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                   const at::Tensor& weight, double eps);
at::Tensor lt_silu_and_mul(const at::Tensor& gate_up);
at::Tensor lt_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor lt_rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slots);
at::Tensor lt_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, int64_t block_size, const at::Tensor& row_seq,
                              const at::Tensor& row_len, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16_tiles_mm", &w4a16_tiles_mm,
        "W4A16 GEMM for many rows: bf16 x [M, K] x tile-packed 4-bit weight -> bf16 [M, N] (w4a16_gemm_cpu.cpp)");
  m.def("w4a16_tiles_gemv", &w4a16_tiles_gemv,
        "W4A16 for a few rows: bf16 x [M, K] x the same tile-packed weight, codes read in place -> bf16 [M, N]");
  m.def("has_w4_tiles", &has_w4_tiles, "whether w4a16_tiles_mm was compiled in (AVX-512 BF16)");
  m.def("w4a16_experts_mm", &w4a16_experts_mm,
        "MoE W4A16: bf16 x [P, K] rows sorted by expert, int32 expert_ids [P] x the experts' stacked tile-packed "
        "weights [E, N/32, K/4, 64] -> bf16 [P, N], or with act=True (gate and up concatenated, N = 2I) "
        "silu(gate) * up [P, I]; runs of at most max_gemv_rows rows read the codes in place (moe_cpu.cpp)",
        py::arg("x"), py::arg("expert_ids"), py::arg("packed"), py::arg("zeros"), py::arg("scales"),
        py::arg("group_size"), py::arg("act") = false, py::arg("max_gemv_rows") = 5);
  m.def("w4a16_moe", &w4a16_moe,
        "MoE W4A16, the routed experts of one sparse block in one call: bf16 x [T, H], topk_ids int32/int64 [T, k], "
        "bf16 topk_weights [T, k], the stacked gate_up and down tiles -> bf16 [T, H] = sum_j w[t, j] * "
        "down(silu(gate(x)) * up(x)) of expert topk_ids[t, j], summed in float32 (moe_cpu.cpp)",
        py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("gu_packed"), py::arg("gu_zeros"),
        py::arg("gu_scales"), py::arg("gu_group_size"), py::arg("d_packed"), py::arg("d_zeros"), py::arg("d_scales"),
        py::arg("d_group_size"), py::arg("max_gemv_rows") = 5);
  m.def("moe_route", &lt_moe_route,
        "MoE routing: bf16 x [T, H], float32 router [E, H] -> (bf16 topk_weights [T, k], int32 topk_ids [T, k]): "
        "logits rounded to bf16, softmax in float32, top-k (ties: lower id), renormalised when norm_topk_prob; "
        "float32 logits [T, E] given skip the dot products (moe_route_cpu.cpp)",
        py::arg("x"), py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"), py::arg("logits") = py::none());
  m.def("has_w4_experts", &has_w4_experts, "whether w4a16_experts_mm was compiled in (AVX-512 BF16)");
  m.def("w8a16_gemv", &w8a16_gemv,
        "weight-only int8 for 1-4 rows: bf16 x [M, K] x int8 q [N, K] * scales [N] -> bf16 [M, N] (w8a16_gemv_cpu.cpp)");
  m.def("has_w8_gemv", &has_w8_gemv, "whether w8a16_gemv was compiled in (AVX-512 F/BW)");
  m.def("w8a16_tiles_gemv", &w8a16_tiles_gemv,
        "weight-only int8, any rows: bf16 x [M, K] x int8 q [N/4, K/32, 4, 32] * scales [N] -> bf16 [M, N] "
        "(w8a16_gemv_cpu.cpp)");
  m.def("has_w8_tiles", &has_w8_tiles, "whether w8a16_tiles_gemv was compiled in (AVX-512 VNNI)");
  // load-time repacking runs without the GIL: the engine loads the tokenizer on another thread meanwhile
  m.def("unpack_nibbles_t", &lt_unpack_nibbles_t,
        "int32 [R, C] of 8 nibbles -> uint8 codes [C*8, R], column c*8+j from nibble order[j] (w4_pack_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_w4_tiles_codes", &lt_pack_w4_tiles_codes,
        "uint8 codes [N, K] -> the packed codes [N/32, K/4, 64] of the tiled W4A16 layout (w4_pack_cpu.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &lt_rms_norm, "RMSNorm over the last dim (ops_cpu.cpp)");
  m.def("add_rms_norm", &lt_add_rms_norm, "residual add + RMSNorm -> (normed, sum)");
  m.def("silu_and_mul", &lt_silu_and_mul, "silu(gate) * up for gate_up [T, 2I]");
  m.def("rotary", &lt_rotary, "rotate-half RoPE of [T, heads, D] -> contiguous copy");
  m.def("rotary_kv_write", &lt_rotary_kv_write,
        "RoPE of q and k, rotated k and v written to one layer of a 16/32-bit paged cache at slots -> rotated q");
  m.def("paged_attention", &lt_paged_attention,
        "attention of prefill and decode rows over a 16/32-bit paged cache through block tables (attention_cpu.cpp)");
}
