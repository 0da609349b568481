"""The Triton backend (CUDA, and ROCm where Triton runs): fused W4A16 GEMM, paged attention over int8/int4/16-bit
KV, quantizing KV writes, fused RMSNorm and SiLU-and-mul (:mod:`backends.triton.kernels`); the rest (rotary,
prefill attention, dense linears) is the torch reference it inherits.

Importing this package does not import triton: the kernels load when a :class:`TritonBackend` is built, so
``TRITON_INTERPRET=1`` set before that runs them in Triton's interpreter on the CPU (how the tests run them
without a GPU).
"""
from __future__ import annotations

from .backend import TritonBackend, triton_version

__all__ = ["TritonBackend", "triton_version"]
