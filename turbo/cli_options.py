"""Command-line options shared by ``liteturbo chat``, ``serve`` and ``lite eval-ppl``: the KV cache options
(:func:`kv_options`, which reach the command as one ``kv_opts`` dict) and the device options (:func:`device_options`: device, backend, CUDA graphs, CPU threads,
tensor parallelism), which reach the command as one ``device_opts`` dict of :class:`~turbo.config.EngineConfig`
fields.
"""
from __future__ import annotations

import functools

import click


def kv_options(fn):
    """KV cache options shared by chat, eval-ppl and serve; the command receives them as one keyword, ``kv_opts``
    (EngineConfig fields: kv_cache_dtype, quant_policy, kv_calibration, kv_rotation)."""
    opts = [
        click.option("--kv-cache-dtype", default="auto", show_default=True,
                     help="KV cache storage: auto (the compute dtype), bfloat16, float16, float32, int8, int4."),
        click.option("--quant-policy", default=None, type=int,
                     help="LMDeploy's spelling of the KV dtype: 0 = 16-bit, 8 = int8, 4 = int4."),
        click.option("--no-kv-calibration", is_flag=True,
                     help="Ignore calibrated KV parameters in MODEL (online int8/int4)."),
        click.option("--kv-rotation/--no-kv-rotation", default=None,
                     help="Without calibrated parameters, store keys and values Hadamard-rotated per head in an "
                          "int8/int4 cache. Default: on for int4 (power-of-two head sizes), off for int8."),
    ]

    @functools.wraps(fn)
    def command(**kw):
        """The command with its KV options gathered into ``kv_opts``."""
        kv_opts = {k: kw.pop(k) for k in ("kv_cache_dtype", "quant_policy", "kv_rotation")}
        kv_opts["kv_calibration"] = not kw.pop("no_kv_calibration")
        return fn(kv_opts=kv_opts, **kw)

    for o in reversed(opts):
        command = o(command)
    return command


def check_threads(ctx, param, value):
    """--threads checked now (auto, N or -K); None when not given."""
    from backends.cpu_threads import parse_threads

    try:
        return None if value is None else (parse_threads(value) or "auto")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def device_options(fn):
    """--device, --backend, --enforce-eager, --threads and --tp, shared by chat, eval-ppl and serve; the command
    receives them as one keyword, ``device_opts`` (EngineConfig fields)."""
    opts = [
        click.option("--device", default="auto", show_default=True,
                     help="auto (a GPU, then an NPU, then the CPU), cpu, cuda[:N] or npu[:N]."),
        click.option("--backend", default="auto", show_default=True,
                     help="auto (triton on CUDA/ROCm, ascend on NPUs, torch on CPUs), torch, triton or ascend; "
                          "`liteturbo env` lists what runs here."),
        click.option("--enforce-eager", is_flag=True,
                     help="Never replay decode steps as CUDA graphs (they are by default on CUDA)."),
        click.option("--threads", metavar="auto|N|-K", callback=check_threads,
                     help="CPU threads: auto (the usable cores, fewer while other processes take some; default, "
                          "or $LITETURBO_THREADS), N (fixed) or -K (the usable cores but K)."),
        click.option("--tp", "--tensor-parallel-size", "tensor_parallel_size", default=1, show_default=True,
                     type=click.IntRange(min=1), help="Split the model over N devices (tensor parallelism)."),
    ]

    @functools.wraps(fn)
    def command(**kw):
        """The command with its device options gathered into ``device_opts``."""
        names = ("device", "backend", "enforce_eager", "threads", "tensor_parallel_size")
        return fn(device_opts={k: kw.pop(k) for k in names}, **kw)

    for o in reversed(opts):
        command = o(command)
    return command
