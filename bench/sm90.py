"""Static sm_90 (Hopper) report of a Triton kernel, computed on a machine without a GPU.

A ``@triton.jit`` kernel is compiled for ``GPUTarget("cuda", 90, 32)`` (``triton.compile`` of an ``ASTSource``;
``TRITON_INTERPRET`` must not have been set when the kernel's module was imported, or the kernel is an interpreted
function that cannot be compiled), and the ``cuobjdump`` shipped in the triton wheel
(``triton/backends/nvidia/bin/cuobjdump``) reads the cubin: resource usage (``-res-usage``) and the SASS
(``-sass``).

What the numbers mean:

- ``registers``: registers per thread (255 is the hardware maximum; more live values spill).
- ``spill_bytes``: bytes of registers spilled to local memory per thread: 0 when the cubin has no stack frame,
  else as ``ptxas -v`` (the wheel's own ptxas, re-run on the kernel's PTX with Triton's options) reports them
  (``spill_store_bytes`` / ``spill_load_bytes``); ``stack_bytes``: the stack frame (``STACK`` of ``-res-usage``:
  spills, and call frames such as the IEEE division's slow path, which are not spills). ``spill_stores`` / ``spill_loads``: static counts of ``STL`` / ``LDL`` instructions. Without a
  usable ptxas, ``spill_bytes`` falls back to the stack frame when any ``STL``/``LDL`` exists. 0 is the target.
- ``shared_bytes``: dynamic shared memory per program (what Triton launches with); ``static_shared_bytes``: the
  cubin's static shared memory.
- ``n_instructions``: SASS instructions in the whole kernel; ``histogram``: per opcode class (the mnemonic before
  its first ``.``: ``LDG``, ``IMAD``, ``HFMA2``, ``LOP3``, ``PRMT``, ``SHFL``, ``HMMA``...).
- ``loop``: the main loop: the largest backward branch's body (the instructions from a branch target up to the
  ``BRA`` that jumps back to it), its instruction count per thread (``instructions``) and its histogram. Each
  instruction of the body is issued once per warp per iteration, so a kernel with ``num_warps`` warps that does
  ``units`` units of work per iteration (weights for a GEMV, tokens x KV heads for attention) costs
  ``loop_instructions * num_warps / units`` warp-instructions per unit (:func:`warp_instr_per_unit`).
- :func:`issue_bound`: the ceiling an instruction count puts on throughput: an H200 issues at most 4
  warp-instructions per clock per SM (one per scheduler) x 132 SMs x 1.98 GHz = 1.045e12 warp-instructions per
  second; divided by warp-instructions per unit that is units per second, times the bytes each unit reads it is
  bytes per second, compared with the ~4.3 TB/s a device-to-device copy reaches. A kernel whose issue bound is
  below the copy bandwidth cannot be memory-bound, whatever its tiles. It is an upper bound (stalls, latency and
  the instructions outside the loop only lower it), not a prediction.

Use::

    from bench.sm90 import compile_report
    rep = compile_report(kernel, {"x_ptr": "*fp16", "N": "i32", ...}, {"BLOCK": 64}, num_warps=4, num_stages=3,
                         divisible=("N",))
    rep["registers"], rep["spill_bytes"], rep["loop"]["instructions"]

``signature`` maps every runtime argument to a Triton type string (``*fp16``, ``*bf16``, ``*fp32``, ``*i32``,
``*u8``, ``i32``, ``i64``, ``fp32``); the constexpr arguments are given by ``constexprs`` (name → value) and may be
left out of ``signature``. ``divisible`` names the arguments specialized as multiples of 16 as Triton's launcher
does for aligned pointers and integers divisible by 16 (default: every pointer; add the integer sizes and strides
that are multiples of 16 in the launch being modelled, since it changes the vectorization).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

# the H200 (SXM): 132 SMs, 1.98 GHz boost, 4 schedulers per SM each issuing one warp-instruction per clock
H200_SMS = 132
H200_CLOCK_HZ = 1.98e9
H200_ISSUE_PER_CLOCK_PER_SM = 4
H200_ISSUE_RATE = H200_ISSUE_PER_CLOCK_PER_SM * H200_SMS * H200_CLOCK_HZ  # warp-instructions per second
H200_COPY_BW = 4.3e12  # bytes per second a device-to-device copy reaches (read + write counted), about


class StaticReportError(RuntimeError):
    """The static report cannot be made here (no triton, no cuobjdump, an interpreted kernel...)."""


@contextlib.contextmanager
def _no_interpret():
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


def _triton_dir() -> Path:
    try:
        import triton
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise StaticReportError("triton is not installed (pip install triton)") from e
    return Path(triton.__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def cuobjdump_path() -> str:
    """The ``cuobjdump`` of the triton wheel (or ``$TRITON_CUOBJDUMP_PATH``, or one on ``PATH``)."""
    cands = [os.environ.get("TRITON_CUOBJDUMP_PATH"), str(_triton_dir() / "backends" / "nvidia" / "bin" / "cuobjdump"),
             shutil.which("cuobjdump")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise StaticReportError(
        "cuobjdump not found: expected it in the triton wheel (triton/backends/nvidia/bin/cuobjdump), in "
        "$TRITON_CUOBJDUMP_PATH or on PATH; install a Linux x86-64/aarch64 triton wheel or the CUDA toolkit")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                 divisible=None, arch: int = 90):
    """``triton.compile`` of ``fn`` for sm_``arch`` → Triton's compiled kernel (``.asm['cubin']``, ``.metadata``)."""
    with _no_interpret():
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction

        if not isinstance(fn, JITFunction):
            raise StaticReportError(
                f"{getattr(fn, '__name__', fn)!r} is not a compilable @triton.jit function (was its module imported "
                f"with TRITON_INTERPRET=1? unset it before importing the kernels)")
        sig = {name: "constexpr" for name in constexprs}
        for name in fn.arg_names:
            if name in signature:
                sig[name] = signature[name]
            elif name not in constexprs:
                raise StaticReportError(f"{fn.__name__}: argument {name!r} is in neither signature nor constexprs")
        sig = {name: sig[name] for name in fn.arg_names}
        if divisible is None:
            divisible = [n for n, t in signature.items() if str(t).startswith("*")]
        else:
            divisible = list(divisible) + [n for n, t in signature.items() if str(t).startswith("*")]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in set(divisible) if n in fn.arg_names}
        src = ASTSource(fn, sig, dict(constexprs), attrs)
        opts = {"num_warps": int(num_warps), "num_stages": int(num_stages), "enable_fp_fusion": True}
        try:
            return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        except Exception as e:
            raise StaticReportError(f"{fn.__name__}: compiling for sm_{arch} failed: {type(e).__name__}: {e}") from e


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`?\(?)?(0x[0-9a-f]+)")


def _ptxas_path() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
        if path and os.path.isfile(path):
            return path
    except Exception:
        pass
    for name in ("ptxas-blackwell", "ptxas"):
        c = _triton_dir() / "backends" / "nvidia" / "bin" / name
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def _version_line(exe: str | None) -> str | None:
    """The last line of ``exe --version`` (e.g. ``Cuda compilation tools, release 12.8, V12.8.93``), or None."""
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return lines[-1] if lines else None


@functools.lru_cache(maxsize=1)
def toolchain() -> dict:
    """What compiled the report: ``triton`` (version), ``ptxas`` and ``cuobjdump`` (their ``--version`` lines),
    ``target`` and ``ptxas_options``. Registers and spills are a function of these (ptxas's register allocator
    differs between CUDA releases), so a report names them: the same toolchain gives the same report on any host
    (compilation is deterministic and needs no GPU)."""
    import triton

    try:
        cuobj = cuobjdump_path()
    except StaticReportError:
        cuobj = None
    return {"triton": triton.__version__, "ptxas": _version_line(_ptxas_path()), "cuobjdump": _version_line(cuobj),
            "target": "sm_90a", "ptxas_options": list(PTXAS_OPTIONS)}


PTXAS_OPTIONS = ("-lineinfo", "-v", "--regAllocOptLevel=2")  # what Triton's make_cubin passes (3.9), plus -v
_PTXAS_V = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_spills(ptx: str, arch: str = "sm_90a") -> dict | None:
    """``{stack_frame, spill_store_bytes, spill_load_bytes}`` from ``ptxas -v`` on ``ptx``, or None."""
    exe = _ptxas_path()
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "kernel.ptx"
        src.write_text(ptx)
        r = subprocess.run([exe, *PTXAS_OPTIONS, f"--gpu-name={arch}", str(src), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    m = _PTXAS_V.search(r.stdout + r.stderr)
    if r.returncode != 0 or not m:
        return None
    return {"stack_frame": int(m.group(1)), "spill_store_bytes": int(m.group(2)), "spill_load_bytes": int(m.group(3))}


def _cuobjdump(cubin: bytes, flag: str) -> str:
    exe = cuobjdump_path()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "kernel.cubin"
        p.write_bytes(cubin)
        r = subprocess.run([exe, flag, str(p)], capture_output=True, text=True)
    if r.returncode != 0:
        raise StaticReportError(f"cuobjdump {flag} failed ({r.returncode}): {r.stderr.strip()[:500]}")
    return r.stdout


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode class, full instruction text)`` for every instruction of a ``cuobjdump -sass``
    listing (one kernel)."""
    out = []
    for line in sass.splitlines():
        m = _INS.search(line)
        if not m:
            continue
        text = m.group(2).strip()
        body = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        op = body.split()[0] if body else ""
        out.append((int(m.group(1), 16), op.split(".")[0], text))
    return out


def histogram(instrs) -> dict[str, int]:
    """Instruction count per opcode class, largest first."""
    c = Counter(op for _, op, _ in instrs)
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def loops(instrs) -> list[dict]:
    """Every backward branch: ``{start, end, instructions, histogram}`` (addresses of the target and the ``BRA``;
    the body counts both ends), largest first. The self-branch padding after ``EXIT`` is not a loop."""
    found = []
    for addr, op, text in instrs:
        if op != "BRA":
            continue
        m = _BRA.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [i for i in instrs if target <= i[0] <= addr]
        found.append({"start": target, "end": addr, "instructions": len(body), "histogram": histogram(body)})
    found.sort(key=lambda d: -d["instructions"])
    return found


def main_loop(instrs) -> dict | None:
    """The largest loop of :func:`loops` (the main loop of a Triton kernel with one ``for``), or None."""
    ls = loops(instrs)
    return ls[0] if ls else None


def compile_report(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                   divisible=None, keep_sass: bool = False) -> dict:
    """The static report of one kernel configuration (see the module docstring for what each number means):
    ``registers, spill_bytes, spill_store_bytes, spill_load_bytes, stack_bytes, spill_stores, spill_loads,
    local_bytes, shared_bytes, static_shared_bytes,
    n_instructions, histogram, loop`` (``{instructions, histogram, start, end}`` or None), ``n_loops``,
    ``num_warps, num_stages``; with ``keep_sass`` also ``sass`` (the listing)."""
    k = compile_sm90(fn, signature, constexprs, num_warps, num_stages, divisible)
    cubin = k.asm["cubin"]
    res = _cuobjdump(cubin, "-res-usage")
    m = _RES.search(res)
    if not m:
        raise StaticReportError(f"cuobjdump -res-usage: no resource line in {res[:300]!r}")
    regs, stack, static_shared, local = (int(g) for g in m.groups())
    sass = _cuobjdump(cubin, "-sass")
    instrs = parse_sass(sass)
    if not instrs:
        raise StaticReportError("cuobjdump -sass printed no instructions")
    hist = histogram(instrs)
    ls = loops(instrs)
    n_stl, n_ldl = hist.get("STL", 0), hist.get("LDL", 0)
    # the cubin Triton built is the truth: no stack frame, no spill; else ptxas -v says how much of it is spills
    px = ptxas_spills(k.asm["ptx"]) if stack and "ptx" in k.asm else None
    if not stack:
        spill, spill_st, spill_ld = 0, 0, 0
    elif px is not None:
        spill, spill_st, spill_ld = px["spill_store_bytes"], px["spill_store_bytes"], px["spill_load_bytes"]
    else:
        spill = stack if (n_stl or n_ldl) else 0
        spill_st = spill_ld = None
    rep = {
        "kernel": fn.__name__, "num_warps": int(num_warps), "num_stages": int(num_stages),
        "registers": regs, "spill_bytes": spill, "spill_store_bytes": spill_st, "spill_load_bytes": spill_ld,
        "stack_bytes": stack, "local_bytes": local, "spill_stores": n_stl, "spill_loads": n_ldl,
        "shared_bytes": int(getattr(k.metadata, "shared", 0) or 0), "static_shared_bytes": static_shared,
        "n_instructions": len(instrs), "histogram": hist, "loop": ls[0] if ls else None, "n_loops": len(ls),
    }
    if keep_sass:
        rep["sass"] = sass
    return rep


def loop_instructions(report: dict) -> int:
    """Instructions per thread in one iteration of the report's main loop (0 when the kernel has no loop)."""
    return report["loop"]["instructions"] if report.get("loop") else 0


def warp_instr_per_unit(report: dict, units_per_iteration: float, loop_instr: int | None = None) -> float:
    """Warp-instructions issued per unit of work: ``loop_instructions * num_warps / units_per_iteration``."""
    li = loop_instructions(report) if loop_instr is None else loop_instr
    return li * report["num_warps"] / float(units_per_iteration)


def issue_bound(warp_instr_per_unit: float, bytes_per_unit: float = 0.5, issue_rate: float = H200_ISSUE_RATE,
                copy_bw: float = H200_COPY_BW) -> dict:
    """The H200 ceiling set by instruction issue: ``units_per_s`` (issue rate / warp-instructions per unit),
    ``bytes_per_s`` (times ``bytes_per_unit``: 0.5 for a 4-bit weight, ``2 * D * 2`` for a bf16 K+V token x head)
    and ``fraction_of_copy_bw`` (of ~4.3 TB/s; >= 1 means the kernel can be memory-bound)."""
    if warp_instr_per_unit <= 0:
        return {"units_per_s": float("inf"), "bytes_per_s": float("inf"), "fraction_of_copy_bw": float("inf")}
    units = issue_rate / warp_instr_per_unit
    return {"units_per_s": units, "bytes_per_s": units * bytes_per_unit,
            "fraction_of_copy_bw": units * bytes_per_unit / copy_bw}


def summary_line(name: str, rep: dict, wipu: float | None = None, unit: str = "unit") -> str:
    """One printable line of a report."""
    li = loop_instructions(rep)
    s = (f"{name:<48} w{rep['num_warps']} s{rep['num_stages']} regs {rep['registers']:>3} "
         f"spill {rep['spill_bytes']:>4}B smem {rep['shared_bytes']:>6}B instr {rep['n_instructions']:>5} loop {li:>5}")
    if wipu is not None:
        s += f"  {wipu:.3f} warp-instr/{unit}"
    return s
