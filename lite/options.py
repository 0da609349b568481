"""The options of a ``lite`` quantization run: :class:`PipelineConfig`, validated on construction.

:mod:`lite.pipeline` runs it; the CLI (:mod:`lite.cli`) builds it from the command line. Every option that changes
the output is a field, so the field values' hash is what ``--resume`` must match (:meth:`PipelineConfig.fingerprint`).
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .calibration import DEFAULT_CALIB_DATASET, check_calib_dataset, parse_mixture
from .formats import LiteturboError
from .formats.registry import FormatOptions, weight_format
from .layerwise import resolve_device, run_fingerprint
from .methods import METHODS


@dataclass
class PipelineConfig:
    """Everything a quantization run depends on (validated on construction; hashed for ``--resume``).

    method: rtn | awq | gptq (:data:`lite.methods.METHODS`). w_bits/w_group_size/w_sym: the weight format;
    ``w_sym=None`` takes the output format's default (what its readers load: symmetric for GPTQ, a zero point for
    AWQ and compressed-tensors). out_format: awq | gptq | compressed-tensors (``None`` = awq for rtn/awq,
    compressed-tensors with zero points for gptq). calib_*: calibration data (see :mod:`lite.calibration`; default:
    the English + Chinese mixture). act_order/static_groups/damp_percent/block_size/true_sequential: GPTQ (also AWQ's
    ``gptq`` rounding; act_order and static_groups ``None`` = on wherever GPTQ rounds). ``choices`` (set here) lists
    the defaults a run took and why. n_grid/duo_scaling/clip/max_shrink/
    loss_tokens: AWQ; awq_rounding: ``rtn`` (the paper) or ``gptq`` (AWQ's scales and clipping, then GPTQ's
    error-compensating rounding on the scaled inputs). mse_scales: group scales/zero points by the smallest
    rounding error over shrunk ranges (RTN and GPTQ rounding). rotate: fold a random rotation of the residual stream
    into the weights first (:mod:`lite.rotation`; seeded by ``seed``; unties a tied head). tune_steps: steps of
    block-wise tuning of rounding and scales after the method (:mod:`lite.tune`; 0 = off; each layer is fitted to
    the float model's outputs on the first ``loss_tokens`` calibration tokens). e2e_steps: steps of end-to-end
    tuning of the group scales and norm weights against the float model's logits, once every layer is done
    (:mod:`lite.e2e`; 0 = off). device: cpu | cuda | auto.
    compute_dtype: auto | bfloat16 | float32 (the calibration forwards; solvers always run in float32).
    """

    method: str = "awq"
    w_bits: int = 4
    w_group_size: int = 128
    w_sym: bool | None = None
    out_format: str | None = None
    calib_dataset: str = DEFAULT_CALIB_DATASET
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 42
    act_order: bool | None = None
    static_groups: bool | None = None
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
    e2e_steps: int = 0
    device: str = "auto"
    compute_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LiteturboError(f"unknown method {self.method!r} ({', '.join(METHODS)})")
        if self.w_bits != 4:
            raise LiteturboError(f"--w-bits {self.w_bits} is not supported: the W4A16 formats store 4-bit weights")
        if self.w_group_size != -1 and (self.w_group_size < 8 or self.w_group_size % 8):
            raise LiteturboError(f"--w-group-size must be -1 or a positive multiple of 8, got {self.w_group_size}")
        self.choices: list[str] = []  # the defaults this run took, and why (printed before the run)
        if self.out_format is None:
            self.out_format = "compressed-tensors" if self.method == "gptq" else "awq"
            if self.method == "gptq":
                self.choices.append("compressed-tensors with zero points (vLLM and transformers read it; GPTQ v1 "
                                    "is symmetric for vLLM, worse on small models: --format gptq --w-sym)")
        fmt = weight_format(self.out_format)
        if self.w_sym is None:
            self.w_sym = fmt.default_sym
        uses_gptq = self.method == "gptq" or (self.method == "awq" and self.awq_rounding == "gptq")
        if (self.act_order is not None or self.static_groups is not None
                or self.damp_percent != type(self).damp_percent) and not uses_gptq:
            raise LiteturboError("--act-order, --static-groups and --damp-percent set GPTQ's rounding; use them with "
                                 "`lite gptq` or `lite auto-awq --rounding gptq`")
        if self.static_groups and self.act_order is False:
            raise LiteturboError("--static-groups only matters with --act-order: drop --static-groups, or drop "
                                 "--no-act-order")
        if self.act_order is None:
            self.act_order = uses_gptq
            if uses_gptq:
                self.choices.append("act-order (columns by Hessian importance)")
        if self.static_groups is None:
            self.static_groups = bool(self.act_order)
            if self.act_order:
                self.choices.append("static groups (no g_idx: vLLM 0.32 loads it; --no-static-groups writes one)")
        default_parts = parse_mixture(DEFAULT_CALIB_DATASET)
        if (self.method != "rtn" and self.calib_dataset == DEFAULT_CALIB_DATASET
                and 0 < self.calib_samples < len(default_parts)):
            self.calib_dataset = max(default_parts, key=lambda p: p[1])[0]
            self.choices.append(f"calibration on {self.calib_dataset} alone (--calib-samples {self.calib_samples} "
                                f"cannot hold the {len(default_parts)} datasets of the default mixture)")
        if self.method != "rtn" and self.calib_dataset == DEFAULT_CALIB_DATASET:
            why = ("English alone made GPTQ's rounding worse than RTN on Chinese" if uses_gptq else
                   "AWQ calibrated on English alone was further from 16-bit on Chinese")
            self.choices.append(f"calibration mixture {DEFAULT_CALIB_DATASET} (English and Chinese: {why})")
        fmt.check(self.format_options())
        if self.act_order and not self.static_groups:
            warnings.warn("act-order (on by default) with --no-static-groups writes a g_idx (desc_act / "
                          "actorder=group): turbo, transformers and GPTQModel read it, vLLM 0.32 refuses it; drop "
                          "--no-static-groups for vLLM")
        if not 0 < self.damp_percent < 1:
            raise LiteturboError(f"--damp-percent must be in (0, 1), got {self.damp_percent}")
        if self.awq_rounding not in ("rtn", "gptq"):
            raise LiteturboError(f"awq rounding must be rtn or gptq, got {self.awq_rounding!r}")
        if self.tune_steps < 0:
            raise LiteturboError(f"--tune-steps must be >= 0, got {self.tune_steps}")
        if self.e2e_steps < 0:
            raise LiteturboError(f"--e2e-steps must be >= 0, got {self.e2e_steps}")
        if self.e2e_steps and self.rotate:
            raise LiteturboError("--e2e-steps and --rotate cannot be combined (the rotation unties the output head "
                                 "the float model shares); drop one of them")
        if self.e2e_steps and self.method == "rtn":
            raise LiteturboError("--e2e-steps needs calibration data: use `lite auto-awq` or `lite gptq`")
        if self.block_size < 1 or self.n_grid < 1 or self.loss_tokens < 1:
            raise LiteturboError("block_size, n_grid and loss_tokens must be >= 1")
        if not 0 < self.max_shrink < 1:
            raise LiteturboError(f"max_shrink must be in (0, 1), got {self.max_shrink}")
        if self.calib_samples <= 0 or self.calib_seqlen <= 0:
            raise LiteturboError("--calib-samples and --calib-seqlen must be positive")
        if self.method != "rtn":
            check_calib_dataset(self.calib_dataset, self.calib_samples)
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
