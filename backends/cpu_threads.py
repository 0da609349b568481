"""CPU threads that share the machine: how many torch threads the engine uses, and a controller that lowers and
raises that number during decode when other processes compete for the same cores.

Sizing (:func:`choose_threads`, applied by :func:`apply_threads` at engine start): the cores this process may use
are those of its CPU affinity (``os.sched_getaffinity``), capped by its cgroup CPU quota (cgroup v2 ``cpu.max``,
v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the smallest along the cgroup's ancestors), rounded up
(:func:`usable_cpus`). The engine option ``threads`` (``liteturbo ... --threads``; else ``$LITETURBO_THREADS``)
is ``None``/``"auto"``: torch's current count (``OMP_NUM_THREADS``, or what the program set with
``torch.set_num_threads``) capped to the usable cores; ``N > 0``: exactly N (fixed); ``-K``: the usable cores less
K (at least 1), leaving room for the process's other work.

Contention (:class:`ThreadController`): every OpenMP parallel region waits for its slowest thread, so when another
busy process takes one of the cores, a thread of most regions is descheduled for a time slice while the others
spin: batch-1 decode on 2 cores fell to 10% of its idle speed beside one busy process (llama.cpp to 5%), while
one thread ran at ~57% (docs/benchmarks.md). The controller reads, for free, two signals over windows of
back-to-back decode steps: the stepping thread's CPU time over wall time (a descheduled team shows as < 1) and the
idle time of this process's cores (``/proc/stat``: room to grow back). On such evidence, not more often than a
backed-off interval, it probes: a few decode steps at the current count, a few at one thread fewer (or more), same
batch shape only, and keeps the faster. An idle machine shows no evidence, so it never probes there. Counts change
with ``torch.set_num_threads`` on the stepping thread (OpenMP's count belongs to the calling thread). Only decode
steps run at an adapted count (speculative ones too: one token per sequence plus its drafts, a few rows each, each
timed against steps of its own shape): liteturbo's C++ kernels split rows, columns and heads, never a reduction, and
torch's bf16 linear gave bit-equal results at 1 and 2 threads up to 128 rows here, so greedy tokens and logprobs
do not change (tests/test_cpu_threads.py, W4A16 and bf16); steps that prefill keep the full count, as torch's bf16
GEMM at 400 rows rounds differently with another count.
``OMP_WAIT_POLICY`` is read once, when torch loads its OpenMP runtime (set later it changes nothing); set before,
``passive`` cost idle decode more than half its speed here, so it is left alone. The engine uses no inter-op
parallelism (``torch.set_num_interop_threads`` is not touched).
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
# torch's count as the program left it, and the count this module set last (to tell the program's own calls)
_counts: dict[str, int | None] = {"program": None, "ours": None}


# --- what this process may use ------------------------------------------------------------------------------
def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``os.cpu_count()`` where the platform has no affinity call)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ancestors(base: Path, rel: str) -> list[Path]:
    """``base/rel`` and each folder above it up to ``base`` (a cgroup's quota is bounded by its parents')."""
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")  # "max 100000" or "150000 100000"
    if not text:
        return None
    quota, _, period = text.partition(" ")
    try:
        return int(quota) / int(period or 100000) if quota != "max" else None
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time per period the cgroup quota allows this process (e.g. ``1.5``), ``None`` when there is
    no quota (or no cgroup file system: not Linux). The smallest quota along the process's cgroup and its ancestors,
    in the v2 hierarchy (``root/<path>/cpu.max``) and the v1 ``cpu`` controller (``root/cpu[,cpuacct]/<path>/``);
    a path not visible here (a container's own cgroup namespace mounted at ``root``) falls back to its ancestors."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":
            folders = [f for f in _ancestors(root, rel)] + [f for f in _ancestors(root / "unified", rel)]
            limits += [_v2_limit(f) for f in folders]
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                limits += [_v1_limit(f) for f in _ancestors(root / mount, rel)]
    limits = [x for x in limits if x is not None and x > 0]
    return min(limits) if limits else None


def usable_cpus(quota: float | None | str = "read") -> int:
    """Cores this process can keep busy: its affinity CPUs, capped by the cgroup quota rounded up (threads past a
    fractional quota are throttled together, not descheduled one at a time). ``quota``: the quota to use instead
    of reading it (tests)."""
    q = cgroup_cpu_quota() if quota == "read" else quota
    n = affinity_cpus()
    return max(1, min(n, math.ceil(q - 1e-9))) if q else n


# --- the engine's choice --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThreadChoice:
    """threads: torch threads to use. adaptive: whether a :class:`ThreadController` may lower (and raise back) the
    count under contention (not for a fixed ``N``). why: how it was chosen (for logs)."""

    threads: int
    adaptive: bool
    why: str


def parse_threads(value) -> int | None:
    """``None``/``"auto"``/``""`` → ``None``; an integer (or its text) → itself. Raises ``ValueError`` for 0, a bool or
    anything else, naming the accepted forms."""
    accepted = "auto (all usable cores), N > 0 (exactly N) or -K (the usable cores less K)"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"threads must be {accepted}, got {value!r}")
    try:
        n = int(value.strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"threads must be {accepted}, got {value!r}") from None
    if n == 0 or (n != value and not isinstance(value, str)):
        raise ValueError(f"threads must be {accepted}, got {value!r}")
    return n


def choose_threads(threads=None, usable: int | None = None, current: int | None = None,
                   env: dict | None = None) -> ThreadChoice:
    """The thread count for ``threads`` (see the module docstring); ``None`` reads ``$LITETURBO_THREADS``.
    ``usable``: cores usable (default :func:`usable_cpus`); ``current``: the program's own count (default:
    ``torch.get_num_threads()`` unless that is a count liteturbo set, then the program's count before it). Warns when
    a fixed ``N`` exceeds the usable cores. Raises ``ValueError`` for a bad value (naming the option or variable)."""
    env = os.environ if env is None else env
    source = "threads"
    if threads is None and env.get("LITETURBO_THREADS", "").strip():
        threads, source = env["LITETURBO_THREADS"], "LITETURBO_THREADS"
    try:
        n = parse_threads(threads)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    usable = usable_cpus() if usable is None else usable
    if n is not None and n > 0:
        if n > usable:
            warnings.warn(f"{source}={n} is more threads than the {usable} core(s) this process can use (affinity, "
                          f"cgroup quota): each parallel region waits for a descheduled thread; use auto",
                          RuntimeWarning, stacklevel=3)
        return ThreadChoice(n, False, f"{source}={n}")
    if n is not None:
        return ThreadChoice(max(1, usable + n), True, f"{source}={n}: {usable} usable core(s) less {-n}")
    if current is None:
        current = _program_threads()
    return ThreadChoice(max(1, min(current, usable)), True,
                        f"auto: min(torch's {current}, {usable} usable core(s))")


def _program_threads() -> int:
    """torch's thread count as the program set it (or torch's default): the current one, unless it is the count
    this module set last (an engine's), then the one before."""
    now = torch.get_num_threads()
    if _counts["program"] is None or now != _counts["ours"]:
        _counts["program"] = now
    return _counts["program"]


def apply_threads(threads=None) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and set torch's thread count on the calling thread. Raises ``ValueError``."""
    choice = choose_threads(threads, current=_program_threads())
    set_torch_threads(choice.threads)
    return choice


def set_torch_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` (for the calling thread's OpenMP regions and the global default), remembered."""
    torch.set_num_threads(n)
    _counts["ours"] = n


# --- contention ---------------------------------------------------------------------------------------------
def idle_cpu_seconds(cpus: set[int] | None = None, stat: Path = Path("/proc/stat")) -> float | None:
    """Cumulative idle + iowait seconds of ``cpus`` (default: this process's affinity CPUs) since boot, from
    ``/proc/stat``; ``None`` where it cannot be read (not Linux)."""
    text = _read(stat)
    if text is None:
        return None
    try:
        cpus = os.sched_getaffinity(0) if cpus is None else cpus
    except (AttributeError, OSError):
        cpus = None
    tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    total = 0
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = line.split()
            if cpus is None or int(f[0][3:]) in cpus:
                total += int(f[4]) + int(f[5])
    return total / tick


class ThreadController:
    """Adapts torch's thread count to the cores free now, from the engine's decode steps (module docstring).

    The engine calls :meth:`begin_step` with the step's sequences and tokens before it and :meth:`end_step`
    after it. Only decode steps (one token per sequence, plus its speculative drafts) run at an adapted count and
    are timed, each compared only with steps of the same shape; any step that prefills runs at ``max_threads``, the count chosen at start
    (results must not depend on the count: see the module docstring). The controller stays in ``[1,
    max_threads]`` and acts only when ``adaptive``.

    Each window of at least ``window_steps`` back-to-back decode steps (a pause or a prefill starts a new one) and
    ``window_seconds`` s gives the evidence: busy when
    the stepping thread's CPU time is under ``busy_ratio`` of the steps' wall time (calm again above ``busy_ratio
    + 0.1``), and the idle cores of this process's CPUs over the window. A probe is due after ``interval`` decode
    steps (``base_interval``, doubled after each probe that keeps the count, up to ``max_interval``, back to
    ``base_interval`` when the evidence changes): one thread fewer when busy, one more when ``free_cores`` cores
    sat idle (or, where idle time cannot be read, periodically). A probe times ``probe_steps`` steps at the current
    count, then (after ``settle`` steps) ``probe_steps`` at the candidate, and switches when the candidate's mean
    step time is below ``1 - margin`` of the current's. ``set_threads``, ``clock``, ``cpu_clock`` and
    ``idle_seconds`` are injectable (tests). Not thread-safe: the engine's lock serializes steps."""

    def __init__(self, max_threads: int, adaptive: bool = True, *, set_threads: Callable[[int], None] = None,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] = time.thread_time,
                 idle_seconds: Callable[[], float | None] = idle_cpu_seconds, probe_steps: int = 4, settle: int = 1,
                 window_steps: int = 8, window_seconds: float = 0.1, base_interval: int = 32,
                 max_interval: int = 1024, margin: float = 0.05, busy_ratio: float = 0.8,
                 free_cores: float = 0.6) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads must be an integer >= 1, got {max_threads!r}")
        if probe_steps < 1 or window_steps < 1 or not 1 <= base_interval <= max_interval:
            raise ValueError("probe_steps and window_steps must be >= 1 and 1 <= base_interval <= max_interval")
        self.max_threads = self.threads = self._want = self._applied = max_threads
        self.adaptive = adaptive and max_threads > 1
        self._set_fn = set_threads or set_torch_threads
        self._clock, self._cpu, self._idle_fn = clock, cpu_clock, idle_seconds
        self.probe_steps, self.settle, self.margin = probe_steps, settle, margin
        self.window_steps, self.window_seconds = window_steps, window_seconds
        self.base_interval, self.max_interval, self.interval = base_interval, max_interval, base_interval
        self.busy_ratio, self.free_cores = busy_ratio, free_cores
        self.busy: bool | None = None  # None: no window since the count last changed
        self.free: float | None = None  # idle cores in the last gap-free window
        self._has_idle = self.adaptive and idle_seconds() is not None
        self._owner: int | None = None
        self._t0 = self._c0 = self._key = None
        self._last_end, self._last_wall = -1e18, 0.0
        self._win: list | None = None  # [start, idle at start, steps, wall, cpu]
        self._since, self._cand, self._probe = 0, None, None
        self.probes = self.switches = 0

    @classmethod
    def inert(cls) -> "ThreadController":
        """A controller that never changes torch's threads (for engine parts built without :func:`apply_threads`)."""
        return cls(1, adaptive=False, set_threads=lambda n: None)

    def describe(self) -> dict:
        """JSON-ready state: decode threads now, max_threads, adaptive, probes and switches so far, last evidence."""
        return {"threads": self.threads, "max_threads": self.max_threads, "adaptive": self.adaptive,
                "probes": self.probes, "switches": self.switches, "busy": self.busy, "free_cores": self.free}

    def _apply(self, n: int) -> None:
        if n != self._applied:
            self._set_fn(n)
            self._applied = n

    def _aim(self, n: int) -> None:
        """Decode at ``n`` threads from the next step; the evidence so far was about another count."""
        self._want = n
        self._win, self.busy = None, None

    def begin_step(self, seqs: int = 1, tokens: int = 1, drafts: int = 0) -> None:
        """Call before a step of ``seqs`` sequences computing ``tokens`` tokens, on the thread that runs it;
        ``drafts``: the speculative drafts among them (a step that verifies drafts decodes: one token per sequence
        plus its drafts, a few rows each)."""
        tid = threading.get_ident()
        if tid != self._owner:  # OpenMP's count belongs to the calling thread: give it to a new stepping thread
            self._owner = tid
            self._set_fn(self._applied)
        decode = self.adaptive and tokens == seqs + drafts
        self._apply(self._want if decode else self.max_threads)
        if not decode:
            self._win = None  # the window holds back-to-back decode steps only
            return
        self._key = (seqs, tokens)
        self._t0, self._c0 = self._clock(), self._cpu()
        if self._t0 - self._last_end > 0.002 + 0.5 * self._last_wall:
            self._win = None  # a pause: the idle time in it was ours
        if self._win is None:
            self._win = [self._t0, self._idle_fn() if self._has_idle else None, 0, 0.0, 0.0]

    def end_step(self) -> None:
        """Call after the step begun by :meth:`begin_step` (a failed step need not call it)."""
        if self._t0 is None:
            if self._probe is not None:
                self._probe["foreign"] += 1  # a prefill step in the middle of a probe
            return
        self._last_end = self._clock()
        wall, cpu = self._last_end - self._t0, self._cpu() - self._c0
        self._t0, self._last_wall = None, wall
        if self._probe is not None:
            self._probe_step(self._key, wall)
            return
        self._account(wall, cpu)
        self._since += 1
        if self._cand is not None and self._since >= self.interval:
            self.probes += 1
            self._probe = {"cand": self._cand, "phase": 0, "times": ({}, []), "skip": 0, "foreign": 0}

    def _account(self, wall: float, cpu: float) -> None:
        """Add a decode step to the evidence window; close it when long enough and name the candidate count."""
        w = self._win
        w[2], w[3], w[4] = w[2] + 1, w[3] + wall, w[4] + cpu
        span = self._clock() - w[0]
        if w[2] < self.window_steps or span < self.window_seconds:
            return
        ratio = w[4] / w[3] if w[3] > 0 else 1.0
        self.busy = ratio < self.busy_ratio or (bool(self.busy) and ratio < self.busy_ratio + 0.1)
        if w[1] is not None and w[3] >= 0.9 * span:  # steps back to back: idle time is the others' doing
            idle = self._idle_fn()
            if idle is not None:
                self.free = (idle - w[1]) / span
        self._win = None
        n = self.threads
        cand = (n - 1 if n > 1 and self.busy else
                n + 1 if n < self.max_threads and (not self._has_idle or (self.free or 0.0) >= self.free_cores)
                else None)
        if cand != self._cand:
            self._cand, self.interval = cand, self.base_interval  # a new situation: probe soon

    def _probe_step(self, key: Hashable, wall: float) -> None:
        """One decode step of a probe: ``probe_steps`` steps timed at the current count (their shapes noted), then
        ``probe_steps`` steps of those shapes at the candidate, each compared with the mean of its own shape at
        the current count (speculative steps change shape with their drafts); then decide."""
        p = self._probe
        cur, new = p["times"]
        unseen = p["phase"] == 1 and key not in cur
        p["foreign"] += unseen
        if p["foreign"] > 2 * self.probe_steps:  # the load changed shape: give up, try later
            self._end_probe(False)
            return
        if unseen:
            return
        if p["skip"]:
            p["skip"] -= 1
            return
        if p["phase"] == 0:
            cur.setdefault(key, []).append(wall)
            if sum(map(len, cur.values())) >= self.probe_steps:
                p["phase"], p["skip"] = 1, self.settle
                self._want = p["cand"]
            return
        new.append((key, wall))
        if len(new) < self.probe_steps:
            return
        expected = sum(sum(cur[k]) / len(cur[k]) for k, _ in new)  # the same steps at the current count
        self._end_probe(sum(w for _, w in new) < expected * (1.0 - self.margin))

    def _end_probe(self, switch: bool) -> None:
        cand = self._probe["cand"]
        self._probe, self._since = None, 0
        if switch:
            self.threads, self.switches, self.interval, self._cand = cand, self.switches + 1, self.base_interval, None
        else:
            self.interval = min(2 * self.interval, self.max_interval)
        self._aim(self.threads)
