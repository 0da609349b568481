"""The engine floor: step data, scheduler, block manager, runner, model, sampler, detokenizer, inputs, memory
accounting, start-up and :class:`~turbo.core.engine.EngineCore`. Imports nothing of turbo above it but
:mod:`turbo.config` and :mod:`turbo.errors`."""
