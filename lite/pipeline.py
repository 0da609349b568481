"""Layer-by-layer, memory-bounded, resumable weight quantization (RTN, GPTQ, AWQ) of a Hugging Face model.

1. The model skeleton is built on the meta device (accelerate ``init_empty_weights``); tensors are read
   from the safetensors files only when their layer is processed, so peak memory is about one decoder layer
   plus the calibration activations, whatever the model size.
2. The inputs of decoder layer 0 are captured for every calibration sample.
3. For each decoder layer: load it onto ``device`` in float32, gather statistics, quantize it, write its
   tensors to ``<work_dir>.partial/layer_NNNN.safetensors`` (atomic), put the *dequantized* weights back and
   run it to produce the next layer's inputs (so later layers see the quantization error), free it.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from backends.types import QuantizedWeight

from .formats import (DECODER_LINEARS, LiteturboError, arch_spec, atomic_output_dir, check_output_dir,
                      copy_tokenizer_files,
                      load_config, resolve_model, write_json)
from .formats.arch import NO_CLIP, SCALING_GROUPS, SEQUENTIAL_ORDER
from .formats.awq import awq_quantization_config, pack_awq, unpack_awq
from .formats.checkpoint import weight_files
from .formats.compressed_tensors import compressed_quantization_config, pack_compressed, unpack_compressed
from .formats.gptq import gptq_quantization_config, pack_gptq, unpack_gptq

FORMATS = ("awq", "gptq", "compressed-tensors")


@dataclass
class PipelineConfig:
    """Everything a quantization run depends on (validated on construction; hashed for ``--resume``).

    method: rtn | awq | gptq. w_bits/w_group_size/w_sym: the weight format. out_format: awq | gptq |
    compressed-tensors (``None`` = awq for rtn/awq, gptq for gptq). calib_*: calibration data (see
    :mod:`lite.calibration`). act_order/static_groups/damp_percent/block_size/true_sequential: GPTQ.
    n_grid/duo_scaling/clip/max_shrink/loss_tokens: AWQ; awq_rounding: ``rtn`` (the paper) or ``gptq``
    (AWQ's scales and clipping, then GPTQ's error-compensating rounding on the scaled inputs).
    device: cpu | cuda | auto.
    """

    method: str = "awq"
    w_bits: int = 4
    w_group_size: int = 128
    w_sym: bool = False
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
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in ("rtn", "awq", "gptq"):
            raise LiteturboError(f"unknown method {self.method!r} (rtn, awq, gptq)")
        if self.w_bits != 4:
            raise LiteturboError(f"--w-bits {self.w_bits} is not supported: the W4A16 formats store 4-bit weights")
        if self.w_group_size != -1 and (self.w_group_size < 8 or self.w_group_size % 8):
            raise LiteturboError(f"--w-group-size must be -1 or a positive multiple of 8, got {self.w_group_size}")
        if self.out_format is None:
            self.out_format = "gptq" if self.method == "gptq" else "awq"
        if self.out_format not in FORMATS:
            raise LiteturboError(f"--format must be one of {', '.join(FORMATS)}, got {self.out_format!r}")
        if self.act_order and self.out_format == "awq":
            raise LiteturboError("--act-order needs a g_idx, which the AWQ format cannot store; use --format gptq "
                                 "or compressed-tensors")
        if not 0 < self.damp_percent < 1:
            raise LiteturboError(f"--damp-percent must be in (0, 1), got {self.damp_percent}")
        if self.awq_rounding not in ("rtn", "gptq"):
            raise LiteturboError(f"awq rounding must be rtn or gptq, got {self.awq_rounding!r}")
        if self.block_size < 1 or self.n_grid < 1 or self.loss_tokens < 1:
            raise LiteturboError("block_size, n_grid and loss_tokens must be >= 1")
        if not 0 < self.max_shrink < 1:
            raise LiteturboError(f"max_shrink must be in (0, 1), got {self.max_shrink}")
        if self.calib_samples <= 0 or self.calib_seqlen <= 0:
            raise LiteturboError("--calib-samples and --calib-seqlen must be positive")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise LiteturboError(f"--device must be cpu, cuda or auto, got {self.device!r}")

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
class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


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
    outs = []
    with torch.no_grad():
        for h, kw in zip(inps, kws):
            o = layer(h, **kw)
            outs.append(o[0] if isinstance(o, tuple) else o)
    return outs


def _capture(layer, names: list[str], inps, kws, stop_after: str | None = None) -> dict[str, list[torch.Tensor]]:
    """Inputs of the named submodules for every sample (stops the forward after ``stop_after``)."""
    got = {n: [] for n in names}
    handles = []
    for n in names:
        mod = layer.get_submodule(n)

        def hook(_m, args, _out, n=n):
            got[n].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            if n == stop_after:
                raise _Stop
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for h, kw in zip(inps, kws):
                try:
                    layer(h, **kw)
                except _Stop:
                    pass
    finally:
        for hd in handles:
            hd.remove()
    return got


# ----------------------------------------------------------------------------------------------------
def _quantize_layer_gptq(layer, inps, kws, cfg: PipelineConfig, order) -> dict[str, QuantizedWeight]:
    from .gptq import HessianAccumulator, gptq_quantize

    result = {}
    groups = order if cfg.true_sequential else (tuple(n for g in order for n in g),)
    for group in groups:
        firsts = list(dict.fromkeys(_shared_input_heads(group)))
        feats = _capture(layer, firsts, inps, kws, stop_after=firsts[-1] if cfg.true_sequential else None)
        hess = {}
        for n in firsts:
            acc = HessianAccumulator(layer.get_submodule(n).in_features, device=inps[0].device)
            for x in feats[n]:
                acc.add(x)
            hess[n] = acc.H
        del feats
        for n in group:
            lin = layer.get_submodule(n)
            qw = gptq_quantize(lin.weight.data, hess[_SHARED_INPUT.get(n, n)],
                               cfg.w_bits, cfg.w_group_size, cfg.w_sym, cfg.act_order, cfg.static_groups,
                               cfg.block_size, cfg.damp_percent,
                               min_zero=_min_zero(cfg))
            lin.weight.data = qw.dequantize(torch.float32).to(lin.weight.device)
            result[n] = qw
    return result


_SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                 "mlp.up_proj": "mlp.gate_proj"}


def _shared_input_heads(group) -> list[str]:
    return [_SHARED_INPUT.get(n, n) for n in group]


def _quantize_layer_awq(layer, inps, kws, cfg: PipelineConfig, groups, no_clip) -> dict[str, QuantizedWeight]:
    from .awq import activation_scale, apply_clip, search_clip, search_scales, weight_scale
    from .rtn import quantize_rtn

    linears = [n for n in DECODER_LINEARS]
    feats = _capture(layer, linears, inps, kws)  # fp inputs of every linear, all samples
    # loss on the first samples up to loss_tokens tokens
    n_loss, tok = 0, 0
    while n_loss < len(inps) and (tok < cfg.loss_tokens or n_loss == 0):
        tok += inps[n_loss].shape[1]
        n_loss += 1
    attn_kw = [{k: kw[k] for k in ("position_embeddings", "attention_mask") if k in kw} for kw in kws[:n_loss]]
    for g in groups:
        prev = layer.get_submodule(g.prev)
        lins = [layer.get_submodule(n) for n in g.linears]
        if g.needs_same_width and prev.weight.shape[0] != lins[0].weight.shape[1]:
            continue
        xs = feats[g.linears[0]]
        x_mean = activation_scale(xs)
        w_mean = weight_scale([m.weight.data for m in lins], cfg.w_group_size)
        originals = [m.weight.data.clone() for m in lins]
        inspect = layer.get_submodule(g.inspect)
        if g.inspect in g.linears:
            loss_in = torch.cat(xs[:n_loss], 0)

            def forward(ws, loss_in=loss_in):
                return torch.nn.functional.linear(loss_in, ws[0])
            reference = torch.nn.functional.linear(loss_in, originals[0])
        else:
            # module inputs = prev's output = the first linear's input, per sample
            per_sample = [x.view(1, -1, x.shape[-1]) for x in xs[:n_loss]]
            is_attn = g.inspect.endswith("attn")

            def run_module(per_sample=per_sample, inspect=inspect, is_attn=is_attn):
                outs = []
                with torch.no_grad():
                    for i, x in enumerate(per_sample):
                        o = inspect(x, **attn_kw[i]) if is_attn else inspect(x)
                        o = o[0] if isinstance(o, tuple) else o
                        outs.append(o.reshape(-1, o.shape[-1]))
                return torch.cat(outs, 0)

            reference = run_module()

            def forward(ws, lins=lins, run_module=run_module):
                for m, w in zip(lins, ws):
                    m.weight.data = w
                return run_module()
        scales, alpha, loss = search_scales(originals, x_mean, w_mean, forward, reference, cfg.w_bits,
                                            cfg.w_group_size, cfg.w_sym, cfg.n_grid, cfg.duo_scaling)
        for m, w in zip(lins, originals):
            m.weight.data = w * scales.to(w.device)
        # fold 1/s into the previous op: a norm's weight or a linear's output rows (and bias)
        prev.weight.data = prev.weight.data / scales.view(-1, *([1] * (prev.weight.dim() - 1))).to(prev.weight.device)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data = prev.bias.data / scales.to(prev.bias.device)
        for n in g.linears:
            feats[n] = [x / scales.to(x.device) for x in feats[n]]
    result = {}
    hessians: dict[str, torch.Tensor] = {}
    for n in linears:
        lin = layer.get_submodule(n)
        w = lin.weight.data
        if cfg.clip and n not in no_clip:
            x = torch.cat(feats[n], 0)
            max_val = search_clip(w, x, cfg.w_bits, cfg.w_group_size, cfg.w_sym, cfg.n_grid, cfg.max_shrink)
            w = apply_clip(w, max_val, cfg.w_group_size)
        if cfg.awq_rounding == "gptq":
            from .gptq import HessianAccumulator, gptq_quantize

            head = _SHARED_INPUT.get(n, n)
            if head not in hessians:
                acc = HessianAccumulator(w.shape[1], device=w.device)
                for x in feats[head]:
                    acc.add(x)
                hessians[head] = acc.H
            qw = gptq_quantize(w, hessians[head], cfg.w_bits, cfg.w_group_size, cfg.w_sym, block_size=cfg.block_size,
                               damp_percent=cfg.damp_percent, min_zero=_min_zero(cfg))
        else:
            qw = quantize_rtn(w, cfg.w_bits, cfg.w_group_size, cfg.w_sym, min_zero=_min_zero(cfg))
        result[n] = qw
    return result


def _min_zero(cfg: PipelineConfig) -> int:
    """GPTQ v1 stores ``zero - 1``: asymmetric zero points must then be >= 1."""
    return 1 if (cfg.out_format == "gptq" and not cfg.w_sym) else 0


def _quantize_layer_rtn(layer, cfg: PipelineConfig) -> dict[str, QuantizedWeight]:
    from .rtn import quantize_rtn

    return {n: quantize_rtn(layer.get_submodule(n).weight.data, cfg.w_bits, cfg.w_group_size, cfg.w_sym,
                            min_zero=_min_zero(cfg)) for n in DECODER_LINEARS}


def _sanitize(layer, idx: int, qws: dict[str, QuantizedWeight], cfg: PipelineConfig) -> dict[str, QuantizedWeight]:
    """Never write NaN/inf: a weight whose scales came out non-finite is re-quantized with RTN (warned)."""
    import warnings

    from .rtn import quantize_rtn

    for n, qw in qws.items():
        if not torch.isfinite(qw.scales.float()).all():
            warnings.warn(f"layer {idx} {n}: non-finite scales from {cfg.method}; falling back to RTN for this linear")
            w = torch.nan_to_num(layer.get_submodule(n).weight.data.float(), nan=0.0, posinf=0.0, neginf=0.0)
            qws[n] = quantize_rtn(w, cfg.w_bits, cfg.w_group_size, cfg.w_sym)
    for n, p in layer.named_parameters():
        if not torch.isfinite(p.data).all():
            warnings.warn(f"layer {idx} {n}: non-finite values replaced by 0")
            p.data = torch.nan_to_num(p.data, nan=0.0, posinf=0.0, neginf=0.0)
    return qws


# ----------------------------------------------------------------------------------------------------
def _pack(qw: QuantizedWeight, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "awq":
        return pack_awq(qw)
    if fmt == "gptq":
        return pack_gptq(qw, "gptq")
    return pack_compressed(qw)


def _unpack(t: dict[str, torch.Tensor], prefix: str, cfg: PipelineConfig) -> QuantizedWeight:
    bits, gs, sym = cfg.w_bits, cfg.w_group_size, cfg.w_sym
    if cfg.out_format == "awq":
        return unpack_awq(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"], bits, gs, not sym)
    if cfg.out_format == "gptq":
        return unpack_gptq(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"],
                           t[f"{prefix}.g_idx"], bits, gs, sym, "gptq")
    names = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
    return unpack_compressed({n: t[f"{prefix}.{n}"] for n in names if f"{prefix}.{n}" in t}, bits, gs, sym)


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
    for n, qw in qws.items():
        for k, v in _pack(qw, cfg.out_format).items():
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
            param.data = _unpack(tensors, f"{p}.{mod}", cfg).dequantize(torch.float32).to(dev)
        else:
            raise LiteturboError(f"saved layer {idx} lacks {key}; delete the .partial folder and start again")


def _quant_config_block(cfg: PipelineConfig) -> dict:
    if cfg.out_format == "awq":
        return awq_quantization_config(cfg.w_bits, cfg.w_group_size, not cfg.w_sym)
    if cfg.out_format == "gptq":
        return gptq_quantization_config(cfg.w_bits, cfg.w_group_size, cfg.w_sym, cfg.act_order, cfg.static_groups,
                                        cfg.damp_percent, cfg.true_sequential, "gptq")
    actorder = ("static" if cfg.static_groups else "group") if cfg.act_order else None
    return compressed_quantization_config(cfg.w_bits, cfg.w_group_size, cfg.w_sym, actorder)


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

    samples = []
    if cfg.method != "rtn":  # RTN needs no calibration data; bad data fails here, before .partial exists
        check_calib_seqlen(config, cfg.calib_seqlen)
        tok = AutoTokenizer.from_pretrained(str(src))
        samples = calibration_samples(tok, cfg.calib_dataset, cfg.calib_samples, cfg.calib_seqlen, cfg.seed)

    partial = open_partial(out, cfg.fingerprint(src), {"config": asdict(cfg), "source": str(src)}, resume)

    inps, kws = [], []
    if samples:
        inps, kws = lazy.capture_inputs(samples)
    n_tok = sum(x.shape[1] for x in inps)
    mt = config["model_type"]
    bar = tqdm(range(n_layers), desc=f"{cfg.method} W{cfg.w_bits}A16 g{cfg.w_group_size} ({n_tok} calib tokens)",
               unit="layer")
    reused = 0
    for i in bar:
        layer = lazy.layers[i]
        lazy.materialize(layer, f"model.layers.{i}")
        f = partial / f"layer_{i:04d}.safetensors"
        if f.is_file():
            tensors = load_file(str(f))
            reused += 1
        else:
            if cfg.method == "gptq":
                qws = _quantize_layer_gptq(layer, inps, kws, cfg, SEQUENTIAL_ORDER[mt])
            elif cfg.method == "awq":
                qws = _quantize_layer_awq(layer, inps, kws, cfg, SCALING_GROUPS[mt], NO_CLIP[mt])
            else:
                qws = _quantize_layer_rtn(layer, cfg)
            tensors = _layer_tensors(layer, i, _sanitize(layer, i, qws, cfg), cfg, dtypes)
            tmp = f.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, f)
        _load_layer_tensors(layer, i, tensors, cfg)
        if i + 1 < n_layers and cfg.method != "rtn":
            inps = _run_layer(layer, inps, kws)
        lazy.release(layer)
        bar.set_postfix(peak_gib=f"{peak_memory_gib(device):.2f}")
        if stop_after_layers is not None and i + 1 - reused >= stop_after_layers:
            raise KeyboardInterrupt(f"stopped after {i + 1} layers (test hook)")

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        tensors = {}
        for k in lazy.where:
            if not k.startswith("model.layers."):
                tensors[k] = lazy.tensor(k)
        for i in range(n_layers):
            tensors.update(load_file(str(partial / f"layer_{i:04d}.safetensors")))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        qc = _quant_config_block(cfg)
        write_json(tmp / "config.json", dict(config, quantization_config=qc))
        if cfg.out_format == "gptq":
            write_json(tmp / "quantize_config.json", {k: v for k, v in qc.items() if k != "quant_method"})
        copy_tokenizer_files(src, tmp)
        wall = time.perf_counter() - t0
        # provenance: how this checkpoint was made, and what it cost
        write_json(tmp / "liteturbo_quantize.json", {
            "source": str(src), "options": asdict(cfg), "calibration_tokens": n_tok, "device": device.type,
            "wall_seconds": round(wall, 1), "peak_memory_gib": round(peak_memory_gib(device), 2),
            "reused_layers": reused, "torch_threads": torch.get_num_threads()})
    shutil.rmtree(partial, ignore_errors=True)
    print(f"[liteturbo] {cfg.method}: wrote {out} ({cfg.out_format} format) in {wall:.1f} s, peak memory "
          f"{peak_memory_gib(device):.2f} GiB ({device.type})", file=sys.stderr)
    return out


class _Shape:
    """Stands in for a tensor where only ``.shape`` is read."""

    def __init__(self, shape) -> None:
        self.shape = tuple(shape)


def _dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}.get(
        name, torch.float16)
