"""Tensor parallelism of the engine: one model split over N ranks, one process and one device each.

:mod:`~turbo.core.tp.shard`: which part of every weight a rank holds, which splits are refused (before loading),
and the vocabulary-parallel embedding and logits. :mod:`~turbo.core.tp.group`: rank 0's side (the engine's own
process): the spawned workers, the process group, :class:`~turbo.core.tp.group.ParallelRunner` and fault handling.
:mod:`~turbo.core.tp.worker`: the workers' main. Start-up (:mod:`turbo.core.startup`) builds them when
``EngineConfig.tensor_parallel_size > 1``; at 1 none of this runs.
"""
