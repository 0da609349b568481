"""A bounded soak of `liteturbo serve` on loopback with faults injected on a schedule; one JSON line of what held.

    python bench/soak.py [--minutes 20] [--clients 32] [--model smollm2-135m-instruct] [--max-kv-tokens 16384]
                         [--serve-args "--session-host-gib 1 ..."] [--json]

The server runs as a user starts it (``liteturbo serve MODEL --session-dir DIR --max-kv-tokens N``, its engine in a
process of its own; ``--max-kv-tokens`` sizes the KV pool, so that at a real model size it can hold only a fraction of
the clients' sessions and they are evicted, tiered and restored under load; ``--serve-args`` adds any other
``liteturbo serve`` flags, both reported in the JSON line). ``--clients`` threads loop until the end, each picking at random: a chat completion, a streamed one, a turn of
its own session (a tool-calling turn, ``tool_choice`` "required", then the tool's result turn, or a plain turn), a
strict ``json_schema`` reply, a stream it drops after two chunks (a client that disconnects), or a hostile body.
Faults, at fixed shares of the run: at 25 % the engine process is stopped (``SIGSTOP``) for 15 s and resumed; at
50 % it is killed (``SIGKILL``): the server exits, and it is started again on the same port and ``--session-dir``.
A 5xx or a connection error counts as ``errors_5xx`` only outside the fault windows (from a fault until the server
answers ``/health`` 200 again, plus 5 s).

Reported, as one JSON line:

- ``requests`` (answered), ``errors_5xx`` (outside the faults), ``fault_errors`` (inside them);
- ``lost_turns``: session turns acknowledged (200 with the reply) that are missing from ``GET /v1/sessions/{id}``
  at the end, after the restart (sessions are saved after every turn);
- ``rss_growth_pct``: the server's resident memory (front and engine process) at the end over its value one
  minute after the restart (warmed up; the restart starts new processes);
- ``leaked_sessions``: sessions left once every client deleted its own (``liteturbo_sessions``);
  ``leaked_kv_blocks``: ``liteturbo_kv_blocks_used`` then (nothing running: every block free or evictable);
- ``hostile_sent``, ``hostile_4xx``: hostile bodies and those answered with a 4xx (anything else is a defect; a
  5xx among them also counts in ``errors_5xx``);
- ``stalls``: the engine's stall count (``liteturbo_engine_stalls``; a 15 s stop stays under the 20 s bound);
- for diagnosis: ``session_turn_seconds_max``, ``slow_turns`` ((start, seconds) after the start of the run of session
  turns that took 30 s or more, the first 20), ``faults`` (their windows, in seconds after the start) and
  ``rss_trace_mib`` ((seconds, front MiB, engine MiB) every 30 s from the RSS baseline to the end).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PET = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
ASKS = ["Write one sentence about the sea.", "Name a color.", "What is 2 + 2?", "Say hello in French.",
        "Give me a word that rhymes with cat.", "What is the capital of Japan?"]
# (what, body or raw bytes, path): each must be answered with a 4xx
HOSTILE = [
    ("wrong type", {"model": "m", "messages": "hi"}, "/v1/chat/completions"),
    ("huge number", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 30},
     "/v1/chat/completions"),
    ("float max_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e308},
     "/v1/chat/completions"),
    ("lone surrogate", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": "\\udfff"}',
     "/v1/chat/completions"),
    ("deep nesting", b'{"model": "m", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", "/v1/chat/completions"),
    ("10 MB string", {"model": "m", "messages": [{"role": "user", "content": "a" * (10 << 20)}]},
     "/v1/chat/completions"),
    ("not JSON", b"{'model': 'm',", "/v1/chat/completions"),
    ("negative n", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": -1}, "/v1/chat/completions"),
    ("temperature text", {"model": "m", "prompt": "x", "temperature": "hot"}, "/v1/completions"),
    ("unknown session", {"content": "hi"}, "/v1/sessions/sess_nope_does_not_exist/chat"),
    ("unknown tool call", {"role": "tool", "tool_call_id": "call_nope", "content": "18"}, "SESSION"),
    ("bad tool schema", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "/v1/chat/completions"),
]


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``liteturbo serve`` in a process group of its own, restartable on the same port and session dir."""

    def __init__(self, model: str, port: int, session_dir: str, extra: list[str], log: Path) -> None:
        self.log = log
        self.cmd = [sys.executable, "-m", "turbo.cli", "serve", model, "--port", str(port), "--log-level", "error",
                    "--session-dir", session_dir, *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> None:
        """Start the server and wait (up to ``timeout`` s) until ``/health`` answers 200; exits the bench if not."""
        with open(self.log, "ab") as log:  # the server's own messages, for what went wrong
            self.proc = subprocess.Popen(self.cmd, start_new_session=True, stdout=log, stderr=log)
        deadline = time.time() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start: {' '.join(self.cmd)}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 within 2 s."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def engine_pid(self) -> int:
        """The pid of the server's engine process."""
        kids = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "turbo.engine_proc.process" in " ".join(p.cmdline())]
        return kids[0].pid

    def rss(self) -> int:
        """Resident bytes of the server's processes (front and engine) together."""
        procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        return sum(p.memory_info().rss for p in procs if p.is_running())

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric in ``/metrics`` (``KeyError`` if absent)."""
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def rss_parts(self) -> tuple[int, int]:
        """Resident MiB of the front process and of its children (the engine process)."""
        front = psutil.Process(self.proc.pid)
        kids = sum(p.memory_info().rss for p in front.children(recursive=True) if p.is_running())
        return front.memory_info().rss >> 20, kids >> 20

    def kill(self) -> None:
        """SIGKILL the server's process group and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


class Soak:
    """The clients' shared tally and the fault windows."""

    def __init__(self, server: Server, deadline: float) -> None:
        self.server, self.deadline = server, deadline
        self.lock = threading.Lock()
        self.faults: list[list[float]] = []  # [start, end] (end: inf while open)
        self.n = dict(requests=0, errors_5xx=0, fault_errors=0, hostile_sent=0, hostile_4xx=0)
        self.bad: list[str] = []  # what the errors outside faults were (first few)
        self.turns: dict[str, list[str]] = {}  # session id -> acknowledged user/tool turn texts, in order
        self.t0 = time.time()
        self.turn_times: list[tuple[float, float]] = []  # (start after t0, seconds) of every session turn

    def in_fault(self, t0: float, t1: float) -> bool:
        """Whether ``[t0, t1]`` (epoch seconds) overlaps a fault window (1 s before a fault to 5 s after recovery)."""
        return any(a - 1 <= t1 and t0 <= b + 5 for a, b in self.faults)

    def count(self, key: str, why: str = "") -> None:
        """Add one to counter ``key``; ``why`` is kept for the first 10 errors outside faults."""
        with self.lock:
            self.n[key] += 1
            if key == "errors_5xx" and len(self.bad) < 10:
                self.bad.append(why)

    def failed(self, t0: float, why: str) -> None:
        """A request begun at ``t0`` failed (5xx or connection error): a fault error or one of ``errors_5xx``."""
        self.count("fault_errors" if self.in_fault(t0, time.time()) else "errors_5xx", why)


def client_loop(soak: Soak, i: int) -> None:
    """One client: random actions until the deadline; its own session, deleted at the end."""
    rng = random.Random(i)
    url = soak.server.url
    http = httpx.Client(base_url=url, timeout=120)
    sid = None
    pending_call = None  # a tool call of the session waiting for its result

    def post(path, body=None, raw=None, stream=False):
        """``(t0, response)`` of a POST (JSON ``body`` or ``raw`` bytes); ``None`` on a connection error. Tallies it."""
        t0 = time.time()
        try:
            if stream:
                return t0, http.stream("POST", path, json=body)
            r = http.post(path, json=body) if raw is None else http.post(
                path, content=raw, headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            soak.failed(t0, f"{path}: {type(e).__name__}")
            time.sleep(0.2)  # a server that is down: do not spin
            return t0, None
        if r.status_code >= 500:
            soak.failed(t0, f"{path}: {r.status_code} {r.text[:120]}")
        elif r.status_code < 400:
            soak.count("requests")
        return t0, r

    while time.time() < soak.deadline:
        kind = rng.choice(["chat", "stream", "session", "session", "schema", "drop", "hostile"])
        ask = rng.choice(ASKS)
        msgs = [{"role": "user", "content": ask}]
        if kind == "chat":
            post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 16})
        elif kind in ("stream", "drop"):
            t0 = time.time()
            try:
                with http.stream("POST", "/v1/chat/completions", json={"model": "m", "messages": msgs,
                                                                       "max_tokens": 24, "stream": True}) as r:
                    if r.status_code >= 500:
                        soak.failed(t0, f"stream: {r.status_code}")
                        continue
                    got = 0
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"error"' in line[:12]:
                            soak.failed(t0, f"stream error event: {line[:120]}")
                        got += line.startswith("data: ")
                        if kind == "drop" and got >= 2:
                            break  # the client goes away mid-stream
                    if r.status_code < 400:
                        soak.count("requests")
            except httpx.HTTPError as e:
                soak.failed(t0, f"stream: {type(e).__name__}")
                time.sleep(0.2)
        elif kind == "schema":
            post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "A pet as JSON."}],
                                          "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
                                              "name": "pet", "schema": PET, "strict": True}}})
        elif kind == "session":
            if sid is None:
                _, r = post("/v1/sessions", {})
                if r is None or r.status_code != 201:
                    continue
                sid = r.json()["id"]
                with soak.lock:
                    soak.turns[sid] = []
            if pending_call is not None:
                body, text = {"role": "tool", "tool_call_id": pending_call, "content": "18 C, clear",
                              "max_tokens": 16}, "18 C, clear"
            elif rng.random() < 0.4:
                body, text = {"content": f"Weather in {rng.choice(['Paris', 'Oslo', 'Lima'])}?", "tools": TOOLS,
                              "tool_choice": "required", "max_tokens": 60}, None
                text = body["content"]
            else:
                body, text = {"content": ask, "max_tokens": 16}, ask
            t_turn = time.time()
            _, r = post(f"/v1/sessions/{sid}/chat", body)
            with soak.lock:
                soak.turn_times.append((round(t_turn - soak.t0, 1), round(time.time() - t_turn, 1)))
            if r is None:
                continue
            if r.status_code == 404:  # lost with a server that was killed before saving it: start another
                sid, pending_call = None, None
                continue
            if r.status_code == 200:
                with soak.lock:
                    soak.turns[sid].append(text)
                calls = r.json().get("tool_calls") or []
                pending_call = calls[0]["id"] if calls and "role" not in body else None
            elif r.status_code == 400 and pending_call is not None:
                pending_call = None
        else:  # hostile
            what, body, path = rng.choice(HOSTILE)
            if path == "SESSION":
                if sid is None:
                    continue
                path = f"/v1/sessions/{sid}/chat"
            t0 = time.time()
            soak.count("hostile_sent")
            _, r = post(path, raw=body if isinstance(body, bytes) else None,
                        body=None if isinstance(body, bytes) else body)
            if r is not None and 400 <= r.status_code < 500:
                soak.count("hostile_4xx")
            elif r is not None and r.status_code < 400:
                soak.count("errors_5xx", f"hostile '{what}' answered {r.status_code}")
            elif (r is None or r.status_code >= 500) and soak.in_fault(t0, time.time()):
                with soak.lock:
                    soak.n["hostile_sent"] -= 1  # sent into a fault: not counted either way
    http.close()


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--stop-seconds", type=float, default=15.0, help="how long the engine is stopped at 25 %%")
    ap.add_argument("--max-kv-tokens", type=int, default=16384, help="the server's KV pool, in tokens")
    ap.add_argument("--serve-args", default="", help="more `liteturbo serve` flags, as one shell-quoted string")
    ap.add_argument("--json", action="store_true", help="the JSON line only")
    args = ap.parse_args()
    if args.minutes <= 0 or args.clients < 1:
        sys.exit("--minutes must be > 0 and --clients >= 1")
    work = Path(tempfile.mkdtemp(prefix="lt-soak-"))
    extra = ["--max-kv-tokens", str(args.max_kv_tokens), *shlex.split(args.serve_args)]
    server = Server(args.model, free_port(), str(work / "sessions"), extra, work / "server.log")
    say = (lambda *a: None) if args.json else (lambda *a: print("[soak]", *a, file=sys.stderr, flush=True))
    say("work folder (server.log, sessions):", work)
    server.start()
    t_start = time.time()
    total = args.minutes * 60
    soak = Soak(server, t_start + total)
    threads = [threading.Thread(target=client_loop, args=(soak, i), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    rss0 = None
    try:
        time.sleep(max(0.0, t_start + 0.25 * total - time.time()))
        say("stopping the engine for", args.stop_seconds, "s")
        soak.faults.append([time.time(), float("inf")])
        pid = server.engine_pid()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(args.stop_seconds)
        os.kill(pid, signal.SIGCONT)
        while not server.healthy():
            time.sleep(0.2)
        soak.faults[-1][1] = time.time()
        time.sleep(max(0.0, t_start + 0.5 * total - time.time()))
        say("killing the engine; restarting the server")
        soak.faults.append([time.time(), float("inf")])
        os.kill(server.engine_pid(), signal.SIGKILL)
        server.proc.wait(60)
        server.start()
        soak.faults[-1][1] = time.time()
        time.sleep(min(60.0, max(0.0, soak.deadline - time.time() - 1)))
        rss0 = server.rss()
        trace = []  # (seconds after t0, front MiB, engine MiB) every 30 s until the clients end
        while any(t.is_alive() for t in threads) and time.time() < soak.deadline + 180:
            if not trace or time.time() - soak.t0 - trace[-1][0] >= 30:
                trace.append((round(time.time() - soak.t0), *server.rss_parts()))
            time.sleep(1.0)
        for t in threads:
            t.join(max(1.0, soak.deadline - time.time() + 180))
        rss1 = server.rss()
        # every acknowledged turn is still in its session (after the restart), then each client's session goes
        lost = 0
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for sid, turns in soak.turns.items():
                r = http.get(f"/v1/sessions/{sid}")
                have = [m.get("content") for m in r.json()["messages"]] if r.status_code == 200 else []
                k = 0
                for text in have:  # the acknowledged turns, in order, among the session's messages
                    if k < len(turns) and text == turns[k]:
                        k += 1
                lost += len(turns) - k
                http.delete(f"/v1/sessions/{sid}")
        time.sleep(1.0)
        row = dict(soak.n, minutes=args.minutes, clients=args.clients, model=args.model,
                   max_kv_tokens=args.max_kv_tokens, serve_args=args.serve_args, lost_turns=lost,
                   acknowledged_turns=sum(len(t) for t in soak.turns.values()),
                   rss_growth_pct=round(100 * (rss1 - rss0) / rss0, 2),
                   leaked_sessions=int(server.metric("liteturbo_sessions")),
                   leaked_kv_blocks=int(server.metric("liteturbo_kv_blocks_used")),
                   stalls=int(server.metric("liteturbo_engine_stalls")), errors_seen=soak.bad,
                   session_turn_seconds_max=max((d for _, d in soak.turn_times), default=0.0),
                   slow_turns=[x for x in soak.turn_times if x[1] >= 30][:20], rss_trace_mib=trace,
                   faults=[[round(a - soak.t0), round(b - soak.t0)] for a, b in soak.faults])
    finally:
        server.kill()
    row["server_log"] = str(work / "server.log")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
