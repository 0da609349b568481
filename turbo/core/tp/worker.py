"""The main of a tensor-parallel worker process (ranks 1..N-1, spawned by :class:`turbo.core.tp.group.WorkerGroup`).

A worker starts up as rank 0 does, through the start-up function rank 0 hands it
(:func:`turbo.core.startup.load_rank`: its options on its own device, its shard of the weights checked and loaded,
the KV blocks it has room for), reports that count, joins the process group once rank 0 has fixed the pool,
allocates its KV cache and then serves rank 0's messages on its pipe until told to exit (the messages are listed in
:mod:`turbo.core.tp.wire`): a step runs the model's forward on its shard (its logits are dropped: rank 0 samples);
sessions export and import its shard of the KV.

End-of-file on the pipe means rank 0 is gone: the worker exits. Any other failure is reported as ``("error",
message)`` and ends the process with exit code 1 (rank 0 then reports the engine dead).
"""
from __future__ import annotations

import dataclasses
import os
import signal

import torch.distributed as dist

from lite.formats import LiteturboError

from ..runner import ModelRunner
from .wire import join_group, pack, rendezvous, unpack


def worker_main(rank: int, config, path: str, device: str, port: int, conn, load) -> None:
    """Run rank ``rank`` of ``config.tensor_parallel_size`` on ``device`` for the model at ``path``; ``port``: rank
    0's ``torch.distributed`` store; ``conn``: this worker's end of its pipe to rank 0; ``load``: the start-up of one
    rank, ``load(config, path, rank)`` → a :class:`turbo.core.startup.RankLoad`. Ctrl-C (SIGINT, sent to the
    terminal's whole process group) is ignored: a worker ends when rank 0 closes it or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(rank, dataclasses.replace(config, device=device), path, port, conn, load)
    except EOFError:
        pass  # rank 0 is gone
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        why = str(e) if isinstance(e, LiteturboError) else f"{type(e).__name__}: {e}"
        try:
            conn.send(("error", why))
        except (OSError, ValueError):
            pass
        os._exit(1)  # a group broken mid-collective may hang a normal interpreter exit
    os._exit(0)


def _serve(rank: int, config, path: str, port: int, conn, load) -> None:
    part = load(config, path, rank)
    conn.send(("loaded", part.num_blocks))
    op, *args = conn.recv()
    if op != "start":
        return
    join_group(part.fit.platform.dist_backend, rendezvous(config.tensor_parallel_size, port), rank,
               config.tensor_parallel_size)
    part.fit.backend.tp_group = dist.group.WORLD
    runner = ModelRunner(part.model, part.kv_spec(args[0]), part.kv_params)
    conn.send(("ready",))
    while True:
        op, *args = conn.recv()
        if op == "step":
            runner.run(args[0])
        elif op == "export":
            conn.send(("kv", pack(runner.export_kv(args[0]))))
        elif op == "import":
            try:
                runner.import_kv(unpack(args[0]), args[1])
                conn.send(("imported", None))
            except ValueError as e:
                conn.send(("imported", f"rank {rank}: {e}"))
        elif op == "exit":
            return
        else:
            raise RuntimeError(f"unknown message {op!r} from rank 0")
