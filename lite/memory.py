"""Peak memory of a ``lite`` quantization run, estimated from ``config.json`` before anything is loaded.

The pipeline (:mod:`lite.pipeline`) works one decoder layer at a time, so its peak is set by the largest layer and
the calibration activations, whatever the model size. Statistics are streamed (:mod:`lite.methods`): nothing grows
with the calibration set except the layer's inputs and outputs. Phases and what they hold (N calibration windows of
L tokens, hidden size H, intermediate size I, layer weights in float32, activations in the compute dtype of ``c``
bytes: 2 for bfloat16, 4 for float32):

* capture: the embedding table ``[V, H]`` (float32) and the inputs of layer 0, ``N x L x H`` in float32 and again
  in the compute dtype.
* with ``--tune-steps``: four float32 copies of the layer's weights (rounding offsets, their gradients, Adam's two
  moments) and the autograd activations of a 4-sample batch.
* with ``--e2e-steps`` (:mod:`lite.e2e`, after the layers): the whole float model in the compute dtype (the teacher,
  while its outputs are taken), then the student: int8 codes (one byte per quantized weight), float32 scales with
  ``δ``, its gradient and Adam's moments, and the autograd activations of one window (``L x layers x (6H + 2 x heads
  x head_dim + 4I) x c``), with the output head's logits for 128 tokens at a time (eight float32 ``128 x V``:
  both models' logits and log-probabilities, the KL terms, the gradient).
* per layer: the layer's weights, its inputs and, while it runs, its outputs (``2 x N x L x H x c``); then by method:

  - ``rtn``: a float32 copy of the largest linear while it is quantized (no calibration data).
  - ``awq``: the first ``loss_tokens`` tokens of each linear input (q/k/v and gate/up share theirs: ``T x (2H +
    heads x head_dim + I) x c``), the loss search's outputs in float32 (reference, candidate, difference: ``3 x T x
    H``), the MLP's intermediates while it runs (``3 x T x I`` float32) and a linear's concatenated loss inputs
    (``T x max(q, I) x c``), the clipping inputs and the search's weight copies (3 x the largest scaling group); with ``gptq`` rounding the four
    input Hessians (``2H² + q² + I²`` floats).
  - ``gptq``: for the largest input (the MLP's down projection), its Hessian (``in x in``, float32, which the
    solver dampens, permutes and then replaces in place) with the solver's inverse and its Cholesky factor (2 more
    ``in x in``), the float32 working weight and its codes (``out x in x 5`` bytes). Measured at Llama-3.1-8B shapes
    (``python bench/scale.py --sizes 8b --calib-layers 1``, 2026-12-05): 4.96 GiB peak RSS for the process.

Measured against ``lite`` runs in ``tests/test_planner.py`` (the peak resident memory a run adds on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
F32 = 4


@dataclass
class QuantizeMemory:
    """Peak bytes of a run (``peak``) and its parts at the peak phase (``parts``, bytes), ``phase`` naming it."""

    peak: int
    phase: str
    parts: dict[str, int]


def quantize_peak(config: dict, method: str = "awq", calib_samples: int = 128, calib_seqlen: int = 512,
                  loss_tokens: int = 8192, awq_rounding: str = "rtn", compute_bytes: int = 2,
                  tune: bool = False, e2e: bool = False) -> QuantizeMemory:
    """Estimate the peak memory of ``liteturbo lite <method>`` for a model's ``config`` (its config.json as a dict).
    ``method``: ``rtn``, ``awq`` or ``gptq``; ``compute_bytes``: 2 (bfloat16 forwards, the default where native) or
    4 (float32); ``tune``: with ``--tune-steps`` (rounding offsets, their gradients and Adam's two moments per weight,
    and the autograd activations of 4 samples); ``e2e``: with ``--e2e-steps``; the other arguments as :class:`lite.pipeline.PipelineConfig`. Raises ``ValueError`` for an unknown
    method or a config without the needed fields."""
    if method not in ("rtn", "awq", "gptq"):
        raise ValueError(f"unknown method {method!r} (rtn, awq, gptq)")
    try:
        h = int(config["hidden_size"])
        inter = int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"config.json lacks or mangles a field the estimate needs: {e}") from None
    q, kvw = heads * hd, kv * hd
    c = compute_bytes
    linears = {"qkv": (q + 2 * kvw, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}
    layer_params = sum(o * i for o, i in linears.values()) + 2 * h
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        layer_params += q + 2 * kvw
    weights = layer_params * F32
    largest = max(o * i for o, i in linears.values()) * F32
    if method == "rtn":
        parts = {"layer weights": weights, "quantization copies": 2 * largest}
        return QuantizeMemory(sum(parts.values()), "layer", parts)
    tokens = calib_samples * calib_seqlen
    capture = {"embeddings": vocab * h * F32, "layer inputs": tokens * h * (F32 + c)}
    forward = {"layer weights": weights, "layer inputs": tokens * h * c, "layer outputs": tokens * h * c}
    if method == "awq":
        per_sample = -(-loss_tokens // calib_seqlen)
        lt = min(calib_samples, max(per_sample, 1)) * calib_seqlen
        # outputs of the inspected module (H wide) in float32: reference, candidate, difference; the MLP's
        # intermediates while it runs; the weight copies of the largest group
        method_parts = {"kept linear inputs": lt * (2 * h + q + inter) * c,
                        "scale search": lt * (3 * h * F32 + 3 * inter * F32 + max(q, inter) * c)
                        + 3 * max(linears["gate_up"][0] * h, linears["qkv"][0] * h) * F32,
                        "clip inputs": 2 * lt * max(h, q, inter) * c}
        if awq_rounding == "gptq":
            method_parts["hessians"] = (2 * h * h + q * q + inter * inter) * F32
    else:
        gptq_in = max(h, q, inter)
        out_for = {h: 2 * inter, q: h, inter: h}
        method_parts = {"hessian and inverse": 3 * gptq_in * gptq_in * F32,
                        "gptq weight copies": out_for.get(gptq_in, h) * gptq_in * (F32 + 1)}
    if tune:
        method_parts["tuning"] = 4 * layer_params * F32 + 4 * calib_seqlen * (12 * h + 6 * inter) * F32
    layer = {"layer weights": weights, "layer inputs": tokens * h * c, **method_parts}
    phases = [("capture", capture), ("layer forward", forward), ("layer search", layer)]
    if e2e:
        n_layers = int(config.get("num_hidden_layers") or 1)
        linear_params = n_layers * sum(o * i for o, i in linears.values())
        phases.append(("end-to-end tuning", {
            "float model": (linear_params + vocab * h) * c + vocab * h * F32,  # + the embeddings as read
            "codes and scales": linear_params + 5 * linear_params // 32 * F32,
            "assembled checkpoint": linear_params // 2 + 2 * vocab * h * c,  # packed linears, embeddings, head
            "activations of one window": calib_seqlen * n_layers * (6 * h + 2 * q + 4 * inter) * c,
            "head logits": 8 * 128 * vocab * F32}))  # both models' logits, log-probabilities, KL, gradient
    phase, parts = max(phases, key=lambda p: sum(p[1].values()))
    return QuantizeMemory(sum(parts.values()), phase, parts)


def available_bytes(device) -> int | None:
    """Memory free for a run on ``device`` (a ``torch.device``): ``MemAvailable`` of /proc/meminfo on a CPU (None
    where it cannot be read), the free bytes of ``torch.cuda.mem_get_info`` on a GPU."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_e2e_fits(config: dict, method: str, calib_samples: int, calib_seqlen: int, steps: int, device,
                   compute_bytes: int = 2, room: int | None = None) -> None:
    """Refuse ``--e2e-steps`` before any work when its phase (the whole float model as the teacher, the int8 codes
    and scales of every linear, the assembled checkpoint, one window's activations: :func:`quantize_peak`) needs
    more than the memory available on ``device`` (``room``: bytes, default :func:`available_bytes`). Raises
    ``LiteturboError`` naming both sizes and the fixes; ``LITETURBO_SKIP_MEMORY_CHECK=1`` skips the check."""
    import os

    from .formats import LiteturboError

    if os.environ.get("LITETURBO_SKIP_MEMORY_CHECK", "").strip() in ("1", "true", "yes"):
        return
    room = available_bytes(device) if room is None else room
    if room is None:
        return
    try:
        est = quantize_peak(config, method, calib_samples, calib_seqlen, compute_bytes=compute_bytes, e2e=True)
    except ValueError:  # a method or config the estimate does not model: no refusal on a guess
        return
    need = sum(est.parts.values()) if est.phase == "end-to-end tuning" else est.peak
    if need <= room:
        return
    where = "GPU" if getattr(device, "type", str(device)) == "cuda" else "host"
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in est.parts.items())
    raise LiteturboError(
        f"--e2e-steps {steps} would need about {need / GIB:.1f} GiB of {where} memory ({parts} GiB), but "
        f"{room / GIB:.1f} GiB is available: end-to-end tuning holds the whole float model as its teacher. "
        f"Run without --e2e-steps (the layer-wise {method} result is a complete checkpoint), or on a machine with "
        f"at least {need / GIB:.0f} GiB free (LITETURBO_SKIP_MEMORY_CHECK=1 runs it anyway)")


def quantize_fit(config: dict, method: str, calib_samples: int, calib_seqlen: int, room: int, device: str,
                 compute_bytes: int = 2) -> dict:
    """Whether ``liteturbo lite <method>`` fits in ``room`` bytes of ``device`` (the quantization line of
    ``liteturbo plan``), JSON-ready: ``method``, ``calib_samples`` / ``calib_seqlen`` (0 for ``rtn``, which reads
    no calibration data), ``device``, ``peak`` / ``phase`` / ``parts`` (:func:`quantize_peak`), ``room``, ``fits``
    and ``advice`` when it does not fit (the largest ``--calib-samples`` halved from the asked number, at least 8,
    that fits; else quantizing on the CPU). Raises ``ValueError`` as :func:`quantize_peak` does."""
    def peak(n: int) -> QuantizeMemory:
        """The estimate with ``n`` calibration windows."""
        return quantize_peak(config, method, n, calib_seqlen, compute_bytes=compute_bytes)

    q = peak(calib_samples)
    advice = ""
    if q.peak > room and method != "rtn":
        n = calib_samples
        while n > 8 and peak(n).peak > room:
            n //= 2
        advice = f"--calib-samples {n} fits" if peak(n).peak <= room else \
            "quantize on the CPU (--device cpu) where RAM allows"
    if method == "rtn":
        calib_samples = calib_seqlen = 0
    return {"method": method, "calib_samples": calib_samples, "calib_seqlen": calib_seqlen, "device": device,
            "peak": q.peak, "phase": q.phase, "parts": q.parts, "room": room, "fits": q.peak <= room,
            "advice": advice}
