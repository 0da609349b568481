"""The engine loop for servers: one background thread drives ``Engine.step()``; callers submit requests and read
their outputs from per-request queues, from any thread (sync) or any asyncio event loop (async).

The model's forward never runs on the caller's thread or on an event loop, so HTTP I/O stays responsive while a
step computes. Text pieces go out as the step produces them; the last event of a request is its
:class:`~turbo.core.request.GenerationOutput`, or the exception that ended it. A consumer that goes away cancels its
request, which frees its KV blocks at the loop's next turn.

    loop = EngineLoop(engine).start()
    h = loop.submit("The sky is", GenerationConfig(max_new_tokens=16))
    for piece in h: ...               # str pieces; h.output is the GenerationOutput afterwards
    async for piece in loop.submit_chat(session, "Hi", gen): ...
    loop.stop()
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any, Iterator

from lite.formats import LiteturboError

from .config import GenerationConfig
from .core import EngineCore, GenerationOutput, Request
from .errors import InternalError, InvalidRequest, OverCapacity
from .session import Session


@contextlib.contextmanager
def _typed():
    """Request checks raise plain ``LiteturboError``s: they are invalid requests (400); typed ones pass through."""
    try:
        yield
    except LiteturboError as e:
        if type(e) is LiteturboError:
            raise InvalidRequest(str(e)) from None
        raise


class RequestHandle:
    """One submitted request: iterate it (sync or ``async for``) for its text pieces; then ``output`` holds its
    :class:`GenerationOutput`. Iteration re-raises the error that ended the request. ``cancel()`` stops it."""

    def __init__(self, loop: "EngineLoop", req: Request, on_end=None, sink=None) -> None:
        self.loop, self.request = loop, req
        self.sink = sink  # if set: called as sink(handle, item) on the loop thread instead of queueing the item
        self.output: GenerationOutput | None = None
        self.pieces: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._on_end = on_end  # called once on the loop thread with (output or None) when the request ends
        self._ended = False

    # --- producer side (loop thread) ---------------------------------------------------------------------
    def _push(self, item: Any) -> None:
        if self.sink is not None:
            self.sink(self, item)
            return
        self._q.put(item)
        waiter = getattr(self, "_waiter", None)
        if waiter is not None:
            aloop, ev = waiter
            aloop.call_soon_threadsafe(ev.set)

    # --- consumer side -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                item = self._q.get()
                if self._consume(item):
                    return
                yield item
        finally:
            if self.output is None:
                self.cancel()

    async def __aiter__(self):
        aloop = asyncio.get_running_loop()
        ev = asyncio.Event()
        self._waiter = (aloop, ev)
        try:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    ev.clear()
                    if self._q.empty():
                        await ev.wait()
                    continue
                if self._consume(item):
                    return
                yield item
        finally:
            self._waiter = None
            if self.output is None:
                self.cancel()

    def _consume(self, item: Any) -> bool:
        """True at the end; raises the request's error."""
        if isinstance(item, GenerationOutput):
            self.output = item
            return True
        if isinstance(item, BaseException):
            raise item
        self.pieces.append(item)
        return False

    def result(self) -> GenerationOutput:
        """Wait for the end (sync) and return the :class:`GenerationOutput`; raises the request's error."""
        for _ in self:
            pass
        return self.output

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request (idempotent); its blocks are freed at the loop's next turn. ``reason``: its finish reason,
        see :meth:`~turbo.core.engine.EngineCore.cancel`."""
        self.loop._call(lambda: self.loop._cancel(self, reason))


class EngineLoop:
    """Drives one engine (:class:`~turbo.core.engine.EngineCore`) from a background thread. ``max_waiting``: requests queued beyond the running
    batch before :meth:`submit` refuses with :class:`OverCapacity` (503). ``observers``: callables given each
    finished request's :class:`GenerationOutput` on the loop thread (metrics). ``on_turn``: callables run on the loop
    thread after each turn's deliveries (an engine process sends the turn's outputs as one message there)."""

    def __init__(self, engine: EngineCore, max_waiting: int = 256, observers: list | None = None) -> None:
        self.engine = engine
        self.observers = list(observers or [])  # called with each finished request's GenerationOutput
        self.on_turn: list = []  # called after each turn (steps and calls) on the loop thread
        self.max_waiting = max_waiting
        self._handles: dict[int, RequestHandle] = {}
        self._calls: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Start the loop thread (idempotent); returns self."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="liteturbo-engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what runs, stop the thread and wait for it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def cancel_all(self) -> None:
        """Cancel every open request (between steps): each ends with finish reason ``cancelled``."""
        self.call_soon(lambda: [self._cancel(h) for h in list(self._handles.values())])

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # --- submitting ------------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], gen: GenerationConfig | None = None, priority: int = 0,
               sink=None) -> RequestHandle:
        """Queue a raw prompt (text or token ids). Raises ``InvalidRequest`` for a bad prompt or options (checked
        here, on the caller's thread) and ``OverCapacity`` when too many requests wait. ``sink``: see
        :class:`RequestHandle` (the handle's items go there instead of its queue)."""
        self._check_capacity()
        with _typed():
            self.engine.prepare_constraint(gen)  # compiled outside the engine's lock: steps go on meanwhile
        with self.engine.lock, _typed():
            req = self.engine.add_request(prompt, gen or GenerationConfig(), priority=priority)
            return self._register(RequestHandle(self, req, sink=sink))

    def submit_many(self, prompt: str | list[int], gens: list[GenerationConfig], priority: int = 0,
                    sink=None) -> list[RequestHandle]:
        """Queue one prompt once per config in ``gens`` (a request's ``n`` choices), all before the next step, so they
        are batched the same way every time; raises as :meth:`submit` (then none is queued)."""
        self._check_capacity()
        handles: list[RequestHandle] = []
        with _typed():
            self.engine.prepare_constraint(gens[0] if gens else None)  # outside the lock, as in submit
        with self.engine.lock, _typed():
            try:
                for gen in gens:
                    req = self.engine.add_request(prompt, gen, priority=priority)
                    handles.append(self._register(RequestHandle(self, req, sink=sink)))
            except BaseException:
                for h in handles:
                    h.cancel()
                raise
            return handles

    def submit_chat(self, session: Session, message: str | list[dict], gen: GenerationConfig | None = None,
                    priority: int = 0, on_end=None, sink=None, tools: list[dict] | None = None,
                    tool_call_id: str | None = None, keep_partial: bool = False,
                    read: dict | None = None) -> RequestHandle:
        """Queue the next turn of ``session``; its history is updated when the turn ends (also when cancelled or
        failed, as :meth:`Session.end_turn` does), then ``on_end()`` runs on the loop thread (e.g. saving the
        session). Raises ``Conflict`` while the session generates. ``sink``: as for :meth:`submit`. ``tools``,
        ``tool_call_id``, ``keep_partial``: see :meth:`Session.chat`; ``read``: see :meth:`Session.begin_turn`."""
        if not (isinstance(message, str) and message.strip()) and not (isinstance(message, list) and message):
            raise InvalidRequest("the message must be a non-empty str (or a non-empty list of messages)")
        self._check_capacity()
        with _typed():
            req, messages = session.begin_turn(message, gen or GenerationConfig(), priority, tools, tool_call_id,
                                               keep_partial, read)
        handle = RequestHandle(self, req, sink=sink)

        def end(out):
            """On the loop thread when the turn ends (``out``: its output, or ``None``): record it, then ``on_end``."""
            session.end_turn(req, messages, out, handle.pieces_sent)
            if on_end is not None:
                on_end()

        handle._on_end = end
        with self.engine.lock:
            return self._register(handle)

    def _check_capacity(self) -> None:
        if self.engine.num_waiting >= self.max_waiting:
            raise OverCapacity(f"{self.engine.num_waiting} requests are waiting (max_waiting="
                               f"{self.max_waiting}); retry shortly", retry_after=1.0)
        if not self.running:
            raise InternalError("the engine loop is not running (start() it)")

    def _register(self, handle: RequestHandle) -> RequestHandle:
        handle.pieces_sent = []
        self._handles[handle.request.seq.seq_id] = handle
        self._wake.set()
        return handle

    def call_soon(self, fn) -> None:
        """Run ``fn()`` on the loop thread between steps, holding the engine's lock (the calls queued during a step
        all run before the next one). An exception it raises is its own business: catch it inside ``fn``."""
        self._calls.put(fn)
        self._wake.set()

    _call = call_soon

    # --- the loop thread -------------------------------------------------------------------------------------
    def _cancel(self, handle: RequestHandle, reason: str = "cancelled") -> None:
        req = handle.request
        if not req.finished:
            self.engine.cancel(req, reason)
        self._deliver(handle)

    def _deliver(self, handle: RequestHandle) -> None:
        """Push new text, and the end when the request finished."""
        req = handle.request
        text = req.take_text()
        if text:
            handle.pieces_sent.append(text)
            handle._push(text)
        if req.finished and not handle._ended:
            handle._ended = True
            self._handles.pop(req.seq.seq_id, None)
            out = self.engine.output(req)
            for obs in self.observers:
                try:
                    obs(out)
                except Exception:  # noqa: BLE001 - metrics must not break serving
                    pass
            if handle._on_end is not None:
                try:
                    handle._on_end(out)
                except BaseException as e:  # noqa: BLE001 - the consumer must still hear about the end
                    req.error = req.error or e
            handle._push(req.error if req.error is not None else out)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            while True:
                try:
                    fn = self._calls.get_nowait()
                except queue.Empty:
                    break
                with eng.lock:
                    fn()
            if not eng.has_unfinished():
                self._turn_done()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with eng.lock:
                try:
                    eng.step()
                except Exception:  # noqa: BLE001 - the engine finished the step's requests with the error
                    pass
                for h in list(self._handles.values()):
                    self._deliver(h)
            self._turn_done()
        with eng.lock:  # stopping: cancel what is left so that no blocks stay allocated
            for h in list(self._handles.values()):
                self._cancel(h)
        self._turn_done()

    def _turn_done(self) -> None:
        for fn in self.on_turn:
            fn()
