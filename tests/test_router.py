"""Replicas behind the session-affine router (turbo/router.py) and the shared session dir of the registry.

- the choice: rendezvous hashing (order-free, balanced, a removed replica's keys only move), least loaded, health;
- the registry over a shared dir (two engines in this process): a session one registry saved is loaded by the other
  on first use, a held one that the other continued is reloaded, one the other deleted is forgotten; client-chosen
  ids (400 malformed, 409 taken); the turns equal one engine's uninterrupted session;
- end to end: two `liteturbo serve` processes of a tiny random Llama on one session dir, the router in this process.
  Sessions stick to their replica (``x-liteturbo-replica``), stateless requests spread, one replica is SIGKILLed in
  the middle of two turns: the streamed one ends with an error event, the other is sent again by the router; the
  next turns go to the survivor and every reply equals an in-process engine running the same turns without a kill.
  A client that goes away (streaming or not) stops the replica's generation.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.errors import Conflict, InvalidRequest, NotFound
from turbo.router import Router, create_router_app, rendezvous, replica_url
from turbo.engine_proc.sessions import SessionRegistry
from turbo.session_ids import new_session_id, session_id_problem

from conftest import free_port, serve_in_thread, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
TURNS = ["the of and", "to in a", "is that for", "it with was"]
LONG = 1900  # tokens of the turns in flight at the kill (0.6-3 ms each here, of a session_len of 2048)


# --- the choice ------------------------------------------------------------------------------------------------------

def test_rendezvous_is_order_free_balanced_and_moves_only_the_removed_replicas_keys():
    reps = ["http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1"]
    keys = [f"sess-{i:024x}" for i in range(3000)]
    owner = {k: rendezvous(k, reps) for k in keys}
    assert all(rendezvous(k, reversed(reps)) == owner[k] for k in keys[:200])
    counts = collections.Counter(owner.values())
    assert all(0.29 < counts[r] / len(keys) < 0.38 for r in reps), counts  # 1/3 each, +-5 binomial sd
    left = reps[:2]
    moved = [k for k in keys if rendezvous(k, left) != owner[k]]
    assert {owner[k] for k in moved} == {reps[2]} and len(moved) == counts[reps[2]]
    split = collections.Counter(rendezvous(k, left) for k in moved)
    assert all(0.4 < split[r] / len(moved) < 0.6 for r in left), split
    assert rendezvous("x", []) is None


def test_router_picks_owner_least_loaded_and_tracks_health():
    r = Router(["127.0.0.1:9001", "http://127.0.0.1:9002/"])
    a, b = r.replicas.values()
    assert (a.url, b.url) == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    assert r.least_loaded() is None and r.new_id() is None  # nothing is up before a health poll
    a.healthy = b.healthy = True
    a.inflight, b.inflight = 2, 1
    assert r.least_loaded() is b and r.least_loaded([b]) is a
    a.inflight, a.requests, b.requests = 1, 5, 3
    assert r.least_loaded() is b  # same load: the one that served fewer
    sid = r.new_id()
    assert session_id_problem(sid) is None and r.home(sid) is b and r.owner(sid) is b
    assert r.owner(sid, [b]) is a  # its owner when b is out
    r.set_health(a, False, "timeout")
    assert a.healthy  # a slow poll or two is not enough
    r.set_health(a, False, "timeout")
    r.set_health(a, False, "timeout")
    assert not a.healthy and r.owner(sid) is b and all(r.owner(new_session_id()) is b for _ in range(20))
    r.set_health(a, True)
    assert a.healthy and a.fails == 0
    r.set_health(b, False, "refused", hard=True)
    assert not b.healthy and r.owner(sid) is a
    for bad in ["nope:x", "http://h", "ftp://h:1", "http://h:1/v1"]:
        with pytest.raises(Exception, match="not a server address"):
            replica_url(bad)
    with pytest.raises(Exception, match="different --replica"):
        Router(["h:1", "http://h:1"])


def test_route_command_refuses_a_bad_replica_address():
    from turbo.cli import main

    r = CliRunner().invoke(main, ["route", "--replica", "localhost"])
    assert r.exit_code != 0 and "not a server address" in r.output
    r = CliRunner().invoke(main, ["route", "--replica", "http://127.0.0.1:23334/v1"])  # an OpenAI base URL
    assert r.exit_code != 0 and "without the path" in r.output


def test_router_checks_keys_and_answers_503_when_no_replica_is_up():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    app = create_router_app([dead], api_keys="sk-a,sk-b", health_interval=0.2)
    url, stop = serve_in_thread(app)
    try:
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "unavailable", "replicas": 1,
                                                                   "healthy": 0}
        r = httpx.get(f"{url}/v1/models", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/router/status", timeout=30).status_code == 401
        r = httpx.post(f"{url}/v1/sessions", json={}, headers={"Authorization": "Bearer sk-b"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "no replica can take this request" in r.json()["error"]["message"] and "ConnectError" in r.text
    finally:
        stop()


# --- the registry over a shared session dir --------------------------------------------------------------------------

G = GenerationConfig(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (sharp logits) with a word tokenizer and a chat template."""
    from tiny_models import build_tiny_llama, save_word_tokenizer

    path = build_tiny_llama(tmp_path_factory.mktemp("router") / "tiny", initializer_range=0.2,
                            max_position_embeddings=2048)
    save_word_tokenizer(path, 128, bos=True)  # the variant with a chat template
    return path


def _engine(path):
    return Engine(path, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=4, session_len=512))


def test_shared_dir_loads_reloads_and_forgets_sessions_as_other_replicas_left_them(tiny, tmp_path):
    ref = _engine(tiny).session("sys")
    want = [ref.chat(m, gen=G) for m in TURNS]
    a, b = (SessionRegistry(_engine(tiny), session_dir=tmp_path) for _ in range(2))
    sid = new_session_id()
    _, sa = a.create("sys", session_id=sid, defaults={"temperature": 0.0, "stop": ["x"]})
    with pytest.raises(Conflict, match="exists already"):
        b.create(None, session_id=sid)  # saved at creation: the other replica sees it
    with pytest.raises(InvalidRequest, match="24 lowercase hex"):
        a.create(None, session_id="sess-../../etc")
    with pytest.raises(NotFound):
        b.get("../" + tmp_path.name)  # a malformed id never reaches the file system
    assert b.defaults(sid) == {"temperature": 0.0, "stop": ["x"]}
    got = [sa.chat(TURNS[0], gen=G)]
    a.persist(sid)
    sb = b.get(sid)  # never restored: loaded on first use, with its KV
    got.append(sb.chat(TURNS[1], gen=G))
    assert sb.last.cached_tokens > 0
    b.persist(sid)
    assert a._sessions[sid] is sa and len(sa.messages) == 3  # a still holds the one-turn copy...
    sa2 = a.get(sid)  # ...until it is used: the saved copy is newer, so it is loaded in its place
    assert sa2 is not sa and sa.closed and sa2.messages == sb.messages
    got.append(sa2.chat(TURNS[2], gen=G))
    a.persist(sid)
    assert a.get(sid) is sa2  # its own save is not "newer"
    got.append(b.get(sid).chat(TURNS[3], gen=G))
    assert got == want and b.get(sid).last.token_ids == ref.last.token_ids
    b.persist(sid)
    b.delete(sid)
    with pytest.raises(NotFound):
        a.get(sid)  # deleted through the other replica: forgotten here too
    assert sa2.closed and not (tmp_path / sid).exists() and b.defaults(sid) == {}


def test_a_session_saved_longer_ago_than_the_idle_timeout_is_not_loaded(tiny, tmp_path):
    a = SessionRegistry(_engine(tiny), session_dir=tmp_path)
    sid, _ = a.create("sys")
    b = SessionRegistry(_engine(tiny), session_dir=tmp_path, idle_timeout=3600)
    assert b.get(sid).system == "sys"
    old = time.time() - 7200
    os.utime(tmp_path / sid / "session.json", (old, old))
    c = SessionRegistry(_engine(tiny), session_dir=tmp_path, idle_timeout=3600)
    with pytest.raises(NotFound):
        c.get(sid)


# --- end to end: two replica processes, the router, a SIGKILL --------------------------------------------------------

@pytest.fixture(scope="module")
def replicas(tiny, tmp_path_factory):
    """Two `liteturbo serve` processes (own process groups) on one session dir: ``[(url, Popen), ...]``."""
    sdir = tmp_path_factory.mktemp("shared-sessions")
    env = dict(os.environ, OMP_NUM_THREADS="1", LITETURBO_THREADS="1")
    procs = []
    for _ in range(2):
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "turbo.cli", "serve", str(tiny), "--port", str(port),
                              "--dtype", "float32", "--session-dir", str(sdir), "--log-level", "warning"],
                             cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        procs.append((f"http://127.0.0.1:{port}", p))
    try:
        for url, p in procs:
            wait_healthy(url, p)
        yield procs
    finally:
        for _, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in {url}/metrics")


def _wait(cond, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _turn(http, sid, content, n=8, stream=False):
    """One turn through the router: (reply, replica)."""
    body = {"content": content, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = http.post(f"/v1/sessions/{sid}/chat", json=body)
        assert r.status_code == 200, r.text
        return r.json()["content"], r.headers["x-liteturbo-replica"]
    with http.stream("POST", f"/v1/sessions/{sid}/chat", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        return "".join(e["delta"] for e in events), r.headers["x-liteturbo-replica"]


def _parallel(fns):
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _reference(tiny, turns: list[list[tuple[str, int]]]) -> list[list[str]]:
    """Each session's greedy replies from one in-process engine, session after session, no HTTP, no kill."""
    engine = Engine(tiny, EngineConfig(dtype="float32"))
    out = []
    for session_turns in turns:
        s = engine.session("sys")
        out.append([s.chat(m, gen=GenerationConfig(max_new_tokens=n, ignore_eos=True)) for m, n in session_turns])
        s.close()
    return out


@pytest.mark.e2e
def test_sessions_stick_fail_over_on_a_kill_and_answer_as_without_it(tiny, replicas):
    urls = [u for u, _ in replicas]
    app = create_router_app(urls, api_keys="", health_interval=0.2)
    rurl, stop = serve_in_thread(app)
    try:
        with httpx.Client(base_url=rurl, timeout=120) as http:
            made = [http.post("/v1/sessions", json={"system": "sys"}) for _ in range(4)]
            assert all(m.status_code == 201 for m in made), made[0].text  # 502: the replica ignores a given "id"
            sids = [m.json()["id"] for m in made]
            assert [m.headers["x-liteturbo-replica"] for m in made] == [rendezvous(s, urls) for s in sids]
            a_url = rendezvous(sids[0], urls)
            b_url = next(u for u in urls if u != a_url)
            a_sids = [s for s in sids if rendezvous(s, urls) == a_url]
            assert len(a_sids) == 2  # new sessions go to the least loaded replica: two each
            first = _parallel([lambda s=s, i=i: _turn(http, s, TURNS[0], stream=i % 2 == 0) for i, s in enumerate(sids)])
            assert [r for _, r in first] == [rendezvous(s, urls) for s in sids]
            comp = _parallel([lambda: http.post("/v1/completions", json={"prompt": "the of", "max_tokens": 8,
                                                                         "temperature": 0}) for _ in range(4)])
            assert {c.headers["x-liteturbo-replica"] for c in comp} == set(urls)  # stateless: spread
            ref_text = _engine(tiny).generate("the of", GenerationConfig(max_new_tokens=8)).text
            assert all(c.json()["choices"][0]["text"] == ref_text for c in comp)

            # a2's long turn (not streamed) and a1's streamed turn run on replica A when it is SIGKILLed
            a1, a2 = a_sids
            pending = {}
            t = threading.Thread(target=lambda: pending.update(r=_turn(http, a2, TURNS[1], n=LONG)))
            body = {"content": TURNS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
            with http.stream("POST", f"/v1/sessions/{a1}/chat", json=body) as r:
                lines = r.iter_lines()
                assert next(x for x in lines if x.startswith("data: {"))
                t.start()
                assert _wait(lambda: _metric(a_url, "liteturbo_requests_running") == 2, 20)
                os.killpg(dict(replicas)[a_url].pid, signal.SIGKILL)
                rest = [x for x in lines if x.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "replica_failed"
            t.join(120)
            assert pending["r"][1] == b_url  # sent again by the router, to the survivor
            replies = {s: [c] for s, (c, _) in zip(sids, first)}
            replies[a2].append(pending["r"][0])
            again = _turn(http, a1, TURNS[1])  # the client sends the broken turn again
            assert again[1] == b_url
            replies[a1].append(again[0])
            b_sids = [s for s in sids if s not in a_sids]
            for s, (c, rep) in zip(b_sids, _parallel([lambda s=s: _turn(http, s, TURNS[1]) for s in b_sids])):
                assert rep == b_url
                replies[s].append(c)
            third = _parallel([lambda s=s: _turn(http, s, TURNS[2], stream=True) for s in sids])
            assert {rep for _, rep in third} == {b_url}
            for s, (c, _) in zip(sids, third):
                replies[s].append(c)
            plan = [[(TURNS[0], 8), (TURNS[1], LONG if s == a2 else 8), (TURNS[2], 8)] for s in sids]
            assert [replies[s] for s in sids] == _reference(tiny, plan)
            st = http.get("/router/status").json()
            assert st["failovers"] == 4 and st["retries"] == 1, st  # a1: turns 2, 3; a2: turns 2 (retried), 3
            assert [x["healthy"] for x in st["replicas"]] == [u != a_url for u in urls]
            _disconnects_stop_the_replica(http, b_url)
            assert http.delete(f"/v1/sessions/{a1}").status_code == 200
            assert http.get(f"/v1/sessions/{a1}").status_code == 404
            assert http.get("/health").json() == {"status": "ok", "replicas": 2, "healthy": 1}
    finally:
        stop()


def _disconnects_stop_the_replica(http, url):
    """A stream closed after three events, and a plain request whose client closes its socket while the replica
    generates, each asking for 2000 tokens: the replica cancels them (it runs nothing 1 s later, and generated
    fewer tokens)."""
    body = {"prompt": "the of", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    cancelled = 'liteturbo_requests_finished_total{reason="cancelled"}'

    def settled(before):
        assert _wait(lambda: _metric(url, "liteturbo_requests_running") == 0, 1.0)
        assert _metric(url, cancelled) == before[0] + 1
        assert 0 < _metric(url, "liteturbo_generated_tokens_total") - before[1] < 2000

    def counters():
        try:
            return _metric(url, cancelled), _metric(url, "liteturbo_generated_tokens_total")
        except AssertionError:  # no cancelled request yet: the labelled counter is not there
            return 0.0, _metric(url, "liteturbo_generated_tokens_total")

    before = counters()
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = (x for x in r.iter_lines() if x.startswith("data: {"))
        for _ in range(3):
            next(events)
    settled(before)
    before = counters()
    raw = json.dumps(body).encode()
    host, port = http.base_url.host, http.base_url.port
    with socket.create_connection((host, port)) as sock:  # a raw client, to hang up at a chosen moment
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        assert _wait(lambda: _metric(url, "liteturbo_requests_running") == 1, 20)
    settled(before)


def test_liteturbo_route_launches_sglang_router_with_session_affinity_flags():
    """`liteturbo route` (turbo/sglang_route.py): sglang-router's manual policy keyed by x-smg-routing-key, the
    replicas' /health polled (a stalled engine answers 503 there), its metrics on their own port."""
    from turbo.sglang_route import router_command

    cmd = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], port=9, health_interval=0.5, timeout=30,
                         log_level="warning", metrics_port=7)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    args = " ".join(cmd[3:])
    for flag in ("--port 9", "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2", "--policy manual",
                 "--assignment-mode min_load", "--health-check-endpoint /health", "--health-check-interval-secs 1",
                 "--request-timeout-secs 30", "--log-level warn", "--prometheus-port 7"):
        assert flag in args, flag
    with pytest.raises(ValueError, match="--replica"):
        router_command([])


def test_liteturbo_route_refuses_ports_it_cannot_listen_on_naming_the_flag():
    from turbo.sglang_route import check_ports

    with pytest.raises(ValueError, match="--port and --metrics-port are both 5"):
        check_ports("127.0.0.1", 5, 5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--metrics-port {busy}: cannot listen"):
            check_ports("127.0.0.1", 0, busy)
