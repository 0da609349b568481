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
4. When every layer is done, the checkpoint is assembled in a temporary folder and renamed to ``work_dir``.

``resume=True`` reuses the finished layer files of an interrupted run with the same options; the finished
layers are only re-run forward (from their saved tensors), so the result is identical to an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from backends.types import QuantizedWeight

from .formats import (DECODER_LINEARS, LiteturboError, arch_spec, atomic_output_dir, check_output_dir,
                      copy_tokenizer_files, load_config, resolve_model, write_json)
from .formats.checkpoint import config_mismatch, weight_files
from .formats.registry import WEIGHT_FORMATS, FormatOptions, weight_format
from .methods import METHODS, LayerBatch, _Stop, compute_dtype

FORMATS = tuple(WEIGHT_FORMATS)


@dataclass
class PipelineConfig:
    """Everything a quantization run depends on (validated on construction; hashed for ``--resume``).

    method: rtn | awq | gptq (:data:`lite.methods.METHODS`). w_bits/w_group_size/w_sym: the weight format;
    ``w_sym=None`` takes the output format's default (what its readers load: symmetric for GPTQ, a zero point for
    AWQ and compressed-tensors). out_format: awq | gptq | compressed-tensors (``None`` = awq for rtn/awq, gptq for
    gptq). calib_*: calibration data (see :mod:`lite.calibration`). act_order/static_groups/damp_percent/
    block_size/true_sequential: GPTQ (also AWQ's ``gptq`` rounding). n_grid/duo_scaling/clip/max_shrink/
    loss_tokens: AWQ; awq_rounding: ``rtn`` (the paper) or ``gptq`` (AWQ's scales and clipping, then GPTQ's
    error-compensating rounding on the scaled inputs). mse_scales: group scales/zero points by the smallest
    rounding error over shrunk ranges (RTN and GPTQ rounding). rotate: fold a random rotation of the residual stream
    into the weights first (:mod:`lite.rotation`; seeded by ``seed``; unties a tied head). tune_steps: steps of
    block-wise tuning of rounding and scales after the method (:mod:`lite.tune`; 0 = off; each layer is fitted to
    the float model's outputs on the first ``loss_tokens`` calibration tokens). device: cpu | cuda | auto.
    compute_dtype: auto | bfloat16 | float32 (the calibration forwards; solvers always run in float32).
    """

    method: str = "awq"
    w_bits: int = 4
    w_group_size: int = 128
    w_sym: bool | None = None
    out_format: str | None = None
    calib_dataset: str = "c4"
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 42
    act_order: bool = False
    static_groups: bool = False
    damp_percent: float = 0.01
    block_size: int = 128
    true_sequential: bool = True
    n_grid: int = 20
    duo_scaling: bool = True
    awq_rounding: str = "rtn"
    clip: bool = True
    max_shrink: float = 0.5
    loss_tokens: int = 8192
    mse_scales: bool = False
    rotate: bool = False
    tune_steps: int = 0
    device: str = "auto"
    compute_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LiteturboError(f"unknown method {self.method!r} ({', '.join(METHODS)})")
        if self.w_bits != 4:
            raise LiteturboError(f"--w-bits {self.w_bits} is not supported: the W4A16 formats store 4-bit weights")
        if self.w_group_size != -1 and (self.w_group_size < 8 or self.w_group_size % 8):
            raise LiteturboError(f"--w-group-size must be -1 or a positive multiple of 8, got {self.w_group_size}")
        if self.out_format is None:
            self.out_format = "gptq" if self.method == "gptq" else "awq"
        fmt = weight_format(self.out_format)
        if self.w_sym is None:
            self.w_sym = fmt.default_sym
        uses_gptq = self.method == "gptq" or (self.method == "awq" and self.awq_rounding == "gptq")
        if (self.act_order or self.static_groups or self.damp_percent != type(self).damp_percent) and not uses_gptq:
            raise LiteturboError("--act-order, --static-groups and --damp-percent set GPTQ's rounding; use them with "
                                 "`lite gptq` or `lite auto-awq --rounding gptq`")
        if self.static_groups and not self.act_order:
            raise LiteturboError("--static-groups only matters with --act-order")
        fmt.check(self.format_options())
        if self.act_order and not self.static_groups:
            warnings.warn("--act-order without --static-groups writes a g_idx (desc_act / actorder=group): turbo, "
                          "transformers and GPTQModel read it, vLLM 0.32 refuses it; add --static-groups for vLLM")
        if not 0 < self.damp_percent < 1:
            raise LiteturboError(f"--damp-percent must be in (0, 1), got {self.damp_percent}")
        if self.awq_rounding not in ("rtn", "gptq"):
            raise LiteturboError(f"awq rounding must be rtn or gptq, got {self.awq_rounding!r}")
        if self.tune_steps < 0:
            raise LiteturboError(f"--tune-steps must be >= 0, got {self.tune_steps}")
        if self.block_size < 1 or self.n_grid < 1 or self.loss_tokens < 1:
            raise LiteturboError("block_size, n_grid and loss_tokens must be >= 1")
        if not 0 < self.max_shrink < 1:
            raise LiteturboError(f"max_shrink must be in (0, 1), got {self.max_shrink}")
        if self.calib_samples <= 0 or self.calib_seqlen <= 0:
            raise LiteturboError("--calib-samples and --calib-seqlen must be positive")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LiteturboError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            raise LiteturboError(f"--compute-dtype must be auto, bfloat16 or float32, got {self.compute_dtype!r}")

    def format_options(self) -> FormatOptions:
        """What the output format records about this run."""
        return FormatOptions(self.w_bits, self.w_group_size, bool(self.w_sym), self.act_order, self.static_groups,
                             self.damp_percent, self.true_sequential)

    def torch_device(self) -> torch.device:
        """The compute device (``auto`` = cuda when available)."""
        return resolve_device(self.device)

    def fingerprint(self, source: Path) -> str:
        """Hash of the options and the source weights' names/sizes/mtimes (what --resume must match)."""
        return run_fingerprint(asdict(self), source)


def resolve_device(device: str) -> torch.device:
    """``--device`` of a lite command → torch device (``auto`` = cuda when available). Raises ``LiteturboError``
    when cuda is asked for without a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LiteturboError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def run_fingerprint(options: dict, source: Path) -> str:
    """Hash of a run's options and the source weights' names/sizes/mtimes (what ``--resume`` must match)."""
    files = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in weight_files(source)]
    blob = json.dumps({"cfg": options, "src": str(source.resolve()), "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def open_partial(out: Path, fingerprint: str, state: dict, resume: bool) -> Path:
    """The ``<out>.partial`` folder that keeps finished layers of a run: reused when ``resume`` and its
    fingerprint matches (``LiteturboError`` when it does not), otherwise started empty; ``state`` (with the
    fingerprint) is written to its ``state.json``."""
    partial = out.parent / f"{out.name}.partial"
    state_file = partial / "state.json"
    if partial.exists():
        old = json.loads(state_file.read_text()) if state_file.is_file() else {}
        if resume and old.get("fingerprint") != fingerprint:
            raise LiteturboError(f"{partial} was made with different options or source weights; rerun without "
                                 f"--resume to start over")
        if not resume:
            shutil.rmtree(partial)
    elif resume:
        print(f"[liteturbo] nothing to resume in {partial}; starting from layer 0", file=sys.stderr)
    partial.mkdir(parents=True, exist_ok=True)
    write_json(state_file, dict(state, fingerprint=fingerprint))
    return partial


# ----------------------------------------------------------------------------------------------------
class LazyCheckpoint:
    """A meta-device HF model whose tensors are read from safetensors on demand (accelerate).

    A W4A16 source (any format :mod:`lite.formats.quantized` reads) is accepted: its decoder linears are
    dequantized to float32 when their layer is materialized (used by ``calibrate-kv``)."""

    def __init__(self, path: Path, device: torch.device) -> None:
        from accelerate import init_empty_weights
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        from .formats import quantization_spec

        self.path, self.device = path, device
        self.qspec = quantization_spec(load_config(path))
        try:
            cfg = AutoConfig.from_pretrained(str(path))
            if self.qspec is not None:  # built as the 16-bit model; weights come dequantized
                cfg.quantization_config = None
                del cfg.quantization_config
            with init_empty_weights():
                self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        except Exception as e:  # transformers raises many types for malformed configs
            raise LiteturboError(f"transformers cannot build the model from {path / 'config.json'}: {e}") from e
        self.model.eval()
        self.files = {}
        self.where: dict[str, str] = {}
        for f in weight_files(path):
            try:
                h = safe_open(str(f), "pt")
            except Exception as e:  # SafetensorError, OSError
                raise LiteturboError(f"cannot read {f}: {e}; the file is damaged or not safetensors") from e
            self.files[str(f)] = h
            for k in h.keys():
                self.where[k] = str(f)
        self.layers = self.model.model.layers

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the source checkpoint (CPU, stored dtype)."""
        if name not in self.where:
            raise LiteturboError(f"checkpoint {self.path} lacks tensor {name!r}")
        return self.files[self.where[name]].get_tensor(name)

    def check_shapes(self) -> None:
        """Raise ``LiteturboError`` (the message ``turbo`` gives) when the weights do not match config.json: a
        tensor of another shape, a missing tensor, or decoder layers beyond ``num_hidden_layers``."""
        n_layers = len(self.layers)
        extra = sorted({k.split(".")[2] for k in self.where if k.startswith("model.layers.")}
                       - {str(i) for i in range(n_layers)}, key=lambda s: (len(s), s))
        if extra:
            raise LiteturboError(f"the weights hold decoder layers beyond num_hidden_layers={n_layers} in config.json "
                                 f"(e.g. layer {extra[0]}); config.json does not belong to these weights")
        for name, p in self.model.named_parameters():
            if name not in self.where:
                if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                    continue
                raise LiteturboError(f"checkpoint {self.path} lacks tensor {name!r} (an incomplete copy or download, "
                                     f"or a config.json that does not belong to these weights)")
            shape = tuple(self.files[self.where[name]].get_slice(name).get_shape())
            if shape != tuple(p.shape):
                raise config_mismatch(name, shape, tuple(p.shape))

    def materialize(self, module: torch.nn.Module, prefix: str) -> None:
        """Load ``module``'s parameters (``prefix.name``) onto the device in float32 (quantized linears of a
        W4A16 source dequantized)."""
        from accelerate.utils import set_module_tensor_to_device

        for n, _ in list(module.named_parameters()):
            key = f"{prefix}.{n}"
            if key not in self.where and self.qspec is not None and n.endswith(".weight"):
                value = self._dequantized(key[: -len(".weight")])
            else:
                value = self.tensor(key).float()
            set_module_tensor_to_device(module, n, self.device, value=value)

    def _dequantized(self, prefix: str) -> torch.Tensor:
        """float32 ``[out, in]`` weight of the quantized linear ``prefix``."""
        from .formats import load_quantized_linears

        tensors = {k: self.tensor(k) for k in self.where if k.startswith(prefix + ".") and k != f"{prefix}.bias"}
        qws = load_quantized_linears(tensors, self.qspec)
        if prefix not in qws:
            raise LiteturboError(f"checkpoint {self.path} lacks tensor {prefix + '.weight'!r} (nor its quantized form)")
        return qws[prefix].dequantize(torch.float32)

    def release(self, module: torch.nn.Module) -> None:
        """Drop ``module``'s weights (back to meta)."""
        module.to("meta")

    def capture_inputs(self, samples: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
        """Hidden states entering layer 0 and its keyword arguments (rotary, mask), per sample."""
        m = self.model.model
        self.materialize(m.embed_tokens, "model.embed_tokens")
        m.rotary_emb.to(self.device)
        store: list = []

        def hook(_mod, args, kwargs):
            h = args[0] if args else kwargs.pop("hidden_states")
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            store.append((h.detach(), kw))
            raise _Stop

        handle = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                for s in samples:
                    try:
                        m(input_ids=s.to(self.device), use_cache=False)
                    except _Stop:
                        pass
        finally:
            handle.remove()
        self.release(m.embed_tokens)
        return [h for h, _ in store], [kw for _, kw in store]


def _run_layer(layer, inps, kws) -> list[torch.Tensor]:
    """The layer's float32 outputs for every sample (``calibrate-kv`` propagates in float32)."""
    return LayerBatch(inps, kws, torch.float32).run(layer)


def _sanitize(layer, idx: int, qws: dict[str, QuantizedWeight], cfg: PipelineConfig,
              dtypes: dict[str, torch.dtype]) -> dict[str, QuantizedWeight]:
    """Never write NaN/inf: a weight whose scales came out non-finite is re-quantized with RTN, and a float
    tensor that is not finite in its checkpoint dtype (``dtypes``, by full name) is clamped to it (both warned)."""
    import warnings

    from .rtn import quantize_rtn

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


def _load_layer_tensors(layer, idx: int, tensors: dict[str, torch.Tensor], cfg: PipelineConfig) -> None:
    """Put a finished layer's saved tensors back into ``layer`` (dequantized weights, norms, biases)."""
    p = f"model.layers.{idx}"
    dev = next(iter(layer.parameters())).device
    for n, param in layer.named_parameters():
        key = f"{p}.{n}"
        mod = n.rsplit(".", 1)[0]
        if key in tensors:
            param.data = tensors[key].to(dev, torch.float32)
        elif n.endswith(".weight") and mod in DECODER_LINEARS:
            fmt, pre = weight_format(cfg.out_format), f"{p}.{mod}."
            parts = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
            qw = fmt.unpack(parts, cfg.w_bits, cfg.w_group_size, bool(cfg.w_sym))
            param.data = qw.dequantize(torch.float32).to(dev)
        else:
            raise LiteturboError(f"saved layer {idx} lacks {key}; delete the .partial folder and start again")


def peak_memory_gib(device: torch.device) -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def quantize_model(model: str | None, cfg: PipelineConfig, work_dir: str, overwrite: bool = False,
                   resume: bool = False, stop_after_layers: int | None = None) -> Path:
    """Run the layer-wise pipeline and write the quantized checkpoint to ``work_dir``; returns its path.

    Validates everything before any work. ``stop_after_layers`` (testing) raises ``KeyboardInterrupt`` after
    that many layers, as a Ctrl-C would. Raises ``LiteturboError`` for bad input.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from .calibration import calibration_samples, check_calib_seqlen
    from .quantize import check_group_size

    t0 = time.perf_counter()
    src = resolve_model(model)
    config = load_config(src)
    arch_spec(config)
    if config.get("quantization_config"):
        raise LiteturboError(f"{src} is already quantized; start from a 16/32-bit checkpoint")
    out = check_output_dir(Path(work_dir), overwrite, source=src)
    device = cfg.torch_device()
    torch.manual_seed(cfg.seed)
    lazy = LazyCheckpoint(src, device)
    lazy.check_shapes()
    n_layers = len(lazy.layers)
    shapes = {}
    for i in range(n_layers):
        for n in DECODER_LINEARS:
            k = f"model.layers.{i}.{n}.weight"
            if k in lazy.where:
                shapes[k] = lazy.files[lazy.where[k]].get_slice(k).get_shape()
    names = [k[: -len(".weight")] for k in shapes]
    check_group_size({k: _Shape(v) for k, v in shapes.items()}, names, cfg.w_group_size)
    dtypes = {k: lazy.files[f].get_slice(k).get_dtype() for k, f in lazy.where.items()}
    dtypes = {k: _dtype(v) for k, v in dtypes.items()}
    fmt = weight_format(cfg.out_format)
    method = METHODS[cfg.method](cfg, config["model_type"], fmt.min_zero(bool(cfg.w_sym)))
    rotation = None
    if cfg.rotate:
        from .rotation import ResidualRotation

        rotation = ResidualRotation(int(config["hidden_size"]), config["model_type"], cfg.seed)
    cdtype = compute_dtype(cfg.compute_dtype, device)

    samples = []
    if method.calibrated:  # RTN needs no calibration data; bad data fails here, before .partial exists
        check_calib_seqlen(config, cfg.calib_seqlen)
        tok = AutoTokenizer.from_pretrained(str(src))
        samples = calibration_samples(tok, cfg.calib_dataset, cfg.calib_samples, cfg.calib_seqlen, cfg.seed)

    partial = open_partial(out, cfg.fingerprint(src), {"config": asdict(cfg), "source": str(src)}, resume)
    try:
        n_tok, reused, notes = _quantize_layers(lazy, method, samples, cdtype, partial, dtypes, stop_after_layers,
                                                rotation)
    except BaseException:
        if not any(partial.glob("layer_*.safetensors")):  # nothing worth resuming: leave nothing behind
            shutil.rmtree(partial, ignore_errors=True)
        raise

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        tensors = {}
        for k in lazy.where:
            if not k.startswith("model.layers."):
                tensors[k] = lazy.tensor(k)
        if rotation is not None:
            embed = tensors["model.embed_tokens.weight"]
            tensors["model.embed_tokens.weight"], tensors["lm_head.weight"], tensors["model.norm.weight"] = \
                rotation.fold_outside(embed, tensors.get("lm_head.weight", embed), tensors["model.norm.weight"])
            config = dict(config, tie_word_embeddings=False)
        for i in range(n_layers):
            tensors.update(load_file(str(partial / f"layer_{i:04d}.safetensors")))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        qc = fmt.config(cfg.format_options())
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
            "torch_threads": torch.get_num_threads(), "notes": notes})
    shutil.rmtree(partial, ignore_errors=True)
    print(f"[liteturbo] {cfg.method}: wrote {out} ({cfg.out_format} format, {'symmetric' if cfg.w_sym else 'zero point'}"
          f") in {wall:.1f} s, peak memory {peak_memory_gib(device):.2f} GiB ({device.type})"
          + (f"; {len(notes)} notes in liteturbo_quantize.json" if notes else ""), file=sys.stderr)
    return out


def _quantize_layers(lazy: LazyCheckpoint, method, samples, cdtype: torch.dtype, partial: Path,
                     dtypes: dict[str, torch.dtype], stop_after_layers: int | None,
                     rotation=None) -> tuple[int, int, list[dict]]:
    """The layer loop: quantize each decoder layer with ``method`` (or reuse its file in ``partial``), write it,
    put the dequantized weights back and run the layer for the next one's inputs; with a ``rotation``
    (:class:`lite.rotation.ResidualRotation`) each layer is rotated first and so are layer 0's inputs. Returns
    (calibration tokens, reused layers, notes of every layer)."""
    from safetensors.torch import load_file, save_file

    cfg = method.cfg
    n_layers = len(lazy.layers)
    inps, kws = lazy.capture_inputs(samples) if samples else ([], [])
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
    for i in bar:
        layer = lazy.layers[i]
        lazy.materialize(layer, f"model.layers.{i}")
        if rotation is not None:
            rotation.fold_layer(layer)
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
            write_json(notes_file, method.notes)
            notes += method.notes
            tmp = f.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, f)
        _load_layer_tensors(layer, i, tensors, cfg)
        if reference is not None:
            reference.inputs, batch.targets = batch.targets, None
        if i + 1 < n_layers and method.calibrated:
            batch.inputs = batch.run(layer)
        lazy.release(layer)
        post = {"peak_gib": f"{peak_memory_gib(lazy.device):.2f}"}
        if getattr(method, "tune_losses", None):
            post["tune"] = "{:.2e}->{:.2e}".format(*method.tune_losses)
        bar.set_postfix(**post)
        if stop_after_layers is not None and i + 1 - reused >= stop_after_layers:
            raise KeyboardInterrupt(f"stopped after {i + 1} layers (test hook)")
    return n_tok, reused, notes


def _on_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with every tensor on the CPU (methods may return them on the run's device)."""
    import dataclasses

    return dataclasses.replace(qw, **{f.name: getattr(qw, f.name).cpu() for f in dataclasses.fields(qw)
                                      if isinstance(getattr(qw, f.name), torch.Tensor)})


class _Shape:
    """Stands in for a tensor where only ``.shape`` is read."""

    def __init__(self, shape) -> None:
        self.shape = tuple(shape)


def _dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}.get(
        name, torch.float16)
