"""The HTTP front's side of the engine process: :class:`MPClient` starts
:func:`~turbo.engine_proc.process.run_engine_process` in a process of its own (``python -m turbo.engine_proc.process``,
so no ``__main__`` guard is needed in the caller's script) and is an :class:`~turbo.engine_proc.client.EngineClient`
over two pyzmq sockets (messages: :mod:`turbo.engine_proc.messages`).

The front renders chat templates and tokenizes prompts with its own copy of the tokenizer, so the engine process
receives token ids. One receiver thread reads the engine's messages: a submission's acknowledgement (its error
raised for the caller: 400 / 404 / 409 / 503 as in one process), each loop turn's outputs (fed to the requests'
:class:`RemoteHandle` queues, then to ``observers`` when a request ends) and call replies. It also watches the
engine process: when it dies (or says a tensor-parallel worker died), every open request ends with
:class:`~turbo.errors.EngineDead` (503 naming the cause), ``running`` turns false (``/health`` answers 503),
``dead`` says why and the ``on_dead`` callbacks run (the server then exits).

A watchdog thread notices an engine process that lives but makes no progress (hung in a step, or stopped), with
requests open or none: with requests open, the engine sends a message at least every second while its loop turns
end (:data:`~turbo.engine_proc.process.TICK_SECONDS`), and whenever nothing came for :attr:`ping_every` seconds the
watchdog sends a ``ping`` call, which the engine's loop thread answers between steps, so an idle engine is heard from
too. When nothing came for ``stall_timeout`` seconds (with a ping unanswered), :attr:`stalled` names the stall
(``/health`` answers 503, so a router or a liveness probe takes the replica out of rotation before any request is
sent to it), :attr:`stalls` counts it, every open request ends with :class:`~turbo.errors.EngineStalled` (503, and a
cancel is sent so the engine frees its blocks if it moves again) and new ones are refused with it at once. The next
message from the engine (the answer to a ping, when it moves again) clears :attr:`stalled`.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lite.formats import LiteturboError

from ..config import GenerationConfig
from ..core import chat_template_ids, encode, load_tokenizer
from ..errors import EngineDead, EngineStalled, InvalidRequest
from ..loop import RequestHandle
from .messages import Ack, Call, Cancel, Chat, Dead, Out, Ready, Reply, Shutdown, Submit, SubmitMany, WireError

log = logging.getLogger("liteturbo.server")
STALL_RETRY_AFTER = 5.0  # seconds a request refused during a stall is told to wait (Retry-After)


class RemoteRequest:
    """What the front knows of a request in the engine process: ``output_ids``, ``logprobs`` (per token, when
    asked), ``stop_ids`` (ids whose text is never shown) and ``cached_tokens`` (prompt tokens read from the prefix
    cache or the session's KV; -1 until its first step's output arrived), as a
    :class:`~turbo.core.request.Request` of this process has them."""

    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.logprobs: list = []
        self.stop_ids: set[int] = set()
        self.cached_tokens = -1


class RemoteHandle(RequestHandle):
    """A :class:`~turbo.loop.RequestHandle` whose request runs in the engine process: iterate it (sync or async)
    for text pieces; ``output`` afterwards; ``cancel()`` asks the engine process to stop it (its KV blocks are
    freed at the engine's next turn)."""

    def __init__(self, client: "MPClient", rid: int) -> None:
        super().__init__(None, RemoteRequest())
        self.client, self.rid = client, rid
        self.ack: concurrent.futures.Future = concurrent.futures.Future()

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the engine process to stop the request (``reason``: its finish reason); no-op once it ended."""
        if not self._ended:
            self.client.send(Cancel(self.rid, reason))

    def feed(self, text: str, ids: list[int], lps: list, end, cached: int = -1) -> None:
        """Receiver thread: a turn's output of this request."""
        if cached >= 0:
            self.request.cached_tokens = cached
        self.request.output_ids.extend(ids)
        self.request.logprobs.extend(lps)
        if text:
            self._push(text)
        if end is not None:
            self._ended = True
            self._push(end)


class MPClient:
    """Starts the engine process for ``model`` (name or folder) with ``engine_options``
    (:class:`~turbo.config.EngineConfig` fields), a session registry with ``registry`` keywords
    (``max_sessions``, ``idle_timeout``, ``session_dir``) and ``max_waiting``; waits until it is loaded (raises
    ``LiteturboError`` with the engine's own message when loading fails). ``stall_timeout``: seconds without
    progress, with requests open, before the engine counts as stalled (module docs). ``close()`` stops it."""

    def __init__(self, model, engine_options: dict | None = None, registry: dict | None = None,
                 max_waiting: int = 256, start_timeout: float = 1800.0, stall_timeout: float = 20.0) -> None:
        if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
            raise LiteturboError(f"stall_timeout must be a positive number of seconds, got {stall_timeout!r}")
        import zmq

        self.zmq = zmq
        self.observers: list = []  # called with each finished request's GenerationOutput (receiver thread)
        self.on_dead: list = []  # called once with the reason when the engine process dies
        self.dead: str | None = None
        self.stall_timeout, self.stalled, self.stalls = float(stall_timeout), None, 0
        self.ping_every = min(1.0, self.stall_timeout / 4)  # seconds of silence before the watchdog asks
        self._progress_at = self._pinged_at = time.monotonic()
        self._ipc = Path(tempfile.mkdtemp(prefix="liteturbo-ipc-"))
        self.ctx = zmq.Context()
        self._to = self.ctx.socket(zmq.PUSH)
        self._to.setsockopt(zmq.SNDHWM, 0)
        self._to.bind(f"ipc://{self._ipc / 'to_engine'}")
        self._from = self.ctx.socket(zmq.PULL)
        self._from.setsockopt(zmq.RCVHWM, 0)
        self._from.bind(f"ipc://{self._ipc / 'to_front'}")
        self._send_lock = threading.Lock()
        self._closing = False
        self._ids = itertools.count(1)
        self._handles: dict[int, RemoteHandle] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        spec = {"model": None if model is None else str(model), "engine_options": dict(engine_options or {}),
                "registry": dict(registry or {}), "max_waiting": max_waiting,
                "to_engine": f"ipc://{self._ipc / 'to_engine'}", "to_front": f"ipc://{self._ipc / 'to_front'}"}
        self.proc = subprocess.Popen([sys.executable, "-m", "turbo.engine_proc.process"], stdin=subprocess.PIPE)
        self.proc.stdin.write(pickle.dumps(spec))
        self.proc.stdin.flush()  # kept open: the engine process leaves when it closes
        try:
            facts = self._wait_ready(start_timeout)
        except BaseException:
            self._stop_process()
            raise
        self.path, self.session_len = Path(facts.path), facts.session_len
        self.backend_name, self.device, self.restored = facts.backend, facts.device, facts.restored
        self.tokenizer = load_tokenizer(self.path)
        self._thread = threading.Thread(target=self._receive, name="liteturbo-engine-receiver", daemon=True)
        self._thread.start()
        self._progress_at = self._pinged_at = time.monotonic()  # loaded and ready: heard from now
        self._watchdog = threading.Thread(target=self._watch, name="liteturbo-engine-watchdog", daemon=True)
        self._watchdog.start()

    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._from.poll(200):
                msg = pickle.loads(self._from.recv())
                if isinstance(msg, Ready):
                    return msg
                raise LiteturboError(msg.message)
            if self.proc.poll() is not None:
                raise LiteturboError(f"the engine process exited while loading (exit code {self.proc.returncode});"
                                     f" see the messages above")
        raise LiteturboError(f"the engine process did not load within {timeout:.0f} s")

    # --- sending -------------------------------------------------------------------------------------------------
    def send(self, msg) -> None:
        """Send one message to the engine process (any thread)."""
        if self.dead is not None:
            return
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._to.send(data)

    def _call(self, method: str, *args, timeout: float = 120.0):
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.stalled is not None:
            raise EngineStalled(self.stalled, retry_after=STALL_RETRY_AFTER)
        cid = next(self._ids)
        fut = self._calls[cid] = concurrent.futures.Future()
        self.send(Call(cid, method, args))
        return fut.result(timeout)

    def _open(self, msg: Submit | Chat, timeout: float = 600.0) -> RemoteHandle:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.stalled is not None:
            raise EngineStalled(self.stalled, retry_after=STALL_RETRY_AFTER)
        h = self._handles[msg.rid] = RemoteHandle(self, msg.rid)
        self.send(msg)
        try:
            stop_ids = h.ack.result(timeout)
        except BaseException:
            self._handles.pop(msg.rid, None)
            raise
        h.request.stop_ids = set(stop_ids)
        return h

    # --- the EngineClient methods -----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the engine process lives and serves (``/health``); else :attr:`exit_reason` says why."""
        return self.exit_reason is None

    @property
    def exit_reason(self) -> str | None:
        """Why the engine does not serve: :attr:`dead`, or its exit before the receiver thread noticed it."""
        rc = self.proc.poll()
        if self.dead is not None or rc is None:
            return self.dead
        return f"the engine process exited (exit code {rc}); the server is shutting down"

    def chat_template_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (raises ``LiteturboError``)."""
        return chat_template_ids(self.tokenizer, messages, self.path)

    def submit(self, prompt: str | list[int], gen: GenerationConfig, priority: int = 0) -> RemoteHandle:
        """Queue a prompt (text, tokenized here, or ids); raises what :meth:`turbo.loop.EngineLoop.submit` raises."""
        if isinstance(prompt, str):
            try:
                prompt = encode(self.tokenizer, prompt)
            except LiteturboError as e:
                raise InvalidRequest(str(e)) from None
        return self._open(Submit(next(self._ids), prompt, gen, priority))

    def submit_many(self, prompt: str | list[int], gens: list[GenerationConfig]) -> list[RemoteHandle]:
        """Queue one prompt once per config, all before the engine's next step (a request's ``n`` choices)."""
        if isinstance(prompt, str):
            try:
                prompt = encode(self.tokenizer, prompt)
            except LiteturboError as e:
                raise InvalidRequest(str(e)) from None
        if self.dead is not None:
            raise EngineDead(self.dead)
        rids = [next(self._ids) for _ in gens]
        handles = [RemoteHandle(self, rid) for rid in rids]
        self._handles.update(zip(rids, handles))
        self.send(SubmitMany(rids, prompt, list(gens), 0))
        try:
            for h in handles:
                h.request.stop_ids = set(h.ack.result(600.0))
        except BaseException:
            for rid, h in zip(rids, handles):
                self._handles.pop(rid, None)
                h.cancel()
            raise
        return handles

    def submit_chat(self, sid: str, message: str | list[dict], gen: GenerationConfig, persist: bool = False,
                    tools: list[dict] | None = None, tool_call_id: str | None = None,
                    keep_partial: bool = False, read: dict | None = None, owner: str | None = None) -> RemoteHandle:
        """Queue session ``sid``'s next turn (see :meth:`~turbo.engine_proc.client.EngineClient.submit_chat`)."""
        return self._open(Chat(next(self._ids), sid, message, gen, persist, tools, tool_call_id, keep_partial, read,
                               owner))

    def session_create(self, system: str | None = None, session_id: str | None = None,
                       defaults: dict | None = None, owner: str | None = None) -> str:
        """See :meth:`~turbo.engine_proc.client.EngineClient.session_create` (a call to the engine process)."""
        return self._call("session_create", system, session_id, defaults, owner)

    def check_session(self, sid: str, owner: str | None = None) -> dict:
        """See :meth:`~turbo.engine_proc.client.EngineClient.check_session` (a call to the engine process)."""
        return self._call("check_session", sid, owner)

    def session_info(self, sid: str, owner: str | None = None) -> dict:
        """See :meth:`~turbo.engine_proc.client.EngineClient.session_info` (a call to the engine process)."""
        return self._call("session_info", sid, owner)

    def session_delete(self, sid: str, owner: str | None = None) -> None:
        """See :meth:`~turbo.engine_proc.client.EngineClient.session_delete` (a call to the engine process)."""
        self._call("session_delete", sid, owner)

    def session_ids(self) -> list[str]:
        """See :meth:`~turbo.engine_proc.client.EngineClient.session_ids` (a call to the engine process)."""
        return self._call("session_ids")

    def num_sessions(self) -> int:
        """See :meth:`~turbo.engine_proc.client.EngineClient.num_sessions` (a call to the engine process)."""
        return self._call("num_sessions")

    def stats(self) -> dict:
        """See :meth:`~turbo.engine_proc.client.EngineClient.stats` (a call to the engine process)."""
        return self._call("stats")

    # --- the receiver thread ---------------------------------------------------------------------------------------
    def _receive(self) -> None:
        zmq = self.zmq
        while self.dead is None and not self._closing:
            if self._from.poll(200):
                while self.dead is None:
                    try:
                        msg = pickle.loads(self._from.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    self._progress_at = time.monotonic()
                    if self.stalled is not None:
                        log.warning("the engine moves again after: %s", self.stalled)
                        self.stalled = None
                    try:
                        self._dispatch(msg)
                    except Exception:  # noqa: BLE001 - one bad message must not stop every request's output
                        log.exception("could not handle a message of the engine process")
            elif self.proc.poll() is not None:
                self._die(self.exit_reason)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Out):
            for rid, text, ids, lps, end, cached in msg.items():
                h = self._handles.get(rid)
                if h is None:
                    continue
                if end is not None:
                    self._handles.pop(rid, None)
                    end = self._end(end)
                h.feed(text, ids, lps, end, cached)
        elif isinstance(msg, Ack):
            h = self._handles.get(msg.rid)
            if h is not None:
                h.ack.set_exception(msg.error.exception()) if msg.error else h.ack.set_result(msg.stop_ids)
        elif isinstance(msg, Reply):
            fut = self._calls.pop(msg.cid, None)
            if fut is not None:
                fut.set_exception(msg.error.exception()) if msg.error else fut.set_result(msg.result)
        elif isinstance(msg, Dead):
            self._die(f"the engine died: {msg.why}; the server is shutting down")

    def _watch(self) -> None:
        """The watchdog thread (module docs): a ping after :attr:`ping_every` seconds of silence (again every
        :attr:`ping_every` seconds while none is answered), a stall after ``stall_timeout``."""
        while self.dead is None and not self._closing:
            time.sleep(min(0.25, self.ping_every / 2))
            now = time.monotonic()
            quiet = now - self._progress_at
            if quiet > self.ping_every and now - self._pinged_at > self.ping_every:
                self._pinged_at = now
                self.send(Call(0, "ping", ()))  # cid 0: no caller waits; any message is the sign of life
            if self.stalled is None and quiet > self.stall_timeout:
                self._stall(quiet)

    def _stall(self, idle: float) -> None:
        """End every open request with :class:`EngineStalled` (cancelled in the engine too) and refuse new ones."""
        n = len(self._handles)
        ended = f"the {n} open request(s) were ended; " if n else ""
        self.stalled = (f"the engine made no progress for {idle:.0f} s with {n} request(s) open "
                        f"(it answered no ping; stall timeout {self.stall_timeout:g} s, --stall-timeout): it is hung "
                        f"or stopped; {ended}retry when /health answers 200")
        self.stalls += 1
        log.error("%s", self.stalled)
        self._end_open(lambda: EngineStalled(self.stalled, retry_after=STALL_RETRY_AFTER), cancel=True)

    def _end_open(self, error, cancel: bool = False) -> None:
        """End every open request and pending call with ``error()`` (a fresh exception each); ``cancel``: tell the
        engine to stop the requests too (it lives)."""
        for rid, h in list(self._handles.items()):
            if self._handles.pop(rid, None) is None:
                continue  # ended meanwhile by the receiver thread
            if cancel:
                self.send(Cancel(rid, "cancelled"))
            if not h.ack.done():
                h.ack.set_exception(error())
            else:
                h.feed("", [], [], error())
        for cid, fut in list(self._calls.items()):
            if self._calls.pop(cid, None) is not None:
                fut.set_exception(error())

    def _end(self, end):
        """A request's end (its output or :class:`WireError`): the exception that ended it, or its output (then given
        to the observers)."""
        if isinstance(end, WireError):
            return end.exception()
        for obs in self.observers:
            try:
                obs(end)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                pass
        return end

    def _die(self, why: str, notify: bool = True) -> None:
        """End everything open with :class:`EngineDead` and tell ``on_dead`` (if ``notify``)."""
        self.dead = why
        self._end_open(lambda: EngineDead(self.dead))
        for fn in self.on_dead if notify else ():
            try:
                fn(self.dead)
            except Exception:  # noqa: BLE001 - every callback runs
                pass

    def cancel_all(self) -> None:
        """Cancel every open request (the server is stopping): each ends with finish reason ``cancelled``."""
        for h in list(self._handles.values()):
            h.cancel()

    # --- stopping ------------------------------------------------------------------------------------------------
    def _stop_process(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            for tell in (lambda: self._to.send(pickle.dumps(Shutdown()), self.zmq.NOBLOCK),  # never blocks
                         self.proc.stdin.close):
                try:
                    with self._send_lock:
                        tell()
                except Exception:  # noqa: BLE001 - a stuck engine process is terminated below
                    pass
        for stop in (None, self.proc.terminate, self.proc.kill):
            if stop is not None and self.proc.poll() is None:
                stop()
            try:
                self.proc.wait(timeout if stop is None else 5)
                break
            except subprocess.TimeoutExpired:
                continue
        self._to.close(linger=0)
        self._from.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._ipc, ignore_errors=True)

    def close(self) -> None:
        """Stop the engine process (its open requests are cancelled; sessions were saved after every turn when a
        session dir is set) and wait for it; idempotent."""
        if self._closing:
            return
        self._closing = True
        self._thread.join(5)  # it stops polling within half a second
        if self.dead is None:
            self._die("the server stopped", notify=False)
        self._stop_process()
