"""``liteturbo plan``: will a model fit on a device, with how much context and how many sessions, answered from
``config.json`` before anything is loaded.

:func:`plan` builds the :class:`Plan` report (weights, workspace, reserve, KV pool, context and sessions, what to
change when it does not fit) from the accounting of :mod:`turbo.core.planner`, the same the engine applies at
start-up; :func:`plan_checkpoint` is the CLI's front (reads a folder, a config.json or a model name, resolves the
device, budget and options as the engine would). With tensor parallelism (``tp`` devices) every figure is one
device's (rank 0's, the largest), as the engine checks each rank.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from backends import backend_classes
from backends.platform import current_platform
from lite.formats import LiteturboError, load_config, resolve_model

from .config import DTYPES, KV_ALIASES, KV_CACHE_DTYPE_CHOICES
from .core.model import ModelConfig

from .core.planner import (ACCELERATOR_RESERVE, GiB, POOL_FRACTION, WeightChoice, gib, kv_spec, parse_memory,
                           size_pool, weight_breakdown, decode_weight_bytes, parameter_counts, weight_choice, workspace_breakdown)
from .core.tp.shard import check_split, working_sizes

@dataclass
class Plan:
    """What :func:`plan` found; ``to_dict()`` is the ``--json`` output. Sizes in bytes, token counts in tokens."""

    model: str
    device: str
    backend: str
    dtype: str
    budget: int
    budget_source: str
    reserve: int
    weights: dict[str, int]
    workspace: dict[str, int]
    weight_bits: int
    group_size: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    pool_blocks: int
    pool_tokens: int
    pool_bytes: int
    session_len: int
    sessions_at_once: int
    max_batch_size: int
    max_num_batched_tokens: int
    fits: bool
    reason: str
    engine_options: dict = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)
    quantization: dict | None = None
    notes: list[str] = field(default_factory=list)
    raw_config: dict = field(default_factory=dict, repr=False)
    tensor_parallel_size: int = 1
    host_tier_bytes: int = 0  # --session-host-gib: idle sessions' KV in host memory (turbo/core/kv_tier.py)
    # weight bytes one batch-1 decode step reads, by part (planner.decode_weight_bytes): a Mixture-of-Experts model
    # holds every expert (weights) but reads only the selected ones per token (speed)
    decode_weights: dict[str, int] = field(default_factory=dict)
    moe: dict | None = None  # experts, top_k, total_parameters, active_parameters of a Mixture-of-Experts model

    @property
    def host_tier_sessions(self) -> int:
        """Idle sessions of ``session_len`` tokens the host tier holds (their KV in its stored form)."""
        return self.host_tier_bytes // max(self.kv_bytes_per_token * self.session_len, 1)

    def with_host_tier(self, gib_: float) -> "Plan":
        """This plan with a host tier of ``gib_`` GiB for idle sessions' KV (``--session-host-gib``). Raises
        ``LiteturboError`` for a negative or non-finite size."""
        if not 0 <= gib_ < float("inf"):
            raise LiteturboError(f"--session-host-gib must be a finite number of GiB >= 0, got {gib_}")
        self.host_tier_bytes = int(gib_ * 2**30)
        if gib_ > 0:
            self.engine_options["session_host_gib"] = gib_
        return self

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def workspace_total(self) -> int:
        return sum(self.workspace.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw_config", None)
        d.update(weights_total=self.weights_total, workspace_total=self.workspace_total,
                 host_tier_sessions=self.host_tier_sessions)
        return d

    def serve_command(self, model_arg: str) -> str:
        """The ``liteturbo serve`` command line with :attr:`engine_options`."""
        opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.engine_options.items())
        return f"liteturbo serve {model_arg} {opts}".strip()

    def table(self) -> str:
        """The plan as a plain-text table (what ``liteturbo plan`` prints)."""
        rows = [("budget", gib(self.budget), self.budget_source)]
        if self.reserve:
            rows.append(("reserve", gib(self.reserve), "GPU/NPU context, library workspaces, allocator slack"))
        wdesc = (f"W{self.weight_bits}A16 g{self.group_size}" if self.weight_bits < 16 else f"{self.dtype} weights")
        for k, v in self.weights.items():
            note = {"decoder linears": f"{wdesc}: packed codes, scales, zero points ({self.backend} layout)"
                    if self.weight_bits < 16 else wdesc,
                    "embeddings": self.dtype, "lm_head": "tied to the embeddings" if v == 0 else "",
                    "rotary tables": "float32 cos/sin"}.get(k, "")
            rows.append((f"weights: {k}", gib(v), note))
        rows.append(("weights total", gib(self.weights_total), ""))
        if self.moe:
            m = self.moe
            rows.append(("decode reads per token", gib(sum(self.decode_weights.values())),
                         f"weights of one batch-1 step: top-{m['top_k']} of {m['experts']} experts per sparse layer"
                         + (" + the shared expert" if m.get("shared_expert") else "") + ", attention, routers, lm_head"))
            rows.append(("parameters", f"{m['total_parameters'] / 1e9:.2f} B",
                         f"{m['active_parameters'] / 1e9:.2f} B active per token (memory counts all, speed the "
                         f"active)"))
        for k, v in self.workspace.items():
            rows.append((f"workspace: {k}", gib(v), ""))
        rows.append(("workspace total", gib(self.workspace_total),
                     f"prefill chunk {_n(self.max_num_batched_tokens, 'token')}, {_n(self.max_batch_size, 'row')}"))
        rows.append(("KV cache per token", f"{self.kv_bytes_per_token / 1024:.1f} KiB",
                     f"{self.kv_cache_dtype}, all layers, K and V, scales included"))
        rows.append(("KV pool", gib(self.pool_bytes), f"{_n(self.pool_tokens, 'token')} in "
                                                      f"{_n(self.pool_blocks, 'block')} of {self.block_size}"))
        rows.append(("sessions at once", str(self.sessions_at_once), f"of session_len {self.session_len:,} tokens"))
        if self.host_tier_bytes:
            per = self.kv_bytes_per_token * self.session_len
            rows.append(("session host tier", gib(self.host_tier_bytes),
                         f"host memory: {_n(self.host_tier_sessions, 'idle session')} of {self.session_len:,} tokens "
                         f"({gib(per)} each), or {self.host_tier_bytes // max(self.kv_bytes_per_token, 1):,} tokens"))
        rows.append(("fits", "yes" if self.fits else "NO", self.reason))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        where = self.device if self.tensor_parallel_size == 1 else (
            f"{self.tensor_parallel_size} x {self.device} (tensor parallel; figures per device)")
        head = f"{self.model} on {where} ({self.backend} backend, {self.dtype} compute)"
        lines = [head, "-" * len(head)] + [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
        lines += [f"note: {n}" for n in self.notes]
        if self.suggestions:
            lines.append("to fit: " + "; ".join(self.suggestions))
        if self.quantization:
            q = self.quantization
            data = ("no calibration" if q["method"] == "rtn"
                    else f"{q['calib_samples']} x {q['calib_seqlen']} calibration tokens")
            lines.append(f"quantize with lite ({q['method']}, {data}, on {q['device']}): peak {gib(q['peak'])} "
                         f"({', '.join(f'{k} {gib(v)}' for k, v in q['parts'].items())}) -> "
                         f"{'fits' if q['fits'] else 'does NOT fit'} in {gib(q['room'])}"
                         + (" (the budget less the reserve)" if self.reserve else "")
                         + (f"; {q['advice']}" if q.get("advice") else ""))
        return "\n".join(lines)


def plan(cfg, raw_config: dict, *, model: str, device_kind: str, budget: int, budget_source: str,
         backend: str = "auto", dtype: torch.dtype = torch.bfloat16, weights: WeightChoice | None = None,
         kv_cache_dtype: str = "auto", session_len: int | None = None, max_batch_size: int = 64,
         max_num_batched_tokens: int = 1024, block_size: int = 64, in_use: int = 0,
         cache_max_entry_count: float | None = None, max_kv_tokens: int | None = None, suggest: bool = True,
         tp: int = 1) -> Plan:
    """Plan serving ``cfg`` (a :class:`turbo.core.model.ModelConfig`) on a ``device_kind`` (``cpu``, ``cuda``, ``rocm``,
    ``npu``) with ``budget`` bytes of memory, ``in_use`` of them already taken by others. Everything else as the
    engine's options (:class:`turbo.config.EngineConfig`); ``tp``: split over that many devices of ``budget`` each
    (on a CPU the ranks share ``budget``), every figure per device. When it does not fit, ``suggestions`` lists
    option changes that do, each checked by planning again. Raises ``LiteturboError`` for impossible options (a
    ``tp`` that breaks a head or a quantization group, naming the sizes that work)."""
    w = weights or WeightChoice()
    check_split(cfg, tp, w.bits, w.group_size)
    accel = device_kind != "cpu"
    name = backend
    if name == "auto":
        name = {"cuda": "triton", "rocm": "triton", "npu": "ascend"}.get(device_kind, "torch")
    classes = backend_classes()
    if name not in classes:
        raise LiteturboError(f"unknown backend {backend!r}; choose one of auto, {', '.join(sorted(classes))}")
    runs_on = {"triton": ("cuda", "rocm"), "ascend": ("npu",)}.get(name)
    if runs_on is not None and device_kind not in runs_on:
        raise LiteturboError(f"the {name} backend runs on {' or '.join(runs_on)}, not {device_kind}; use --backend "
                             f"auto or torch")
    cls = classes[name]
    dev_type = "cuda" if device_kind in ("cuda", "rocm") else device_kind
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    kv_dtype = dname if kv_cache_dtype == "auto" else kv_cache_dtype
    spec = kv_spec(cfg, kv_dtype, block_size, tp=tp)
    bpt, bpb = spec.bytes_per_token(), spec.bytes_per_block()
    max_pos = cfg.max_position_embeddings
    want_len = min(session_len or max_pos, max_pos)
    notes = []
    if session_len and session_len > max_pos:
        notes.append(f"--session-len {session_len} is capped to the model's max_position_embeddings ({max_pos})")
    wb = weight_breakdown(cfg, cls, dev_type, dtype, w, tp)
    reserve = ACCELERATOR_RESERVE if accel else 0
    share = budget if accel else budget // tp  # accelerator ranks have a device each, CPU ranks share the memory
    free = share - reserve - (in_use if accel else in_use // tp) - sum(wb.values())
    if tp > 1:
        ranks = "devices, each with the budget" if accel else "CPU processes sharing the budget"
        notes.append(f"tensor parallel over {tp} {ranks}: weights, workspace and KV are one rank's; each holds "
                     f"{max(cfg.num_kv_heads // tp, 1)} of the {cfg.num_kv_heads} KV heads")

    in_place = cls.reads_kv_in_place(kv_dtype, dtype, dev_type)

    def workspace(ctx):
        return workspace_breakdown(cfg, cls, dtype, kv_dtype, w.bits < 16, w.lm_head_int8, max_num_batched_tokens,
                                   max_batch_size, want_len, context_tokens=ctx, tp=tp, kv_in_place=in_place)

    pool, ws = size_pool(free, workspace, bpb, block_size, cache_max_entry_count=cache_max_entry_count,
                         max_kv_tokens=max_kv_tokens, accelerator=accel,
                         context_cap=None if in_place else max_batch_size * want_len)
    tokens = pool.blocks * block_size
    blocks_per_session = -(-want_len // block_size)
    sessions = pool.blocks // blocks_per_session
    ws_total = sum(ws.values())
    if free - ws_total <= 0:
        fits = False
        reason = (f"weights {gib(sum(wb.values()))} + workspace {gib(ws_total)}"
                  + (f" + reserve {gib(reserve)}" if reserve else "") + (f" + {gib(in_use)} in use" if in_use else "")
                  + f" exceed {gib(share)} by {gib(-(free - ws_total))}")
    elif pool.blocks == 0:
        fits = False
        reason = (f"{pool.what} asks for {gib(pool.asked)} of KV but {gib(pool.available)} is left: "
                  f"{gib(pool.asked - pool.available)} short")
    elif sessions < 1:
        fits = False
        reason = (f"the KV pool holds {tokens:,} tokens, less than one session of {want_len:,} "
                  f"({gib(blocks_per_session * bpb - pool.blocks * bpb)} short)")
    else:
        fits = True
        reason = f"{gib(free - ws_total - pool.blocks * bpb)} left over"
    opts = {"kv_cache_dtype": kv_dtype, "session_len": want_len, "max_batch_size": max_batch_size,
            "max_num_batched_tokens": max_num_batched_tokens}
    if accel:
        opts["cache_max_entry_count"] = cache_max_entry_count or POOL_FRACTION
    else:
        opts["max_kv_tokens"] = tokens
    if tp > 1:
        opts["tensor_parallel_size"] = tp
    p = Plan(model=model, device=device_kind, backend=name, dtype=dname, budget=budget, budget_source=budget_source,
             reserve=reserve, weights=wb, workspace=ws, weight_bits=w.bits, group_size=w.group_size,
             kv_cache_dtype=kv_dtype, kv_bytes_per_token=bpt, block_size=block_size, pool_blocks=pool.blocks,
             pool_tokens=tokens, pool_bytes=pool.blocks * bpb, session_len=want_len, sessions_at_once=sessions,
             max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens, fits=fits,
             reason=reason, engine_options=opts, notes=notes, tensor_parallel_size=tp,
             decode_weights=decode_weight_bytes(cfg, cls, dev_type, dtype, w, tp))
    if cfg.moe is not None:
        total, active = parameter_counts(cfg)
        p.moe = {"experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "sparse_layers": sum(cfg.moe.sparse),
                 "shared_expert": bool(cfg.moe.shared_intermediate_size), "total_parameters": total,
                 "active_parameters": active}
    if not fits and suggest:
        args = dict(model=model, device_kind=device_kind, budget=budget, budget_source=budget_source, backend=backend,
                    dtype=dtype, weights=w, kv_cache_dtype=kv_dtype, session_len=want_len,
                    max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens,
                    block_size=block_size, in_use=in_use, cache_max_entry_count=cache_max_entry_count,
                    max_kv_tokens=max_kv_tokens, suggest=False, tp=tp)
        p.suggestions = _suggest(cfg, raw_config, args, accel, block_size)
    return p


def _suggest(cfg, raw_config: dict, args: dict, accel: bool, block_size: int) -> list[str]:
    """Single option changes that make the plan fit, each verified by planning again with it."""
    def fits(**change) -> Plan | None:
        p = plan(cfg, raw_config, **dict(args, **change))
        return p if p.fits else None

    out = []
    kv, length, w = args["kv_cache_dtype"], args["session_len"], args["weights"]
    for cand in ("int8", "int4"):
        if _rank(cand) < _rank(kv) and (p := fits(kv_cache_dtype=cand)):
            out.append(f"--kv-cache-dtype {cand} ({p.pool_tokens:,} tokens)")
    if w.bits > 4 and fits(weights=WeightChoice(4, 128, False, w.scales_dtype, w.lm_head_int8)):
        out.append("4-bit weights (liteturbo lite auto-awq)")
    if args["dtype"] == torch.float32 and fits(dtype=torch.bfloat16):
        out.append("--dtype bfloat16")
    if accel:  # more devices of the same memory
        more = [n for n in working_sizes(cfg, w.bits, w.group_size) if n > args["tp"] and n <= 8]
        if (n := next((n for n in more if fits(tp=n)), None)) is not None:
            out.append(f"--tp {n} ({n} devices)")
    for t in (512, 256):
        if t < args["max_num_batched_tokens"] and fits(max_num_batched_tokens=t):
            out.append(f"--max-num-batched-tokens {t}")
            break
    for b in (16, 4, 1):
        if b < args["max_batch_size"] and fits(max_batch_size=b):
            out.append(f"--max-batch-size {b}")
            break
    if not accel and args["max_kv_tokens"] != -(-length // block_size) * block_size:
        need = -(-length // block_size) * block_size
        if fits(max_kv_tokens=need):
            out.append(f"--max-kv-tokens {need}")
    lo, hi = 0, (length - 1) // block_size  # the longest session (whole blocks) that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(session_len=mid * block_size):
            lo = mid
        else:
            hi = mid - 1
    if lo:
        out.append(f"--session-len {lo * block_size}")
    lo, hi = args["budget"], 16 * args["budget"] + 1024 * GiB  # the smallest budget that fits, to 1/64 GiB
    if fits(budget=hi):
        while hi - lo > GiB // 64:
            mid = (lo + hi) // 2
            if fits(budget=mid):
                hi = mid
            else:
                lo = mid
        out.append(f"a device with {math.ceil(hi / GiB * 100) / 100:.2f} GiB or more")
    return out


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _rank(kv: str) -> int:
    return {"int4": 0, "int8": 1}.get(kv, 2)


def _read_config(model: str):
    """(name, folder or None, config dict) for a checkpoint folder, a folder with only config.json, a config.json
    file, or a model name :func:`lite.formats.resolve_model` knows."""

    p = Path(model)
    if p.is_file():
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise LiteturboError(f"cannot read {p} as JSON ({e}); give a config.json or a checkpoint folder") from None
        if not isinstance(cfg, dict):
            raise LiteturboError(f"{p} is not a config.json (a JSON object); give a config.json or a checkpoint folder")
        name = p.parent.name if p.name == "config.json" else p.stem
        return name or p.stem, None, cfg
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise LiteturboError(f"{p} has no config.json; give a checkpoint folder or its config.json")
        return p.resolve().name, p, load_config(p)
    path = resolve_model(model)
    return path.name, path, load_config(path)


def plan_checkpoint(model: str, *, gpu_mem: str | None = None, device: str | None = None, backend: str = "auto",
                    dtype: str = "auto", w_bits: int | None = None, w_group_size: int | None = None,
                    kv_cache_dtype: str = "auto", session_len: int | None = None, max_batch_size: int = 64,
                    max_num_batched_tokens: int = 1024, block_size: int = 64,
                    max_kv_tokens: int | None = None, tp: int = 1) -> tuple[Plan, bool]:
    """:func:`plan` for ``liteturbo plan``: reads ``model`` (see :func:`_read_config`), resolves the device and
    budget (``gpu_mem``, else the memory free on ``device`` now) and the options as the engine would. Returns the
    plan (with ``raw_config`` attached) and whether the model must be quantized first (a 16-bit checkpoint planned
    at fewer bits). Raises ``LiteturboError`` for bad input."""

    name, folder, raw = _read_config(model)
    cfg = ModelConfig.from_dict(raw)
    for opt, v in (("--max-batch-size", max_batch_size), ("--max-num-batched-tokens", max_num_batched_tokens),
                   ("--block-size", block_size)):
        if v < 1:
            raise LiteturboError(f"{opt} must be >= 1, got {v}")
    if session_len is not None and session_len < 2:
        raise LiteturboError(f"--session-len must be > 1, got {session_len}")
    if max_kv_tokens is not None and max_kv_tokens < 1:
        raise LiteturboError(f"--max-kv-tokens must be >= 1, got {max_kv_tokens}")
    quantized_ckpt = bool(raw.get("quantization_config"))
    if quantized_ckpt and (w_bits is not None or w_group_size is not None):
        raise LiteturboError(f"{model} is already quantized; --w-bits and --w-group-size plan a 16-bit model as it "
                             f"would be quantized (drop them to plan this checkpoint as it is)")
    widths = {cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size}  # every linear's in_features
    valid = [g for g in (32, 64, 128, 256) if all(x % g == 0 for x in widths)]
    if w_group_size is None and not quantized_ckpt:
        w_group_size = 128 if 128 in valid else (max(valid) if valid else -1)
    elif w_group_size is not None and w_group_size != -1 and (w_group_size < 8 or any(x % w_group_size
                                                                                      for x in widths)):
        raise LiteturboError(f"--w-group-size {w_group_size} does not divide the input width of every linear "
                             f"({', '.join(str(x) for x in sorted(widths))}); use "
                             f"{', '.join(str(g) for g in valid) + ' or ' if valid else ''}-1 (per channel)")
    kv = KV_ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
    if kv not in KV_CACHE_DTYPE_CHOICES:
        raise LiteturboError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got "
                             f"{kv_cache_dtype!r}")
    in_use = 0
    if gpu_mem is not None:
        kind = (device or "cuda").lower().split(":")[0]
        if kind not in ("cpu", "cuda", "rocm", "npu"):
            raise LiteturboError(f"--device must be cpu, cuda, rocm or npu, got {device!r}")
        budget = parse_memory(gpu_mem)
        source = f"--gpu-mem {gpu_mem}"
        default_dtype = torch.bfloat16 if kind != "cpu" else current_platform("cpu").default_dtype()
    else:
        try:
            plat = current_platform(device or "auto")
        except ValueError as e:
            raise LiteturboError(str(e)) from None
        kind = plat.kind
        budget = plat.free_memory()
        source = f"free {plat.kind} memory now ({plat.name})"
        default_dtype = plat.default_dtype()
    dkey = {"half": "float16", "float": "float32"}.get(dtype.lower(), dtype.lower())
    if dkey == "auto":
        tdtype = default_dtype
    elif dkey in DTYPES:
        tdtype = DTYPES[dkey]
    else:
        raise LiteturboError(f"--dtype must be auto, bfloat16 (bf16), float16 (fp16, half) or float32 (fp32), got "
                             f"{dtype!r}")
    lm_int8 = quantized_ckpt or (w_bits is not None and w_bits < 16) or w_bits is None
    lm_int8 = lm_int8 and kind == "cpu" and tdtype != torch.float32
    wc = weight_choice(folder, raw, lm_int8, bits=w_bits if w_bits is not None else (None if quantized_ckpt else 4),
                       group_size=w_group_size)
    p = plan(cfg, raw, model=name, device_kind=kind, budget=budget, budget_source=source, backend=backend,
             dtype=tdtype, weights=wc, kv_cache_dtype=kv, session_len=session_len, max_batch_size=max_batch_size,
             max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, in_use=in_use,
             max_kv_tokens=max_kv_tokens, tp=tp)
    p.raw_config = raw
    if wc.bits == 8:
        p.notes.append("liteturbo loads 4-bit checkpoints only today: W8A16 is planned for comparison")
    if dtype != "auto":
        p.engine_options["dtype"] = p.dtype
    if backend != "auto":
        p.engine_options["backend"] = p.backend
    if block_size != 64:
        p.engine_options["block_size"] = block_size
    p.engine_options["device"] = {"cuda": "cuda", "rocm": "cuda", "npu": "npu"}.get(kind, "cpu")
    return p, (not quantized_ckpt and wc.bits < 16)
