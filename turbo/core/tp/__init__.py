"""Tensor parallelism of the engine: one model split over N ranks, one process and one device each.

:mod:`~turbo.core.tp.shard`: which part of every weight a rank holds, which splits are refused (before loading),
and the vocabulary-parallel embedding and logits. :mod:`~turbo.core.tp.group`: rank 0's side (the engine's own
process): the spawned workers, the process group, :class:`~turbo.core.tp.group.ParallelRunner` and fault handling.
:mod:`~turbo.core.tp.worker`: the workers' main. :mod:`~turbo.core.tp.wire`: the pipe messages between rank 0 and
the workers (each step's plain input among them) and the process group's rendezvous. Every rank starts up through
:func:`turbo.core.startup.load_rank`; rank 0's starts the workers when ``EngineConfig.tensor_parallel_size > 1``; at
1 none of this runs. Imports run one way: startup → group → worker → wire (the workers get the start-up function
as an argument, not by import).
"""
