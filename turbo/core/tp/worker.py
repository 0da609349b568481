"""The main of a tensor-parallel worker process (ranks 1..N-1, spawned by :class:`turbo.core.tp.group.WorkerGroup`).

A worker resolves the same options as rank 0 on its own device, checks and loads its shard of the weights
(:mod:`turbo.core.tp.shard`), reports how many KV blocks it has room for, joins the process group once rank 0 has
fixed the pool, allocates its KV cache and then serves rank 0's messages on its pipe until told to exit:

``("step", StepInput)``: run the model's forward on its shard (its logits are dropped: rank 0 samples);
``("export", slots)`` → ``("kv", bytes)``: its stored K/V of those slots; ``("import", bytes, slots)`` →
``("imported", None | why not)``; ``("exit",)``.

End-of-file on the pipe means rank 0 is gone: the worker exits. Any other failure is reported as ``("error",
message)`` and ends the process with exit code 1 (rank 0 then reports the engine dead).
"""
from __future__ import annotations

import dataclasses
import os
import signal

import torch
import torch.distributed as dist

from lite.formats import LiteturboError


def worker_main(rank: int, config, path: str, device: str, port: int, conn) -> None:
    """Run rank ``rank`` of ``config.tensor_parallel_size`` on ``device`` for the model at ``path``; ``port``: rank
    0's ``torch.distributed`` store; ``conn``: this worker's end of its pipe to rank 0. Ctrl-C (SIGINT, sent to the
    terminal's whole process group) is ignored: a worker ends when rank 0 closes it or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(rank, config, path, device, port, conn)
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


def _serve(rank: int, config, path: str, device: str, port: int, conn) -> None:
    from backends.cpu_threads import usable_cpus

    from ..model import LlamaModel
    from ..runner import ModelRunner
    from ..startup import check_fits_before_loading, kv_calibration, kv_spec, pool_blocks, rank_free, resolve
    from .group import COLLECTIVE_TIMEOUT, pack, unpack

    tp = config.tensor_parallel_size
    config = dataclasses.replace(config, device=device)
    if device == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, usable_cpus() // tp))
    elif device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    elif device.startswith("npu"):
        torch.npu.set_device(torch.device(device))
    fit = resolve(config, path, rank=rank)
    check_fits_before_loading(fit, rank_free(fit))
    model = LlamaModel.from_pretrained(fit.path, fit.backend, fit.dtype, lm_head_int8=fit.lm_int8, shard=fit.shard)
    kv_params = kv_calibration(fit, model.cfg)
    conn.send(("loaded", pool_blocks(fit, rank_free(fit))[0]))
    op, *args = conn.recv()
    if op != "start":
        return
    store = dist.TCPStore("127.0.0.1", port, tp, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(fit.platform.dist_backend, store=store, rank=rank, world_size=tp,
                            timeout=COLLECTIVE_TIMEOUT)
    fit.backend.tp_group = dist.group.WORLD
    runner = ModelRunner(model, kv_spec(fit, args[0]), kv_params)
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
