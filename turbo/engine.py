"""The engine users hold: :class:`Engine` is the :class:`~turbo.core.engine.EngineCore` (add_request / step / cancel /
output over a persistent batch and a paged KV cache) with the convenience APIs built on it: ``generate`` (a batch of
prompts run together), ``stream`` and ``astream`` (text pieces, then the output), ``loop`` (the background
:class:`~turbo.loop.EngineLoop` for servers), ``session`` and ``load_session`` (stateful chats, :mod:`turbo.session`).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

from lite.formats import LiteturboError

from .config import GenerationConfig, generation_config
from .core import EngineCore, GenerationOutput, Request, StepInput
from .loop import EngineLoop
from .session import Session, load_session

__all__ = ["Engine", "GenerationOutput", "Request", "Session", "StepInput"]


class Engine(EngineCore):
    """Load a model (name, or 16/32-bit or W4A16 checkpoint folder) and generate with it.

    >>> engine = Engine("smollm2-135m-instruct")
    >>> s = engine.session()
    >>> s.chat("What is the capital of France?")

    Raises ``LiteturboError`` for a bad model path, unsupported architecture or bad options.
    """

    def __init__(self, model: str | Path | None = None, config=None, **kwargs) -> None:
        super().__init__(model, config, **kwargs)
        self._loop: EngineLoop | None = None  # the EngineLoop of astream / servers, made on first use

    def generate(self, prompts, gen: GenerationConfig | None = None, priority: int = 0, **kwargs):
        """Generate completions. ``prompts``: one prompt (text or token ids) → one :class:`GenerationOutput`;
        a list of prompts → a list, all run together in the persistent batch."""
        gen = generation_config(gen, kwargs)
        if isinstance(prompts, (list, tuple)) and len(prompts) == 0:
            return []  # no prompts, no outputs (an empty prompt inside the list is an error)
        if not isinstance(prompts, (str, list, tuple)):
            raise LiteturboError(f"prompts must be a str, a list of token ids, or a list of those; got "
                                 f"{type(prompts).__name__}")
        single = isinstance(prompts, str) or isinstance(prompts[0], int)
        batch = [prompts] if single else list(prompts)
        reqs = []
        try:
            for p in batch:
                reqs.append(self.add_request(p, gen, priority=priority))
            while any(not r.finished for r in reqs):
                self.step()
                time.sleep(0)  # let other threads waiting on the engine lock in between steps
        finally:
            for r in reqs:
                self.cancel(r)
        for r in reqs:
            if r.error is not None:
                raise r.error
        outs = [self.output(r) for r in reqs]
        return outs[0] if single else outs

    def stream(self, prompt: str | list[int], gen: GenerationConfig | None = None,
               **kwargs) -> Iterator[str | GenerationOutput]:
        """Yield text pieces, then the :class:`GenerationOutput` as the last item."""
        req = self.add_request(prompt, generation_config(gen, kwargs))
        yield from self.drive(req)

    async def astream(self, prompt: str | list[int], gen: GenerationConfig | None = None, **kwargs):
        """Async version of :meth:`stream`: text pieces, then the :class:`GenerationOutput`.

        The request runs on the engine's :class:`~turbo.loop.EngineLoop` (:attr:`loop`, started at the first
        call): the model's forward never runs on the event loop, and several ``astream`` calls share the persistent
        batch. Submitting (which may wait for a step) happens off the event loop too. Leaving the stream early
        cancels the request."""
        gen = generation_config(gen, kwargs)
        handle = await asyncio.to_thread(self.loop.submit, prompt, gen)
        async for piece in handle:
            yield piece
        yield handle.output

    @property
    def loop(self) -> EngineLoop:
        """The :class:`~turbo.loop.EngineLoop` that drives this engine from a background thread for
        :meth:`astream` and servers (made and started on first use; ``engine.loop.stop()`` ends it)."""
        with self.lock:
            if self._loop is None:
                self._loop = EngineLoop(self)
            if not self._loop.running:
                self._loop.start()
            return self._loop

    def session(self, system: str | None = None) -> Session:
        """A new stateful chat session (its KV cache survives between turns while memory allows)."""
        return Session(self, system)

    def load_session(self, path: str | Path) -> Session:
        """Restore a session written by :meth:`Session.save` (see :func:`turbo.session.load_session`)."""
        return load_session(self, path)
