"""What travels between rank 0 and the tensor-parallel workers, and how they meet: the pipe messages, the tensor
bytes inside some of them, and the ``torch.distributed`` rendezvous both sides join.

Each worker has one ``multiprocessing`` pipe to rank 0 (:class:`~turbo.core.tp.group.WorkerGroup` holds rank 0's
ends; :mod:`turbo.core.tp.worker` the other). Messages are tuples, the first item their kind, pickled by the pipe:

- start-up, worker → rank 0: ``("loaded", num_blocks)`` (its shard is loaded; the KV blocks it has room for);
  rank 0 → worker: ``("start", num_blocks)`` (the pool every rank allocates; both then join the process group);
  worker → rank 0: ``("ready",)`` (its KV cache is allocated).
- each step, rank 0 → worker: ``("step", StepInput)``: the step's plain input
  (:class:`~turbo.core.request.StepInput`, a few hundred bytes), sent before rank 0 computes its own shard; the
  worker runs its forward (its logits are dropped: rank 0 samples). No reply: the collectives inside the forward
  keep the ranks together.
- sessions, rank 0 → worker: ``("export", slots)`` → ``("kv", pack(...))`` (its stored K/V of those slots);
  ``("import", pack(...), slots)`` → ``("imported", None | why not)``.
- ``("exit",)``: rank 0 → worker, the worker returns. ``("error", message)``: worker → rank 0, the worker failed and
  exits with code 1. End-of-file on the pipe means the other side is gone.

The tensors of the forward never cross a pipe: they move in one process group of the platform's ``dist_backend``
(gloo on CPUs, nccl on CUDA/ROCm, hccl on Ascend), met through a ``TCPStore`` on this machine that rank 0 opens
(:func:`rendezvous`) and every rank joins (:func:`join_group`).
"""
from __future__ import annotations

import datetime
import io

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a collective waits for the slowest rank, never for idle time
STORE_HOST = "127.0.0.1"  # every rank runs on this machine


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    """Bytes of a dict of CPU tensors for a pipe (``torch.save``; read back by :func:`unpack`)."""
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, torch.Tensor]:
    """The dict of tensors :func:`pack` wrote (``weights_only``: tensors and plain containers only)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def rendezvous(world_size: int, port: int | None = None) -> dist.TCPStore:
    """The store the ranks meet through: opened by rank 0 (``port`` None: a free port, read back as ``.port``),
    reached by a worker at rank 0's ``port``."""
    if port is None:
        return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                             timeout=COLLECTIVE_TIMEOUT)
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def join_group(dist_backend: str, store: dist.TCPStore, rank: int, world_size: int) -> None:
    """Join the default process group as ``rank`` of ``world_size`` (every rank calls it; it returns when all have)."""
    dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
