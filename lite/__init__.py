"""lite: offline W4A16 quantization into standard checkpoint formats (AWQ GEMM, GPTQ, compressed-tensors).

:mod:`lite.pipeline` is the one resumable layer-by-layer driver (on :mod:`lite.layerwise`'s run kit) for every
method of :mod:`lite.methods` (RTN, AWQ, GPTQ; optional block-wise tuning and residual rotation);
:mod:`lite.kv_calibration` calibrates int8/int4 KV-cache parameters; :mod:`lite.memory` estimates a run's peak
memory; :mod:`lite.formats` owns every on-disk layout; :mod:`lite.cli` is ``liteturbo lite ...``. ``lite`` never
imports ``turbo``.
"""
