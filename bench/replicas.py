"""Replicas behind `liteturbo route`: session affinity, and a replica SIGKILLed in the middle of a run.

    python bench/replicas.py [MODEL_DIR] [--sessions 16] [--turns 3] [--max-tokens 48] [--threads 1]
                             [--kill-after 20] [--no-kill] [--dtype float32] [--json]

MODEL_DIR defaults to an RTN W4A16 g64 SmolLM2-135M-Instruct made by the script (bench/common.py). Two `liteturbo
serve` processes on free loopback ports share one temporary --session-dir; `liteturbo route` runs in front of them.
The workload: ``--sessions`` concurrent clients, each creating a session through the router and sending
``--turns`` streamed greedy turns (``--max-tokens`` each); every answer names its replica (``x-liteturbo-replica``).

1. reference: the workload with both replicas up.
2. kill: the same workload on new sessions; once ``--kill-after`` turns have ended, the first replica is SIGKILLed
   (its whole process group: server and engine process). A turn broken by the kill (an error event, or an HTTP
   error) is sent again by its client, as a client of `liteturbo route` should.

Printed (one JSON object with --json): per run the turns each replica answered, the sessions whose turns all
landed on one replica (before the kill), in the kill run the turns broken and sent again, the turns answered away
from their session's home replica (failovers, from GET /router/status), how many of the moved sessions' first turns
on the survivor reused the saved KV (cached_tokens > 0), and how many replies equal the reference's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401  (puts the repository on sys.path)
from common import free_port, wait_healthy

from turbo.session_ids import new_session_id
from turbo.sglang_route import ROUTING_KEY_HEADER

TOPICS = ["the sea", "a city", "music", "mountains", "a library", "the moon", "trains", "gardens", "rain",
          "bread", "rivers", "winter", "bees", "bridges", "chess", "clocks"]
MODEL_ID = "replica-model"  # the replicas' --model-name
QUESTIONS = ["Tell me one fact about {}.", "Why does that matter?", "Say it again in five words."]


def _start(args: list[str], threads: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), LITETURBO_THREADS=str(threads))
    return subprocess.Popen([sys.executable, "-m", "turbo.cli", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)


async def _stream(client, path: str, body: dict, headers: dict, replica_header: str, delta) -> dict:
    """One streamed turn: {"text", "replica", "cached", "error"} (error: why the turn broke, else None). ``delta``:
    the text piece of one event (the two endpoints' event shapes differ)."""
    import httpx

    text, cached, error, replica = [], None, None, None
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            replica = r.headers.get(replica_header)
            if r.status_code != 200:
                return {"text": None, "replica": replica, "cached": None,
                        "error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev["error"]["message"] if isinstance(ev["error"], dict) else str(ev["error"])
                    break
                text.append(delta(ev))
                if ev.get("usage"):
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            else:
                if cached is None:
                    error = "the stream ended without its usage"
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"text": "".join(text), "replica": replica, "cached": cached, "error": error}


async def _turn(client, sid: str, content: str, max_tokens: int) -> dict:
    """One streamed turn of the sessions REST API through `liteturbo route --builtin` (see :func:`_stream`)."""
    body = {"content": content, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return await _stream(client, f"/v1/sessions/{sid}/chat", body, {}, "x-liteturbo-replica", lambda ev: ev["delta"])


async def _chat_turn(client, sid: str, system: str, content: str, max_tokens: int) -> dict:
    """One streamed turn through sglang-router: ``/v1/chat/completions`` with the session id as the routing key (the
    header reaches the replica, which continues that session, the first turn opening it); see :func:`_stream`."""
    body = {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    return await _stream(client, "/v1/chat/completions", body, {ROUTING_KEY_HEADER: sid}, "x-liteturbo-server",
                         lambda ev: "".join(ch.get("delta", {}).get("content") or "" for ch in ev.get("choices") or ()))


async def _run(url: str, args, on_turn=None) -> dict:
    """The workload through the router at ``url``: {session index: [turn results]} and the broken turns."""
    import httpx

    done, broken = [0], []
    limits = httpx.Limits(max_connections=args.sessions + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def session(i: int) -> list[dict]:
            """Client ``i``: its session's turns, each sent again until it is answered whole."""
            system = "You are a terse assistant."
            if args.router == "builtin":
                r = await client.post("/v1/sessions", json={"system": system})
                assert r.status_code == 201, r.text
                sid, home = r.json()["id"], r.headers["x-liteturbo-replica"]
            else:
                sid, home = new_session_id(), None  # the first turn opens it on the replica its key goes to
            out = []
            for t in range(args.turns):
                content = QUESTIONS[t % len(QUESTIONS)].format(TOPICS[i % len(TOPICS)])
                for _ in range(50):
                    res = await (_turn(client, sid, content, args.max_tokens) if args.router == "builtin" else
                                 _chat_turn(client, sid, system, content, args.max_tokens))
                    if res["error"] is None:
                        break
                    broken.append({"session": i, "turn": t, "replica": res["replica"], "error": res["error"][:160]})
                    await asyncio.sleep(0.2)  # the router has marked the replica down; send the turn again
                else:
                    raise SystemExit(f"session {i} turn {t} failed 50 times; last: {res['error']}")
                home = home or res["replica"]
                out.append(dict(res, home=home))
                done[0] += 1
                if on_turn is not None:
                    on_turn(done[0])
            return out

        results = await asyncio.gather(*(session(i) for i in range(args.sessions)))
        status = (await client.get("/router/status")).json() if args.router == "builtin" else \
            {"failovers": None, "retries": None}
    return {"sessions": dict(enumerate(results)), "broken": broken, "router": status}


def _summary(run: dict, ref: dict | None, before: dict, killed: str | None, kill_turn: int | None) -> dict:
    """The run's counts; ``before``: the router's counters at its start."""
    per_replica: dict[str, int] = {}
    homes: dict[str, int] = {}
    one = moved = odd = moved_hist = moved_cached = equal = 0
    for i, turns in run["sessions"].items():
        seq, home = [t["replica"] for t in turns], turns[0]["home"]
        homes[home] = homes.get(home, 0) + 1
        for r in seq:
            per_replica[r] = per_replica.get(r, 0) + 1
        changes = [k for k in range(1, len(seq)) if seq[k] != seq[k - 1]]
        c = changes[0] if changes else 0
        if not changes and seq[0] == home:
            one += 1
        elif home == killed and len(changes) <= 1 and all(r == home for r in seq[:c]) and \
                all(r != killed for r in seq[c:]):
            moved += 1  # its turns on its home until the kill, then all on the survivor
            if c > 0:  # it had history: was the KV saved by the dead replica reused?
                moved_hist += 1
                moved_cached += (turns[c]["cached"] or 0) > 0
        else:
            odd += 1
        if ref is not None:
            equal += sum(a["text"] == b["text"] for a, b in zip(turns, ref["sessions"][i]))
    later = [t for turns in run["sessions"].values() for t in turns[1:]]  # turns after a session's first
    out = {"turns": sum(per_replica.values()), "sessions_per_home_replica": homes, "turns_per_replica": per_replica,
           "later_turns_that_reused_the_history": f"{sum((t['cached'] or 0) > 0 for t in later)}/{len(later)}",
           "sessions_on_one_replica": one, "sessions_moved_once_to_the_survivor": moved,
           "sessions_moved_otherwise": odd, "moved_sessions_with_history": moved_hist,
           "of_which_reused_the_saved_kv": moved_cached,
           "turns_broken_and_resent": len(run["broken"]),
           "failovers": None if run["router"]["failovers"] is None else run["router"]["failovers"] - before["failovers"],
           "router_retries": None if run["router"]["retries"] is None else run["router"]["retries"] - before["retries"]}
    if killed is not None:
        out.update(killed=killed, killed_after_turns=kill_turn, broken=run["broken"])
    if ref is not None:
        out["replies_equal_to_reference"] = equal
    return out


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--kill-after", type=int, default=20, help="turns ended before the SIGKILL")
    ap.add_argument("--no-kill", action="store_true", help="run the reference workload twice instead")
    ap.add_argument("--dtype", default="float32",
                    help="the replicas' compute dtype (default float32: in bfloat16, a greedy reply depends on what it "
                         "was batched with in near-ties, which hides what a failover changes; --no-kill shows it)")
    ap.add_argument("--router", choices=["sglang", "builtin"], default="sglang",
                    help="sglang: `liteturbo route` (sglang-router; turns through /v1/chat/completions with session_id "
                         "and the routing-key header); builtin: `liteturbo route --builtin` (the sessions REST API)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from common import w4a16_checkpoint

    model, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.model)
    sdir = tempfile.TemporaryDirectory(prefix="liteturbo-sessions-")
    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    opts = ["--model-name", MODEL_ID, "--session-dir", sdir.name, "--log-level", "warning", "--session-len", "2048", "--max-batch-size", "32",
            "--dtype", args.dtype]
    replicas = [_start(["serve", str(model), "--port", str(p), *opts], args.threads) for p in ports[:2]]
    router, zero = None, {"failovers": 0, "retries": 0}
    try:
        for u, p in zip(urls, replicas):
            wait_healthy(u, p)
        router = _start(["route", "--port", str(ports[2]), "--log-level", "warning", "--health-interval", "0.5",
                         *[x for u in urls for x in ("--replica", u)], *(["--builtin"] if args.router == "builtin" else ["--metrics-port", str(ports[3])])], 1)
        rurl = f"http://127.0.0.1:{ports[2]}"
        wait_healthy(rurl, router)
        if args.router == "sglang":  # its /health answers before it has checked the replicas: wait for both
            import httpx

            deadline = time.time() + 120
            while sum(w["is_healthy"] for w in httpx.get(f"{rurl}/workers", timeout=5).json()["workers"]) < 2:
                if time.time() > deadline or router.poll() is not None:
                    raise SystemExit(f"sglang-router did not take both replicas: {router.stderr.read()[-2000:]}")
                time.sleep(0.5)
        router_pid = router.pid
        t0 = time.perf_counter()
        ref = asyncio.run(_run(rurl, args))
        ref_s = time.perf_counter() - t0
        killed, kill_turn = None, None

        def maybe_kill(n: int) -> None:
            """After ``n`` turns ended: SIGKILL the first replica's process group once ``--kill-after`` is reached."""
            nonlocal killed, kill_turn
            if killed is None and not args.no_kill and n >= args.kill_after:
                killed, kill_turn = urls[0] if args.router == "builtin" else urls[0].split("://")[1], n
                os.killpg(replicas[0].pid, signal.SIGKILL)

        t0 = time.perf_counter()
        run = asyncio.run(_run(rurl, args, maybe_kill))
        run_s = time.perf_counter() - t0
        router_alive = router.poll() is None and router.pid == router_pid  # the same router process throughout
    finally:
        for p in [router, *replicas]:
            if p is not None:
                _kill(p)
        sdir.cleanup()
    out = {"model": str(model), "dtype": args.dtype, "sessions": args.sessions, "turns": args.turns,
           "max_tokens": args.max_tokens,
           "replicas": urls, "reference": dict(_summary(ref, None, zero, None, None), seconds=round(ref_s, 1)),
           "kill" if not args.no_kill else "again": dict(_summary(run, ref, ref["router"], killed, kill_turn),
                                                          seconds=round(run_s, 1)),
           "router": args.router, "router_process_unchanged": router_alive}
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
