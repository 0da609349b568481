"""Layer-by-layer, memory-bounded, resumable weight quantization (RTN, GPTQ, AWQ) of a Hugging Face model.

1. The model skeleton is built on the meta device (accelerate ``init_empty_weights``); tensors are read
   from the safetensors files only when their layer is processed, so peak memory is about one decoder layer
   plus the calibration activations, whatever the model size.
2. The inputs of decoder layer 0 are captured for every calibration sample.
3. For each decoder layer: load it onto ``device`` in float32, gather statistics, quantize it, write its
   tensors to ``<work_dir>.partial/layer_NNNN.safetensors`` (atomic), put the *dequantized* weights back and
   run it to produce the next layer's inputs (so later layers see the quantization error), free it. With
   block-wise tuning the float layer also runs on the float model's own hidden states for the tuning samples
   (the float trajectory), whose outputs are the tuning targets.
4. When every layer is done, the checkpoint is assembled in a temporary folder (with ``e2e_steps``, its group
   scales and norm weights are first tuned end to end against the float model's logits, :mod:`lite.e2e`; that
   stage holds the whole model) and renamed to ``work_dir``.

``resume=True`` reuses the finished layer files of an interrupted run with the same options; the finished
layers are only re-run forward (from their saved tensors), so the result is identical to an uninterrupted run.

Mixture-of-Experts models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) run the same way: each sparse layer is its
per-expert block (:mod:`lite.moe`), its experts are quantized under their checkpoint names, the routers and
shared-expert gates stay 16-bit (named in the format's exclusion field, :func:`lite.formats.arch.unquantized_modules`),
and the experts that took the expert rule are counted in the final line and in ``liteturbo_quantize.json``
(``experts_without_tokens``, ``experts_rtn_fallback``, ``expert_token_threshold``, ``experts_total``).
``--e2e-steps`` is refused for them.

The options are :class:`lite.options.PipelineConfig` (re-exported here). The run kit (the lazy checkpoint, the
``.partial`` folder, the layer runner) is :mod:`lite.layerwise`, shared with :mod:`lite.kv_calibration`.
:func:`quantize_checkpoint` (with :class:`QuantConfig`) is the RTN shorthand.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backends.types import QuantizedWeight

from .calibration import calibration_samples, check_calib_seqlen
from .formats import (LiteturboError, arch_spec, atomic_output_dir, check_output_dir,
                      copy_tokenizer_files, load_config, resolve_model, write_json)
from .formats.arch import layer_linears, moe_config, unquantized_modules
from .formats.writing import SAFETENSORS_DTYPES, write_safetensors_streamed
from .formats.registry import WEIGHT_FORMATS, weight_format
from .layerwise import LazyCheckpoint, open_partial, peak_memory_gib
from .memory import check_e2e_fits
from .methods import METHODS, LayerBatch, compute_dtype
from .options import PipelineConfig
from .rotation import ResidualRotation
from .rtn import quantize_rtn

FORMATS = tuple(WEIGHT_FORMATS)


def check_group_size(state_dict: dict, names: list[str], group_size: int) -> None:
    """Raise ``LiteturboError`` naming the first layer whose in_features is not divisible by ``group_size`` (or whose
    out_features is not a multiple of 8). ``state_dict``: name → anything with ``.shape`` ``[out, in]``; ``names``:
    module paths of the linears (``<name>.weight`` in ``state_dict``)."""
    if group_size == -1:
        return
    for p in names:
        out_f, in_f = state_dict[f"{p}.weight"].shape
        if in_f % group_size:
            good = [g for g in (128, 64, 32) if all(state_dict[f"{n}.weight"].shape[1] % g == 0 for n in names)]
            hint = f"; use --w-group-size {good[0]}" if good else "; use --w-group-size -1 (per-channel)"
            raise LiteturboError(f"layer {p} has in_features={in_f}, which is not divisible by the group size "
                                 f"{group_size}{hint}")
        if out_f % 8:
            raise LiteturboError(f"layer {p} has out_features={out_f}, not a multiple of 8 as AWQ GEMM packing needs")


def _sanitize(layer, idx: int, qws: dict[str, QuantizedWeight], cfg: PipelineConfig,
              dtypes: dict[str, torch.dtype]) -> dict[str, QuantizedWeight]:
    """Never write NaN/inf: a weight whose scales came out non-finite is re-quantized with RTN, and a float
    tensor that is not finite in its checkpoint dtype (``dtypes``, by full name) is clamped to it (both warned)."""
    min_zero = weight_format(cfg.out_format).min_zero(bool(cfg.w_sym))
    for n, qw in qws.items():
        if not torch.isfinite(qw.scales.float()).all():
            warnings.warn(f"layer {idx} {n}: non-finite scales from {cfg.method}; falling back to RTN for this linear")
            w = torch.nan_to_num(layer.get_submodule(n).weight.data.float(), nan=0.0, posinf=0.0, neginf=0.0)
            qws[n] = quantize_rtn(w, cfg.w_bits, cfg.w_group_size, bool(cfg.w_sym), min_zero=min_zero)
    for n, p in layer.named_parameters():
        if n.rsplit(".", 1)[0] in qws and n.endswith(".weight"):
            continue
        dtype = dtypes.get(f"model.layers.{idx}.{n}", torch.float16)
        if not torch.isfinite(p.data.to(dtype)).all():
            big = torch.finfo(dtype).max
            warnings.warn(f"layer {idx} {n}: values that are NaN or beyond {str(dtype).replace('torch.', '')}'s range "
                          f"({big:.4g}) clamped")
            p.data = torch.nan_to_num(p.data.float(), nan=0.0, posinf=big, neginf=-big).clamp(-big, big)
    return qws


# ----------------------------------------------------------------------------------------------------
def _layer_tensors(layer, idx: int, qws: dict[str, QuantizedWeight], cfg: PipelineConfig,
                   dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """All tensors of layer ``idx`` as they go into the output checkpoint."""
    p = f"model.layers.{idx}"
    out = {}
    for n, param in layer.named_parameters():
        mod = n.rsplit(".", 1)[0]
        if mod in qws and n.endswith(".weight"):
            continue
        out[f"{p}.{n}"] = param.data.detach().to("cpu", dtypes.get(f"{p}.{n}", torch.float16)).contiguous()
    fmt = weight_format(cfg.out_format)
    for n, qw in qws.items():
        for k, v in fmt.pack(qw).items():
            out[f"{p}.{n}.{k}"] = v.cpu()
    return out


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere). glibc serves blocks
    below its mmap threshold, which adapts up to 32 MiB, from its heaps and keeps them when freed: a sparse layer's
    16 MiB expert Hessians and per-expert weights stayed resident after use, ~1.5 GiB at Qwen3-30B-A3B shapes."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _load_layer_tensors(layer, idx: int, tensors: dict[str, torch.Tensor], cfg: PipelineConfig,
                        linear_dtype: torch.dtype, linears) -> None:
    """Put a finished layer's saved tensors back into ``layer`` (dequantized weights in ``linear_dtype``: the
    compute dtype, to which autocast casts them anyway; norms, biases and 16-bit routers in float32). ``linears``: the
    layer's quantized linears (:func:`lite.formats.arch.layer_linears`)."""
    p = f"model.layers.{idx}"
    linears = set(linears)
    dev = next(iter(layer.parameters())).device
    for n, param in layer.named_parameters():
        key = f"{p}.{n}"
        mod = n.rsplit(".", 1)[0]
        if key in tensors:
            param.data = tensors[key].to(dev, torch.float32)
        elif n.endswith(".weight") and mod in linears:
            fmt, pre = weight_format(cfg.out_format), f"{p}.{mod}."
            parts = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
            qw = fmt.unpack(parts, cfg.w_bits, cfg.w_group_size, bool(cfg.w_sym))
            param.data = qw.dequantize(torch.float32).to(dev, linear_dtype)
        else:
            raise LiteturboError(f"saved layer {idx} lacks {key}; delete the .partial folder and start again")


def quantize_model(model: str | None, cfg: PipelineConfig, work_dir: str, overwrite: bool = False,
                   resume: bool = False, stop_after_layers: int | None = None) -> Path:
    """Run the layer-wise pipeline and write the quantized checkpoint to ``work_dir``; returns its path.

    Validates everything before any work. ``stop_after_layers`` (testing) raises ``KeyboardInterrupt`` after
    that many layers, as a Ctrl-C would. Raises ``LiteturboError`` for bad input.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    src = resolve_model(model)
    config = load_config(src)
    arch_spec(config)
    moe = moe_config(config)
    if config.get("quantization_config"):
        raise LiteturboError(f"{src} is already quantized; start from a 16/32-bit checkpoint")
    if moe is not None and cfg.e2e_steps:
        raise LiteturboError("--e2e-steps is not supported for Mixture-of-Experts models yet (it runs the whole "
                             "transformers model, whose experts are fused); drop --e2e-steps")
    out = check_output_dir(Path(work_dir), overwrite, source=src)
    device = cfg.torch_device()
    if cfg.choices:
        print(f"[liteturbo] {cfg.method} defaults: " + "; ".join(cfg.choices), file=sys.stderr)
    torch.manual_seed(cfg.seed)
    lazy = LazyCheckpoint(src, device)
    lazy.check_shapes()
    n_layers = len(lazy.layers)
    shapes = {}
    for i in range(n_layers):
        for n in layer_linears(config, i):
            k = f"model.layers.{i}.{n}.weight"
            if k in lazy.where:
                shapes[k] = lazy.shapes[k]
    names = [k[: -len(".weight")] for k in shapes]
    check_group_size({k: _Shape(v) for k, v in shapes.items()}, names, cfg.w_group_size)
    dtypes = {k: _dtype(v) for k, v in lazy.dtype_names.items()}
    fmt = weight_format(cfg.out_format)
    method = METHODS[cfg.method](cfg, config, fmt.min_zero(bool(cfg.w_sym)))
    rotation = None
    if cfg.rotate:
        rotation = ResidualRotation(int(config["hidden_size"]), config, cfg.seed)
    cdtype = compute_dtype(cfg.compute_dtype, device)
    if cfg.e2e_steps:  # the end-to-end stage holds the whole float model: refuse now rather than after the layers
        check_e2e_fits(config, cfg.method, cfg.calib_samples, cfg.calib_seqlen, cfg.e2e_steps, device,
                       compute_bytes=4 if cdtype == torch.float32 else 2)

    samples = []
    if method.calibrated:  # RTN needs no calibration data; bad data fails here, before .partial exists
        check_calib_seqlen(config, cfg.calib_seqlen)
        tok = AutoTokenizer.from_pretrained(str(src))
        samples = calibration_samples(tok, cfg.calib_dataset, cfg.calib_samples, cfg.calib_seqlen, cfg.seed)

    partial = open_partial(out, cfg.fingerprint(src), {"config": asdict(cfg), "source": str(src)}, resume)
    old_term = _exit_on_sigterm()
    try:
        n_tok, reused, notes = _quantize_layers(lazy, method, samples, cdtype, partial, dtypes, stop_after_layers,
                                                rotation, config)
    except BaseException:
        if not any(partial.glob("layer_*.safetensors")):  # nothing worth resuming: leave nothing behind
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    experts = _expert_counts(moe, cfg, n_tok, notes)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        outside = {}  # the tensors outside the decoder layers that the run changed (a rotation folds into them)
        if rotation is not None:
            embed = lazy.tensor("model.embed_tokens.weight")
            head = lazy.tensor("lm_head.weight") if "lm_head.weight" in lazy.where else embed
            outside["model.embed_tokens.weight"], outside["lm_head.weight"], outside["model.norm.weight"] = \
                rotation.fold_outside(embed, head, lazy.tensor("model.norm.weight"))
            config = dict(config, tie_word_embeddings=False)
        layer_files = [partial / f"layer_{i:04d}.safetensors" for i in range(n_layers)]
        e2e = None
        if cfg.e2e_steps:
            from .e2e import tune_end_to_end
            tensors = {k: lazy.tensor(k) for k in lazy.where if not k.startswith("model.layers.")}
            tensors.update(outside)
            for f in layer_files:
                tensors.update(load_file(str(f)))
            lazy = None  # unmaps the source files: this stage holds the whole model
            tensors, e2e = tune_end_to_end(src, tensors, fmt, cfg.w_bits, cfg.w_group_size, bool(cfg.w_sym), samples,
                                           cfg.e2e_steps, device, cdtype)
            print(f"[liteturbo] end-to-end tuning: {e2e['steps']} steps over {e2e['train_windows']} windows, held-out "
                  f"KL {e2e['held_out_kl_before']:.4g} -> {e2e['held_out_kl_after']:.4g} "
                  f"({'kept' if e2e['kept'] else 'not lower: the method values kept'}), {e2e['seconds']} s",
                  file=sys.stderr)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
        else:  # streamed tensor by tensor: memory stays about one tensor, whatever the model size
            _write_streamed(tmp / "model.safetensors", lazy, outside, layer_files)
        qc = fmt.config(dataclasses.replace(cfg.format_options(), unquantized=unquantized_modules(config)))
        write_json(tmp / "config.json", dict(config, quantization_config=qc))
        for name, content in fmt.extra_files(qc).items():
            write_json(tmp / name, content)
        copy_tokenizer_files(src, tmp)
        wall = time.perf_counter() - t0
        # provenance: how this checkpoint was made, and what it cost
        write_json(tmp / "liteturbo_quantize.json", {
            "source": str(src), "options": asdict(cfg), "calibration_tokens": n_tok, "device": device.type,
            "compute_dtype": str(cdtype).replace("torch.", ""), "wall_seconds": round(wall, 1),
            "peak_memory_gib": round(peak_memory_gib(device), 2), "reused_layers": reused,
            "tune_seconds": round(method.tune_seconds, 1), "e2e": e2e, "torch_threads": torch.get_num_threads(),
            **experts, "notes": notes})
    shutil.rmtree(partial, ignore_errors=True)
    print(f"[liteturbo] {cfg.method}: wrote {out} ({cfg.out_format} format, {'symmetric' if cfg.w_sym else 'zero point'}"
          f") in {wall:.1f} s, peak memory {peak_memory_gib(device):.2f} GiB ({device.type})"
          + _experts_summary(experts)
          + (f"; {len(notes)} notes in liteturbo_quantize.json" if notes else ""), file=sys.stderr)
    return out


def _expert_counts(moe, cfg: PipelineConfig, n_tok: int, notes: list[dict]) -> dict:
    """The provenance fields of the expert rule (:mod:`lite.moe`) for a MoE run, from the layers' notes: how many
    experts had no routed calibration token (``experts_without_tokens``) and how many were rounded to nearest for
    having fewer than ``expert_token_threshold`` (``experts_rtn_fallback``, those without tokens included), of
    ``experts_total``; ``None`` counts for ``rtn``, which reads no calibration tokens. Empty for a dense model."""
    if moe is None:
        return {}
    from .moe import expert_token_threshold

    total = moe.num_experts * sum(moe.sparse)
    if cfg.method == "rtn":
        return {"experts_total": total, "experts_without_tokens": None, "experts_rtn_fallback": None,
                "expert_token_threshold": None}
    return {"experts_total": total,
            "experts_without_tokens": sum(len(n.get("experts_without_tokens", ())) for n in notes),
            "experts_rtn_fallback": sum(len(n.get("experts_rtn_fallback", ())) for n in notes),
            "expert_token_threshold": expert_token_threshold(n_tok, moe)}


def _experts_summary(experts: dict) -> str:
    """The final line's part about the expert rule ("" for a dense model or an RTN run)."""
    if not experts or experts["experts_rtn_fallback"] is None:
        return ""
    return (f"; {experts['experts_rtn_fallback']} of {experts['experts_total']} experts rounded to nearest (fewer than "
            f"{experts['expert_token_threshold']} routed calibration tokens; {experts['experts_without_tokens']} "
            f"with none)")


def _quantize_layers(lazy: LazyCheckpoint, method, samples, cdtype: torch.dtype, partial: Path,
                     dtypes: dict[str, torch.dtype], stop_after_layers: int | None,
                     rotation=None, config: dict | None = None) -> tuple[int, int, list[dict]]:
    """The layer loop: quantize each decoder layer with ``method`` (or reuse its file in ``partial``), write it,
    put the dequantized weights back and run the layer for the next one's inputs; with a ``rotation``
    (:class:`lite.rotation.ResidualRotation`) each layer is rotated first and so are layer 0's inputs. ``config``:
    config.json (which linears each layer quantizes; default: the lazy checkpoint's). Returns (calibration tokens,
    reused layers, notes of every layer). The progress bar shows the peak memory and the last layer's seconds."""
    from safetensors.torch import load_file, save_file

    cfg = method.cfg
    n_layers = len(lazy.layers)
    # with a rotation the float32 states are rotated first, then stored in the compute dtype
    inps, kws = lazy.capture_inputs(samples, None if rotation is not None else cdtype) if samples else ([], [])
    if rotation is not None:
        inps = [rotation.rotate_inputs(h) for h in inps]
    batch = LayerBatch([x.to(cdtype) for x in inps], kws, cdtype)
    del inps
    n_tok = sum(x.shape[1] for x in batch.inputs)
    bar = tqdm(range(n_layers), desc=f"{cfg.method} W{cfg.w_bits}A16 g{cfg.w_group_size} ({n_tok} calib tokens)",
               unit="layer")
    reused, notes = 0, []
    # tuning fits each layer to the float model's trajectory: keep its inputs for the tuning samples
    reference = None
    if cfg.tune_steps > 0 and batch.inputs:
        n_ref = batch.loss_samples(cfg.loss_tokens)
        reference = LayerBatch([x.clone() for x in batch.inputs[:n_ref]], kws[:n_ref], cdtype)
    config = lazy.config if config is None else config
    for i in bar:
        t_layer = time.perf_counter()
        layer = lazy.layers[i]
        # RTN without a rotation only reads each weight (as float32, one at a time): keep the layer as stored
        lazy.materialize(layer, f"model.layers.{i}", float32=method.calibrated or rotation is not None)
        if rotation is not None:
            rotation.fold_layer(layer, i)
        if reference is not None:
            batch.targets = reference.run(layer)  # the float layer on the float trajectory
        f = partial / f"layer_{i:04d}.safetensors"
        notes_file = partial / f"layer_{i:04d}.json"
        if f.is_file():
            tensors = load_file(str(f))
            if notes_file.is_file():
                notes += json.loads(notes_file.read_text())
            reused += 1
        else:
            method.layer_index, method.notes = i, []
            method.fold_dtypes = {n.rsplit(".", 1)[0]: dtypes.get(f"model.layers.{i}.{n}", torch.float16)
                                  for n, _ in layer.named_parameters()}
            qws = {n: _on_cpu(q) for n, q in method.run(layer, batch).items()}  # packing runs on the CPU
            tensors = _layer_tensors(layer, i, _sanitize(layer, i, qws, cfg, dtypes), cfg, dtypes)
            del qws
            _return_freed_memory()  # the statistics and the solver's buffers, before the layer is reloaded
            write_json(notes_file, method.notes)
            notes += method.notes
            tmp = f.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, f)
        if method.calibrated:  # the next layer's inputs come from this one, quantized (RTN reads no inputs)
            _load_layer_tensors(layer, i, tensors, cfg, batch.dtype, layer_linears(config, i))
        if reference is not None:
            reference.inputs, batch.targets = batch.targets, None
        if i + 1 < n_layers and method.calibrated:
            batch.inputs = batch.run(layer)
        lazy.release(layer)
        _return_freed_memory()
        post = {"peak_gib": f"{peak_memory_gib(lazy.device):.2f}", "layer_s": f"{time.perf_counter() - t_layer:.1f}"}
        if getattr(method, "tune_losses", None):
            post["tune"] = "{:.2e}->{:.2e}".format(*method.tune_losses)
        bar.set_postfix(**post)
        if stop_after_layers is not None and i + 1 - reused >= stop_after_layers:
            raise KeyboardInterrupt(f"stopped after {i + 1} layers (test hook)")
    return n_tok, reused, notes


def _write_streamed(path: Path, lazy: LazyCheckpoint, outside: dict[str, torch.Tensor],
                    layer_files: list[Path]) -> None:
    """The output ``model.safetensors`` written one tensor at a time: the source's tensors outside the decoder layers
    (those in ``outside`` as the run changed them), then every finished layer file's tensors."""
    from safetensors import safe_open

    specs, where = [], {}
    for k in lazy.where:
        if not k.startswith("model.layers.") and k not in outside:
            specs.append((k, SAFETENSORS_DTYPES[lazy.dtype_names[k]], lazy.shapes[k]))
    specs += [(k, v.dtype, tuple(v.shape)) for k, v in outside.items()]
    for f in layer_files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                specs.append((k, SAFETENSORS_DTYPES[sl.get_dtype()], tuple(sl.get_shape())))
                where[k] = str(f)

    def read(name: str) -> torch.Tensor:
        """One tensor, read through a mapping closed at once (its pages do not stay resident)."""
        if name in outside:
            return outside[name]
        if name not in where:
            return lazy.tensor(name)
        with safe_open(where[name], "pt") as h:
            return h.get_tensor(name)

    write_safetensors_streamed(path, specs, read, metadata={"format": "pt"})


def _exit_on_sigterm():
    """Make SIGTERM (``kill``, ``timeout``) raise ``SystemExit(143)`` so a killed run cleans up as Ctrl-C does;
    returns the handler to restore, or ``None`` off the main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, frame):
        """Unwind like an exception, so ``finally`` blocks and the partial-run cleanup run."""
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, on_term)


def _on_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with every tensor on the CPU (methods may return them on the run's device)."""
    return dataclasses.replace(qw, **{f.name: getattr(qw, f.name).cpu() for f in dataclasses.fields(qw)
                                      if isinstance(getattr(qw, f.name), torch.Tensor)})


class _Shape:
    """Stands in for a tensor where only ``.shape`` is read."""

    def __init__(self, shape) -> None:
        self.shape = tuple(shape)


def _dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}.get(
        name, torch.float16)


# ----------------------------------------------------------------------------------------------------
# The RTN shorthand: the options of ``liteturbo lite rtn`` into an AWQ GEMM checkpoint, through quantize_model.
@dataclass
class QuantConfig:
    """Options of an RTN run through :func:`quantize_checkpoint` (validated on construction).

    w_bits: bits per weight (the AWQ GEMM format stores 4). w_group_size: input channels per group, or -1.
    w_sym: symmetric (no zero point). work_dir: output checkpoint folder. overwrite: replace ``work_dir``.
    """

    w_bits: int = 4
    w_group_size: int = 128
    w_sym: bool = False
    work_dir: str = "./work_dir"
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.w_bits != 4:
            raise LiteturboError(f"--w-bits {self.w_bits} is not supported: the AWQ GEMM format stores 4-bit weights")
        if self.w_group_size != -1 and (self.w_group_size < 8 or self.w_group_size % 8):
            raise LiteturboError(f"--w-group-size must be -1 or a positive multiple of 8, got {self.w_group_size}")


def quantize_checkpoint(model: str | None, qcfg: QuantConfig, method: str = "rtn") -> Path:
    """Round-to-nearest quantization of ``model`` on the CPU into an AWQ GEMM checkpoint at ``qcfg.work_dir``;
    returns its path. :func:`quantize_model` with ``PipelineConfig(method="rtn", out_format="awq", device="cpu")``.
    Raises ``LiteturboError`` for bad input, before any work.
    """
    if method != "rtn":
        raise LiteturboError(f"quantize_checkpoint runs rtn only; use lite.pipeline.quantize_model for {method}")
    cfg = PipelineConfig(method="rtn", w_bits=qcfg.w_bits, w_group_size=qcfg.w_group_size, w_sym=qcfg.w_sym,
                         out_format="awq", device="cpu")
    return quantize_model(model, cfg, qcfg.work_dir, overwrite=qcfg.overwrite)
