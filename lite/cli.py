"""``liteturbo lite ...``: the quantizer's commands (``rtn``, ``auto-awq``, ``gptq`` / ``auto-gptq``,
``calibrate-kv``) on :func:`lite.pipeline.quantize_model` and :func:`lite.kv_calibration.calibrate_kv`. Each returns
the checkpoint folder it wrote (``None`` with ``--no-serving-layout``), from which turbo's CLI then saves the serving
layout.

:mod:`turbo.cli` mounts the :func:`lite` group into ``liteturbo`` and adds ``lite eval-ppl``, which scores through
turbo's engine (``lite`` never imports ``turbo``). :func:`friendly_errors` and :data:`DEFAULT_MODEL` are shared with
it.
"""
from __future__ import annotations

import sys
from functools import wraps

import click

from calib_data import DEFAULT_MIXTURE as DEFAULT_CALIB_DATASET

from .formats import LiteturboError
from .formats.registry import WEIGHT_FORMATS

DEFAULT_MODEL = "smollm2-135m-instruct"


def friendly_errors(fn):
    """Print ``LiteturboError`` as one line on stderr and exit 2, without a traceback."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        """Run the command; a ``LiteturboError`` becomes ``error: ...`` on stderr and exit code 2."""
        try:
            return fn(*args, **kwargs)
        except LiteturboError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
    return wrapper


@click.group()
def lite() -> None:
    """Offline quantization."""


_serving_layout_option = click.option(
    "--serving-layout/--no-serving-layout", default=True, show_default=True,
    help="Then save the weights as this machine's engine holds them (CPU: repacked tiles, int8 head) in "
         "<work-dir>/serving/, which later loads map instead of repacking (docs/engine.md, \"Loading\").")


def _written(work_dir: str, serving_layout: bool):
    """What a command that wrote a checkpoint returns to the group (turbo's CLI packs its serving layout from it):
    the folder, or ``None`` with ``--no-serving-layout``."""
    from pathlib import Path

    return Path(work_dir).expanduser().absolute() if serving_layout else None


def _weight_options(fn):
    """Options every weight-quantization command takes (names as LMDeploy's ``lite`` uses them)."""
    opts = [
        click.option("--w-bits", default=4, show_default=True, help="Bits per weight."),
        click.option("--w-group-size", default=128, show_default=True,
                     help="Input channels per group (-1: per channel). SmolLM2-135M needs 64."),
        click.option("--w-sym/--w-asym", default=None,
                     help="Symmetric (no zero point) or asymmetric. Default: what the --format's readers load "
                          "(--format gptq: symmetric; awq, compressed-tensors: zero point)."),
        click.option("--format", "out_format", default=None, type=click.Choice(list(WEIGHT_FORMATS)),
                     help="Output format (default: awq, or compressed-tensors with zero points for the gptq "
                          "command). docs/formats.md says who reads each."),
        click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto."),
        click.option("--compute-dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "bfloat16", "float32"]),
                     help="dtype of the calibration forwards (auto: bfloat16 where native; solvers stay float32)."),
        click.option("--work-dir", default="./work_dir", show_default=True, help="Output checkpoint folder."),
        click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint at --work-dir."),
        click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer."),
        click.option("--mse-scales/--no-mse-scales", default=False, show_default=True,
                     help="Group scales/zero points by the smallest rounding error over ranges shrunk up to 20 %."),
        click.option("--rotate", is_flag=True,
                     help="Fold a random rotation of the residual stream into the weights first (QuaRot R1; a "
                          "standard checkpoint, with the output head untied)."),
        _serving_layout_option,
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _calib_options(fn):
    """Options of the calibrated methods: the weight options plus the calibration data."""
    opts = [
        click.option("--calib-dataset", default=DEFAULT_CALIB_DATASET, show_default=True,
                     help="Bundled name (c4, wikitext2, zh), a .txt/.jsonl/.parquet file or datasets folder, or a "
                          "mixture NAME:WEIGHT,NAME:WEIGHT (windows shared by weight)."),
        click.option("--calib-samples", default=128, show_default=True, help="Calibration windows."),
        click.option("--calib-seqlen", default=512, show_default=True, help="Tokens per calibration window."),
        click.option("--seed", default=42, show_default=True, help="Seed of the calibration sample."),
        click.option("--tune-steps", default=0, show_default=True,
                     help="Block-wise tuning of rounding and group scales after the method (AutoRound-style; 0: "
                          "off; slower, better)."),
        click.option("--e2e-steps", default=0, show_default=True,
                     help="End-to-end tuning of group scales and norm weights against the float model's logits, "
                          "one calibration window per step, after every layer is quantized (0: off; ~2 s a step "
                          "on SmolLM2-135M; 40 is the best 5-minute recipe with gptq)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return _weight_options(fn)


def _order_options(fn):
    """GPTQ rounding options (``gptq`` and ``auto-awq --rounding gptq``): column order and dampening."""
    opts = [
        click.option("--act-order/--no-act-order", default=None,
                     help="Quantize columns by descending Hessian diagonal (desc_act). Default: on."),
        click.option("--static-groups/--no-static-groups", default=None,
                     help="With --act-order: groups fixed before reordering (no g_idx: any --format, and vLLM 0.32 "
                          "loads it). Default: on with --act-order; --no-static-groups writes a g_idx."),
        click.option("--damp-percent", default=0.01, show_default=True,
                     help="GPTQ dampening added to diag(H), fraction of its mean."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@lite.command("rtn")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@_weight_options
@friendly_errors
def rtn(model, w_bits, w_group_size, w_sym, out_format, device, compute_dtype, work_dir, overwrite, resume,
        mse_scales, rotate, serving_layout):
    """Round-to-nearest W4A16 quantization of MODEL (name or checkpoint folder); no calibration data."""
    from .pipeline import PipelineConfig, quantize_model

    cfg = PipelineConfig(method="rtn", w_bits=w_bits, w_group_size=w_group_size, w_sym=w_sym, out_format=out_format,
                         device=device, compute_dtype=compute_dtype, mse_scales=mse_scales, rotate=rotate)
    quantize_model(model, cfg, work_dir, overwrite=overwrite, resume=resume)
    return _written(work_dir, serving_layout)


@lite.command("auto-awq")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@_calib_options
@click.option("--n-grid", default=20, show_default=True, help="Scale-search grid size.")
@click.option("--no-clip", is_flag=True, help="Skip the weight-clipping search.")
@click.option("--rounding", type=click.Choice(["rtn", "gptq"]), default="rtn", show_default=True,
              help="Rounding after AWQ scaling/clipping: rtn (the paper) or gptq (error-compensating).")
@_order_options
@friendly_errors
def auto_awq(model, w_bits, w_group_size, w_sym, out_format, device, compute_dtype, work_dir, overwrite, resume,
             mse_scales, rotate, serving_layout, calib_dataset, calib_samples, calib_seqlen, seed, tune_steps, e2e_steps,
             n_grid, no_clip, rounding, act_order,
             static_groups, damp_percent):
    """AWQ W4A16 (Lin et al. 2024): activation-aware scales and clipping, layer by layer."""
    from .pipeline import PipelineConfig, quantize_model

    cfg = PipelineConfig(method="awq", w_bits=w_bits, w_group_size=w_group_size, w_sym=w_sym, out_format=out_format,
                         calib_dataset=calib_dataset, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                         seed=seed, device=device, compute_dtype=compute_dtype, n_grid=n_grid, clip=not no_clip,
                         awq_rounding=rounding, act_order=act_order, static_groups=static_groups,
                         damp_percent=damp_percent, mse_scales=mse_scales, rotate=rotate, tune_steps=tune_steps,
                         e2e_steps=e2e_steps)
    quantize_model(model, cfg, work_dir, overwrite=overwrite, resume=resume)
    return _written(work_dir, serving_layout)


@lite.command("gptq")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@_calib_options
@_order_options
@click.option("--true-sequential/--no-true-sequential", default=True, show_default=True)
@friendly_errors
def gptq(model, w_bits, w_group_size, w_sym, out_format, device, compute_dtype, work_dir, overwrite, resume,
         mse_scales, rotate, serving_layout, calib_dataset, calib_samples, calib_seqlen, seed, tune_steps, e2e_steps,
         act_order, static_groups, damp_percent, true_sequential):
    """GPTQ W4A16 (Frantar et al. 2023): Hessian-aware rounding, layer by layer."""
    from .pipeline import PipelineConfig, quantize_model

    cfg = PipelineConfig(method="gptq", w_bits=w_bits, w_group_size=w_group_size, w_sym=w_sym, out_format=out_format,
                         calib_dataset=calib_dataset, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                         seed=seed, device=device, compute_dtype=compute_dtype, act_order=act_order,
                         static_groups=static_groups, damp_percent=damp_percent, true_sequential=true_sequential,
                         mse_scales=mse_scales, rotate=rotate, tune_steps=tune_steps,
                         e2e_steps=e2e_steps)
    quantize_model(model, cfg, work_dir, overwrite=overwrite, resume=resume)
    return _written(work_dir, serving_layout)


lite.add_command(gptq, "auto-gptq")


@lite.command("calibrate-kv")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--calib-dataset", default="c4", show_default=True,
              help="Bundled name (c4, wikitext2, zh), a .txt/.jsonl/.parquet file or datasets folder, or a mixture "
                   "NAME:WEIGHT,NAME:WEIGHT.")
@click.option("--calib-samples", default=128, show_default=True, help="Calibration windows.")
@click.option("--calib-seqlen", default=512, show_default=True, help="Tokens per calibration window.")
@click.option("--seed", default=42, show_default=True, help="Seed of the calibration sample.")
@click.option("--kv-bits", default=4, show_default=True, type=click.Choice(["4", "8"]),
              help="Cache bits the search targets (the parameters serve int8 and int4).")
@click.option("--search-windows", default=8, show_default=True, help="Windows the per-layer search scores.")
@click.option("--rotation/--no-rotation", default=True, show_default=True,
              help="Also try Hadamard rotations of keys and values (power-of-two head sizes).")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@click.option("--work-dir", default="./work_dir", show_default=True, help="Output checkpoint folder.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint at --work-dir.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last finished layer.")
@_serving_layout_option
@friendly_errors
def calibrate_kv(model, calib_dataset, calib_samples, calib_seqlen, seed, kv_bits, search_windows, rotation, device,
                 work_dir, overwrite, resume, serving_layout):
    """Calibrated int8/int4 KV cache: per-layer key shift, per-channel key scales and Hadamard rotations of keys
    and values, searched on the attention error (docs/kv-cache.md).

    MODEL may be 16-bit or W4A16; the output is MODEL's files plus the KV parameters, usable as MODEL by every
    command (the engine applies them with --kv-cache-dtype int8/int4)."""
    from .kv_calibration import KVCalibConfig, calibrate_kv as run

    cfg = KVCalibConfig(calib_dataset=calib_dataset, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                        seed=seed, kv_bits=int(kv_bits), search_windows=search_windows, rotation=rotation,
                        device=device)
    run(model, cfg, work_dir, overwrite=overwrite, resume=resume)
    return _written(work_dir, serving_layout)
