"""The engine process of ``liteturbo serve``: the engine core (scheduler, model, KV cache) and the sessions' KV run
here, in a process of their own, so the HTTP front's event loop never competes with a step for one interpreter.

:func:`run_engine_process` is the process's body (``python -m turbo.serve.engine_proc``, started by
:class:`~turbo.serve.mp_client.MPClient`, which writes the pickled start-up spec to its stdin and keeps that pipe
open: the process leaves when it closes, i.e. when the front is gone). It loads
an :class:`~turbo.engine.Engine` and a :class:`~turbo.serve.sessions.SessionRegistry` (restoring a session dir),
drives them with an :class:`~turbo.loop.EngineLoop`, and talks to the front over two pyzmq PUSH/PULL sockets with
pickled tuples (a local, trusted pipe between two processes of one server):

front -> engine
    ``("submit", rid, prompt_ids, gen, priority)``, ``("submit_many", rids, prompt_ids, gens, priority)`` (a
    request's ``n`` choices, queued together), ``("chat", rid, session_id, message, gen, persist, tools,
    tool_call_id, keep_partial)``, ``("cancel", rid, reason)``, ``("call", cid, method, args)`` (sessions and stats), ``("shutdown",)``.
engine -> front
    ``("ready", facts)`` or ``("failed", message)`` once at start; ``("ack", rid, stop_ids, error)`` per
    submission; per loop turn ONE ``("out", [(rid, text, new_ids, new_logprobs, end), ...])`` with every request's
    new text, token ids and logprobs of that turn (``end``: ``None``, ``("output", GenerationOutput)`` or
    ``("error", wire_error)``); ``("reply", cid, result, wire_error)``; ``("dead", why)`` before exiting when the
    engine died (e.g. a tensor-parallel worker was killed).

Submissions and calls run on the loop thread between steps (all that arrived during a step run before the next
one), so none waits for the engine's lock behind a string of steps.
Detokenization stays here (stop strings need it); chat templates are rendered by the front. The process ignores
SIGINT (the front shuts it down).
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback

from .engine_client import error_to_wire, session_facts


class EngineProcess:
    """The engine process's state: sockets, engine, loop, registry and the open requests by front id."""

    def __init__(self, spec: dict) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.connect(spec["to_front"])
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.RCVHWM, 0)
        self.inp.connect(spec["to_engine"])
        self._send_lock = threading.Lock()
        self.handles: dict = {}
        self.batch: list = []  # this turn's outputs (loop thread only)
        self.stop = threading.Event()

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.out.send(data)

    # --- start-up ------------------------------------------------------------------------------------------------
    def load(self, spec: dict) -> None:
        from ..engine import Engine
        from ..loop import EngineLoop
        from .sessions import SessionRegistry

        self.engine = Engine(spec["model"], **spec["engine_options"])
        self.sessions = SessionRegistry(self.engine, **spec["registry"])
        restored = self.sessions.restore() if self.sessions.session_dir is not None else 0
        self.loop = EngineLoop(self.engine, max_waiting=spec.get("max_waiting", 256))
        self.loop.on_turn.append(self.flush)
        self.loop.start()
        e = self.engine
        self.send(("ready", {"path": str(e.path), "session_len": e.session_len, "backend": e.backend.name,
                             "device": str(e.platform.device), "restored": restored, "pid": os.getpid()}))

    # --- the loop thread ---------------------------------------------------------------------------------------------
    def sink(self, handle, item) -> None:
        """A handle's item (text piece, output or error) with the token ids and logprobs it brought."""
        req = handle.request
        n0, n = handle.ids_sent, len(req.output_ids)
        handle.ids_sent = n
        ids, lps = req.output_ids[n0:n], req.logprobs[n0:n]
        if isinstance(item, str):
            self.batch.append((handle.rid, item, ids, lps, None))
            return
        self.handles.pop(handle.rid, None)
        end = ("error", error_to_wire(item)) if isinstance(item, BaseException) else ("output", item)
        self.batch.append((handle.rid, "", ids, lps, end))

    def flush(self) -> None:
        """End of a loop turn: send its outputs as one message; leave when the engine died."""
        if self.batch:
            batch, self.batch = self.batch, []
            self.send(("out", batch))
        dead = getattr(self.engine, "dead", None)
        if dead and not self.stop.is_set():
            self.send(("dead", str(dead)))
            self.stop.set()

    def _start(self, rid: int, submit) -> None:
        try:
            h = submit()
        except Exception as e:  # noqa: BLE001 - the front raises it for the caller (400 / 404 / 409 / 503)
            self.send(("ack", rid, None, error_to_wire(e)))
            return
        h.rid, h.ids_sent = rid, 0
        self.handles[rid] = h
        self.send(("ack", rid, sorted(h.request.stop_ids), None))

    def submit(self, rid: int, ids: list[int], gen, priority: int) -> None:
        self._start(rid, lambda: self.loop.submit(ids, gen, priority, sink=self.sink))

    def submit_many(self, rids: list[int], ids: list[int], gens: list, priority: int) -> None:
        try:
            handles = self.loop.submit_many(ids, gens, priority, sink=self.sink)
        except Exception as e:  # noqa: BLE001 - as _start: each choice's caller gets the error
            for rid in rids:
                self.send(("ack", rid, None, error_to_wire(e)))
            return
        for rid, h in zip(rids, handles):
            h.rid, h.ids_sent = rid, 0
            self.handles[rid] = h
            self.send(("ack", rid, sorted(h.request.stop_ids), None))

    def chat(self, rid: int, sid: str, message: str, gen, persist: bool, tools=None, tool_call_id=None,
             keep_partial=False) -> None:
        def go():
            session = self.sessions.get(sid)
            on_end = (lambda: self.sessions.persist(sid)) if persist else None
            return self.loop.submit_chat(session, message, gen, 0, on_end, sink=self.sink, tools=tools,
                                         tool_call_id=tool_call_id, keep_partial=keep_partial)
        self._start(rid, go)

    # --- calls (on the loop thread, between steps) -------------------------------------------------------------------------------------
    def call(self, cid: int, method: str, args: tuple) -> None:
        try:
            result = getattr(self, "rpc_" + method)(*args)
            self.send(("reply", cid, result, None))
        except Exception as e:  # noqa: BLE001 - raised again in the front
            self.send(("reply", cid, None, error_to_wire(e)))

    def rpc_session_create(self, system, session_id=None, defaults=None):
        return self.sessions.create(system, session_id, defaults)[0]

    def rpc_check_session(self, sid):
        self.sessions.get(sid)
        return self.sessions.defaults(sid)

    def rpc_session_info(self, sid):
        return dict(session_facts(self.sessions.get(sid)), defaults=self.sessions.defaults(sid))

    def rpc_session_delete(self, sid):
        self.sessions.delete(sid)

    def rpc_session_ids(self):
        return [sid for sid, _ in self.sessions.items()]

    def rpc_num_sessions(self):
        return len(self.sessions)

    def rpc_stats(self):
        return self.engine.stats()

    # --- the main thread ---------------------------------------------------------------------------------------------
    def dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        gen = {"submit": 3, "chat": 4, "submit_many": 3}.get(kind)
        if gen is not None:  # compile a constraint here, not on the loop's thread between steps
            gens = msg[gen] if kind == "submit_many" else [msg[gen]]
            try:
                self.engine.prepare_constraint(gens[0] if gens else None)
            except Exception:  # noqa: BLE001 - add_request raises it again, and the caller gets it
                pass
        if kind == "submit":
            self.loop.call_soon(lambda: self.submit(*msg[1:]))
        elif kind == "submit_many":
            self.loop.call_soon(lambda: self.submit_many(*msg[1:]))
        elif kind == "chat":
            self.loop.call_soon(lambda: self.chat(*msg[1:]))
        elif kind == "cancel":
            h = self.handles.get(msg[1])
            if h is not None:
                h.cancel(*msg[2:])
        elif kind == "call":  # between steps too: a thread waiting for the engine's lock could wait many steps
            self.loop.call_soon(lambda: self.call(*msg[1:]))
        elif kind == "shutdown":
            self.stop.set()

    def serve(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        threading.Thread(target=self._watch_front, name="liteturbo-front-watch", daemon=True).start()
        while not self.stop.is_set():
            events = dict(poller.poll(200))
            if self.inp in events:
                while True:
                    try:
                        data = self.inp.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.dispatch(pickle.loads(data))

    def _watch_front(self) -> None:
        sys.stdin.buffer.read()  # returns when the front closed the pipe (or died)
        self.stop.set()

    def close(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        self.out.close(linger=2000)
        self.inp.close(linger=0)
        self.ctx.term()


def run_engine_process(spec: dict) -> None:
    """The engine process's body. ``spec``: ``model``, ``engine_options``
    (:class:`~turbo.config.EngineConfig` fields), ``registry`` (:class:`~turbo.serve.sessions.SessionRegistry`
    keywords), ``max_waiting``, and the two socket addresses ``to_engine`` / ``to_front``. A failed start-up is
    reported as ``("failed", message)`` and the process exits 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group: the front shuts us down
    proc = EngineProcess(spec)
    try:
        proc.load(spec)
    except BaseException as e:  # noqa: BLE001 - the front prints it and exits
        from lite.formats import LiteturboError

        msg = str(e) if isinstance(e, LiteturboError) else "".join(traceback.format_exception(e))
        proc.send(("failed", msg))
        proc.close()
        sys.exit(1)
    try:
        proc.serve()
    finally:
        proc.close()
    # leave without interpreter finalization: the front-watch thread is blocked reading stdin, and finalizing while a
    # daemon thread holds stdin's buffer lock is a fatal error that left this process hanging (after a TP worker died)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_engine_process(pickle.load(sys.stdin.buffer))
