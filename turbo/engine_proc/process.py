"""The engine process of ``liteturbo serve``: the engine core (scheduler, model, KV cache) and the sessions' KV run
here, in a process of their own, so the HTTP front's event loop never competes with a step for one interpreter.

:func:`run_engine_process` is the process's body (``python -m turbo.engine_proc.process``, started by
:class:`~turbo.engine_proc.mp_client.MPClient`, which writes the pickled start-up spec to its stdin and keeps that
pipe open: the process leaves when it closes, i.e. when the front is gone). It loads an
:class:`~turbo.engine.Engine` and a :class:`~turbo.engine_proc.sessions.SessionRegistry` (restoring a session dir),
drives them with an :class:`~turbo.loop.EngineLoop`, and talks to the front over two pyzmq PUSH/PULL sockets with
the pickled dataclasses of :mod:`turbo.engine_proc.messages` (requests, cancellations and calls in; per loop turn
ONE :class:`~turbo.engine_proc.messages.Out` with every request's new text, token ids and logprobs out).

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
import time
import traceback

from .client import session_facts
from .messages import Ack, Call, Cancel, Chat, Dead, Failed, Out, Ready, Reply, Shutdown, Submit, SubmitMany, WireError

TICK_SECONDS = 1.0  # with requests open, an (empty) Out at least this often while turns end


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
        self.batch = Out()  # this turn's outputs (loop thread only)
        self.sent_at = time.monotonic()  # when a message last went to the front
        self.stop = threading.Event()

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.out.send(data)
        self.sent_at = time.monotonic()

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
        self.send(Ready(str(e.path), e.session_len, e.backend.name, str(e.platform.device), restored, os.getpid()))

    # --- the loop thread ---------------------------------------------------------------------------------------------
    def sink(self, handle, item) -> None:
        """A handle's item (text piece, output or error) with the token ids and logprobs it brought."""
        req = handle.request
        n0, n = handle.ids_sent, len(req.output_ids)
        handle.ids_sent = n
        ids, lps, cached = req.output_ids[n0:n], req.logprobs[n0:n], req.cached_tokens
        if isinstance(item, str):
            self.batch.add(handle.rid, item, ids, lps, cached=cached)
            return
        self.handles.pop(handle.rid, None)
        self.batch.add(handle.rid, "", ids, lps, WireError.of(item) if isinstance(item, BaseException) else item,
                       cached)

    def flush(self) -> None:
        """End of a loop turn: send its outputs as one message (with requests open and nothing to send, an empty one
        at most every second: the front's stall watchdog sees that turns still end, e.g. in a long chunked
        prefill); leave when the engine died."""
        if self.batch:
            batch, self.batch = self.batch, Out()
            self.send(batch)
        elif self.handles and time.monotonic() - self.sent_at > TICK_SECONDS:
            self.send(Out())
        dead = getattr(self.engine, "dead", None)
        if dead and not self.stop.is_set():
            self.send(Dead(str(dead)))
            self.stop.set()

    def _opened(self, rid: int, h) -> None:
        h.rid, h.ids_sent = rid, 0
        self.handles[rid] = h
        self.send(Ack(rid, sorted(h.request.stop_ids)))

    def _start(self, rid: int, submit) -> None:
        try:
            h = submit()
        except Exception as e:  # noqa: BLE001 - the front raises it for the caller (400 / 404 / 409 / 503)
            self.send(Ack(rid, error=WireError.of(e)))
            return
        self._opened(rid, h)

    def submit(self, m: Submit) -> None:
        self._start(m.rid, lambda: self.loop.submit(m.prompt_ids, m.gen, m.priority, sink=self.sink))

    def submit_many(self, m: SubmitMany) -> None:
        try:
            handles = self.loop.submit_many(m.prompt_ids, m.gens, m.priority, sink=self.sink)
        except Exception as e:  # noqa: BLE001 - as _start: each choice's caller gets the error
            for rid in m.rids:
                self.send(Ack(rid, error=WireError.of(e)))
            return
        for rid, h in zip(m.rids, handles):
            self._opened(rid, h)

    def chat(self, m: Chat) -> None:
        def go():
            session = self.sessions.get(m.session_id, m.owner)
            on_end = (lambda: self.sessions.persist(m.session_id)) if m.persist else None
            return self.loop.submit_chat(session, m.message, m.gen, 0, on_end, sink=self.sink, tools=m.tools,
                                         tool_call_id=m.tool_call_id, keep_partial=m.keep_partial, read=m.read)
        self._start(m.rid, go)

    # --- calls (on the loop thread, between steps) -------------------------------------------------------------------
    def call(self, m: Call) -> None:
        try:
            result = getattr(self, "rpc_" + m.method)(*m.args)
            self.send(Reply(m.cid, result))
        except Exception as e:  # noqa: BLE001 - raised again in the front
            self.send(Reply(m.cid, error=WireError.of(e)))

    def rpc_session_create(self, system, session_id=None, defaults=None, owner=None):
        return self.sessions.create(system, session_id, defaults, owner)[0]

    def rpc_check_session(self, sid, owner=None):
        self.sessions.get(sid, owner)
        return self.sessions.defaults(sid)

    def rpc_session_info(self, sid, owner=None):
        return dict(session_facts(self.sessions.get(sid, owner)), defaults=self.sessions.defaults(sid))

    def rpc_session_delete(self, sid, owner=None):
        self.sessions.delete(sid, owner)

    def rpc_session_ids(self):
        return [sid for sid, _ in self.sessions.items()]

    def rpc_num_sessions(self):
        return len(self.sessions)

    def rpc_stats(self):
        return self.engine.stats()

    def rpc_ping(self):
        """The front's watchdog asks whether the loop thread still turns (its answer is the sign of life)."""
        return None

    # --- the main thread ---------------------------------------------------------------------------------------------
    def dispatch(self, msg) -> None:
        if isinstance(msg, (Submit, Chat, SubmitMany)):
            # compile a constraint here, not on the loop's thread between steps
            gen = msg.gen if not isinstance(msg, SubmitMany) else (msg.gens[0] if msg.gens else None)
            try:
                self.engine.prepare_constraint(gen)
            except Exception:  # noqa: BLE001 - add_request raises it again, and the caller gets it
                pass
        if isinstance(msg, Submit):
            self.loop.call_soon(lambda: self.submit(msg))
        elif isinstance(msg, SubmitMany):
            self.loop.call_soon(lambda: self.submit_many(msg))
        elif isinstance(msg, Chat):
            self.loop.call_soon(lambda: self.chat(msg))
        elif isinstance(msg, Cancel):
            h = self.handles.get(msg.rid)
            if h is not None:
                h.cancel(msg.reason)
        elif isinstance(msg, Call):  # between steps too: a thread waiting for the engine's lock could wait many steps
            self.loop.call_soon(lambda: self.call(msg))
        elif isinstance(msg, Shutdown):
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
    (:class:`~turbo.config.EngineConfig` fields), ``registry`` (:class:`~turbo.engine_proc.sessions.SessionRegistry`
    keywords), ``max_waiting``, and the two socket addresses ``to_engine`` / ``to_front``. A failed start-up is
    reported as :class:`~turbo.engine_proc.messages.Failed` and the process exits 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group: the front shuts us down
    proc = EngineProcess(spec)
    try:
        proc.load(spec)
    except BaseException as e:  # noqa: BLE001 - the front prints it and exits
        from lite.formats import LiteturboError

        msg = str(e) if isinstance(e, LiteturboError) else "".join(traceback.format_exception(e))
        proc.send(Failed(msg))
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
