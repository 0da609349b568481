"""Tensor parallelism seen from rank 0 (the engine's own process): the worker processes, their process group, the
runner that runs a step on every rank, and what happens when a rank dies.

:class:`WorkerGroup` spawns ranks 1..N-1 with ``torch.multiprocessing`` (spawn; :mod:`turbo.core.tp.worker` is
their main, and each starts up through the same function as rank 0, :func:`turbo.core.startup.load_rank`, which rank
0 hands it) and talks to each over its own ``multiprocessing`` pipe, in the messages of :mod:`turbo.core.tp.wire`:
the start-up handshake, then each step's plain :class:`~turbo.core.request.StepInput` (pickled, a few hundred
bytes), KV export/import for sessions, and exit. The tensors move through one ``torch.distributed`` process group
(the platform's ``dist_backend``: gloo on CPUs, nccl on CUDA/ROCm, hccl on Ascend), inside the model's forward
(:mod:`turbo.core.tp.shard`). A worker waits on its pipe between steps, so no collective waits through idle time; a
worker whose rank 0 is gone reads end-of-file there and exits (no orphans, even when rank 0 is killed).

Faults: a monitor thread waits on the workers' process sentinels; when one exits unasked the group is marked dead
(:attr:`WorkerGroup.dead` names the rank, pid and exit code or signal) and, on accelerators, the process group is
aborted so that a pending collective returns. On a CPU gloo itself fails the pending collective as soon as the
peer's sockets close. The step that was running, and every later one, raises
:class:`~turbo.errors.EngineDead`; any failure inside a tensor-parallel step is fatal (the ranks cannot be brought
back into step), and the surviving workers are stopped.
"""
from __future__ import annotations

import signal
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lite.formats import LiteturboError

from ...errors import EngineDead
from ..runner import ModelRunner
from .wire import join_group, pack, rendezvous, unpack
from .worker import worker_main

DEATH_GRACE_S = 2.0  # after a failed collective: how long to wait for the dead worker's exit to be seen


def _death(rank: int, proc) -> str:
    """Who died and how, for messages: rank, pid, exit code or signal."""
    # its pipe may close before its exit status is reaped, and another thread joining it may reap it first (then
    # this thread's waitpid fails until that one has stored the status): poll for up to 2 s
    deadline = time.monotonic() + 2.0
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    code = proc.exitcode
    if code is None:
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) stopped answering (its pipe closed)"
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            how = f"was killed by signal {-code} (exit code {code})"
    else:
        how = f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


def _stop(procs, conns, graceful: bool = True) -> None:
    """Ask every worker to exit (``graceful``), then terminate and kill what is left."""
    if graceful:
        for conn in conns:
            try:
                conn.send(("exit",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        conn.close()


def _monitor(ref, procs) -> None:
    """Wait for any worker to exit; unless the group is closing, mark it dead (and abort its collectives)."""
    sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(procs, 1)}
    ready = wait(list(sentinels))
    group = ref()
    if group is None or group.closing:
        return
    rank, proc = sentinels[ready[0]]
    proc.join(1.0)
    group.mark_dead(_death(rank, proc) + group.last_words(rank))


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel engine (``config.tensor_parallel_size`` = N), started loading
    ``path`` at construction: each worker runs ``load(config on its device, path, rank)`` (rank 0's start-up path,
    :func:`turbo.core.startup.load_rank`, handed over so that every rank starts up the same way);
    :meth:`gather_blocks` then :meth:`connect` finish the start-up. Raises ``LiteturboError`` when a worker fails to
    start or to load (its message, with its rank)."""

    def __init__(self, config, path, platform, load) -> None:
        if dist.is_initialized():
            raise LiteturboError("this process already runs a tensor-parallel engine (torch.distributed's default "
                                 "process group is taken); close it first (engine.close())")
        self.size = config.tensor_parallel_size
        self.dist_backend = platform.dist_backend
        self.dead: str | None = None
        self.closing = False
        self.connected = False
        self._store = rendezvous(self.size)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"liteturbo-tp-rank{rank}", daemon=True,
                               args=(rank, config, str(path), platform.rank_device(rank), self._store.port, child,
                                     load))
            proc.start()
            child.close()  # rank 0 keeps only its end: the worker reads end-of-file when rank 0 is gone
            self.procs.append(proc)
            self.conns.append(parent)

    # --- start-up ----------------------------------------------------------------------------------------------
    def gather_blocks(self, num_blocks: int) -> int:
        """Wait until every worker has loaded its shard; the pool every rank allocates: the fewest blocks any rank
        (``num_blocks``: rank 0's) has room for."""
        return min([num_blocks] + [self._recv(i, "loaded")[1] for i in range(len(self.procs))])

    def connect(self, num_blocks: int, backend) -> None:
        """Tell the workers the pool size, form the process group (rank 0 = this process) and wait until every
        worker has allocated its KV cache; ``backend`` (rank 0's) then runs the collectives."""
        for conn in self.conns:
            conn.send(("start", num_blocks))
        join_group(self.dist_backend, self._store, 0, self.size)
        self.connected = True
        backend.tp_group = dist.group.WORLD
        for i in range(len(self.procs)):
            self._recv(i, "ready")
        threading.Thread(target=_monitor, args=(weakref.ref(self), list(self.procs)), daemon=True,
                         name="liteturbo-tp-monitor").start()

    def _recv(self, i: int, expected: str) -> tuple:
        """The next message of worker ``i`` (rank ``i + 1``), of kind ``expected``. Raises ``LiteturboError`` (before
        the group is connected) or :class:`EngineDead` when it reports an error or exits first."""
        conn, proc = self.conns[i], self.procs[i]
        msg = None
        if conn in wait([conn, proc.sentinel]):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = None
        if msg is not None and msg[0] == expected:
            return msg
        if msg is None:
            proc.join(2.0)
            why = _death(i + 1, proc)
        elif msg[0] == "error":
            why = f"tensor-parallel worker rank {i + 1} failed: {msg[1]}"
        else:
            why = f"tensor-parallel worker rank {i + 1} answered {msg[0]!r} instead of {expected!r}"
        if not self.connected:
            self.close(graceful=False)
            raise LiteturboError(why)
        raise self._fatal(why)

    # --- steps and faults ------------------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        """Send ``msg`` to every worker. Raises :class:`EngineDead` when the group is dead or a pipe is broken."""
        if self.dead is not None:
            raise EngineDead(self.dead + "; the engine cannot continue: restart it")
        for conn in self.conns:
            try:
                conn.send(msg)
            except (OSError, ValueError) as e:
                raise self.fail(e) from e

    def mark_dead(self, why: str) -> None:
        """Record the first reason the group died; on accelerators, abort its collectives so none waits on."""
        if self.dead is None:
            self.dead = why
            if self.connected and self.dist_backend != "gloo":
                try:
                    dist.distributed_c10d._abort_process_group()
                except Exception:  # best effort: the pending collective then ends by its timeout
                    pass

    def last_words(self, rank: int) -> str:
        """The error a worker sent before it exited (``": ..."``), or ``""``."""
        conn = self.conns[rank - 1]
        try:
            if conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    return f" after an error: {msg[1]}"
        except (EOFError, OSError, ValueError):
            pass
        return ""

    def fail(self, error: BaseException) -> EngineDead:
        """A tensor-parallel step failed (``error``): the ranks cannot be brought back into step. Find which
        worker died (the usual cause, seen within :data:`DEATH_GRACE_S`), else blame rank 0's ``error``; stop the
        workers; return the :class:`EngineDead` to raise."""
        deadline = time.monotonic() + (DEATH_GRACE_S if isinstance(error, Exception) else 0.0)  # not for Ctrl-C
        while self.dead is None and time.monotonic() < deadline:
            gone = [(r, p) for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
            if gone:
                self.mark_dead(_death(*gone[0]) + self.last_words(gone[0][0]))
                break
            time.sleep(0.02)
        self.mark_dead(f"a tensor-parallel step failed on rank 0 ({type(error).__name__}: {error})")
        return self._fatal(self.dead)

    def _fatal(self, why: str) -> EngineDead:
        self.mark_dead(why)
        self.close(graceful=False)
        return EngineDead(self.dead + "; the engine cannot continue: restart it")

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (asked to exit; terminated if they do not within 5 s, at once unless ``graceful``) and
        leave the process group. Safe to call more than once."""
        if self.closing:
            return
        self.closing = True
        if self.dead is None:
            self.dead = "the engine was closed"
        self._finalizer.detach()
        _stop(self.procs, self.conns, graceful)
        if self.connected:
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead rank may fail to tear down; it is gone either way
                pass


class ParallelRunner(ModelRunner):
    """The :class:`~turbo.core.runner.ModelRunner` of rank 0 in a tensor-parallel engine: each step's plain input
    goes to every worker before rank 0 computes its own shard (the collectives inside the forward keep the ranks
    together); KV export/import reach every rank's shard. Construction connects ``group`` (see
    :meth:`WorkerGroup.connect`)."""

    def __init__(self, model, spec, kv_params, group: WorkerGroup) -> None:
        group.connect(spec.num_blocks, model.backend)
        super().__init__(model, spec, kv_params)
        self.group = group

    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a worker died, a step failed, it was closed), else ``None``."""
        return self.group.dead

    def run(self, step):
        """See :meth:`ModelRunner.run`. Raises :class:`~turbo.errors.EngineDead` when a rank is or goes dead (any
        failure inside the step is fatal), and ``LiteturboError`` for a position past the rotary table (checked
        before any rank starts)."""
        self.model.check_positions(max(step.positions))  # the workers would fail the same check, fatally
        self.group.send(("step", step))
        try:
            return super().run(step)
        except BaseException as e:
            dead = self.group.fail(e)
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the engine is dead, and they go on
                raise
            raise dead from e

    def export_kv(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """Every rank's stored K/V of ``slots``: ``"rank{r}/{name}.{layer}"`` → ``[n, its KV heads, ...]``."""
        out = {f"rank0/{k}": v for k, v in super().export_kv(slots).items()}
        self.group.send(("export", list(slots)))
        for i in range(len(self.group.procs)):
            out.update({f"rank{i + 1}/{k}": v for k, v in unpack(self.group._recv(i, "kv")[1]).items()})
        return out

    def import_kv(self, kv: dict[str, torch.Tensor], slots: list[int]) -> None:
        """Load what :meth:`export_kv` returned (from an engine of the same tensor-parallel size) into ``slots``.
        Raises ``ValueError`` naming a missing or misshaped tensor (rank 0's shard is checked before any worker
        writes; a worker's bad shard leaves only unused blocks written)."""
        parts = [{} for _ in range(self.group.size)]
        for key, t in kv.items():
            rank, _, name = key.partition("/")
            if not (rank.startswith("rank") and rank[4:].isdigit() and int(rank[4:]) < self.group.size):
                raise ValueError(f"saved KV tensor {key!r} belongs to no rank of this engine's "
                                 f"{self.group.size}")
            parts[int(rank[4:])][name] = t
        super().import_kv(parts[0], slots)
        for i, conn in enumerate(self.group.conns):
            conn.send(("import", pack(parts[i + 1]), list(slots)))
        bad = [msg[1] for i in range(len(self.group.procs)) if (msg := self.group._recv(i, "imported"))[1]]
        if bad:
            raise ValueError(bad[0])

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        self.group.close()
