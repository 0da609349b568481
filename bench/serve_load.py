"""Serving load: concurrent streaming clients against `liteturbo serve`, and the same workload in-process.

    python bench/serve_load.py [MODEL_DIR] [--clients 64] [--sessions 16] [--turns 3] [--max-tokens 64]
                               [--threads 2] [--json]

MODEL_DIR defaults to an RTN W4A16 g64 SmolLM2 made by the script (as bench/decode.py). The workload: ``--clients``
concurrent streaming clients; ``--sessions`` of them hold a multi-turn session (``--turns`` turns each through
``POST /v1/sessions/{id}/chat``), the others send one-shot ``/v1/chat/completions`` requests; greedy,
``--max-tokens`` new tokens per reply (EOS ignored, so every run produces the same number of tokens).

1. served: `liteturbo serve` in a subprocess on a free loopback port (``--threads`` torch threads), clients with
   httpx in this process; sessions are deleted by their clients at the end, so afterwards ``/metrics`` must show
   no KV block in use.
2. in-process: the same requests through :class:`turbo.loop.EngineLoop` in this process (no HTTP), same engine
   options, same concurrency (submitted from a pool of 40 threads, as the server's).

Time to first token is counted, in both modes, from when a request is issued (served: the HTTP request is sent;
in-process: before its chat template is rendered and it is submitted, which waits for the engine's lock) to its
first text piece. ``engine_ttft_mean_s``: the engine's own count (from ``add_request`` to the first token; served:
``/metrics``). Printed: requests done / errors, p50 and p99 time to first token, p50 inter-token latency, output
tokens/s, and served / in-process throughput and TTFT p50 (``served_vs_inprocess_throughput``,
``served_vs_inprocess_ttft_p50`` in ``--json``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import common  # noqa: F401  (puts the repository on sys.path)
from common import free_port, wait_healthy


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a city", "music", "mountains", "a library", "the moon", "trains", "gardens"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (#{i})." for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _metric(text: str, name: str) -> float:
    """A sample of the Prometheus text ``text`` (0 when absent)."""
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " ")), 0.0)


def _summary(name: str, records: list[dict], wall: float, errors: int) -> dict:
    ttft = [r["ttft"] for r in records]
    itl = [r["itl"] for r in records if r["itl"] is not None]
    toks = sum(r["tokens"] for r in records)
    eng = [r["engine_ttft"] for r in records if "engine_ttft" in r]
    return {"mode": name, "requests": len(records), "errors": errors, "output_tokens": toks, "wall_s": wall,
            "tokens_per_s": toks / wall, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(itl, 0.5), "engine_ttft_mean_s": sum(eng) / len(eng) if eng else None}


async def _served_run(url: str, args) -> tuple[list[dict], int]:
    import httpx

    records, errors = [], 0
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async def stream(client, path, payload):
        nonlocal errors
        t0 = time.perf_counter()
        times, n = [], 0
        async with client.stream("POST", path, json=payload) as r:
            if r.status_code != 200:
                errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    errors += 1
                    return
                text = ev.get("delta") if "delta" in ev and isinstance(ev.get("delta"), str) else (
                    (ev.get("choices") or [{}])[0].get("delta", {}).get("content"))
                if text:
                    times.append(time.perf_counter())
                usage = ev.get("usage")
                if usage:
                    n = usage["completion_tokens"]
        if not times:
            errors += 1
            return
        itl = (times[-1] - times[0]) / (n - 1) if n > 1 else None
        records.append({"ttft": times[0] - t0, "itl": itl, "tokens": n})

    model_id = None

    async def one_shot(client, prompt):
        await stream(client, "/v1/chat/completions", dict(body, model=model_id,
                                                          messages=[{"role": "user", "content": prompt}],
                                                          stream_options={"include_usage": True}))

    async def session(client, prompt):
        nonlocal errors
        r = await client.post("/v1/sessions", json={})
        if r.status_code != 201 and r.status_code != 200:
            errors += 1
            return
        sid = r.json()["id"]
        for t in range(args.turns):
            await stream(client, f"/v1/sessions/{sid}/chat", dict(body, content=f"{prompt} (turn {t})"))
        if (await client.delete(f"/v1/sessions/{sid}")).status_code >= 400:
            errors += 1

    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model_id = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = _prompts(args.clients)
        tasks = [session(client, p) if i < args.sessions else one_shot(client, p) for i, p in enumerate(prompts)]
        await asyncio.gather(*tasks)
    return records, errors


async def _inprocess_run(loop, args) -> tuple[list[dict], int]:
    from turbo import GenerationConfig

    engine = loop.engine
    records, errors = [], 0
    gen = GenerationConfig(max_new_tokens=args.max_tokens, ignore_eos=True)

    async def consume(t0, handle):  # t0: when the request was issued (before tokenizing and submitting), as served
        times = []
        async for piece in handle:
            if piece:
                times.append(time.perf_counter())
        n = len(handle.output.token_ids)
        records.append({"ttft": times[0] - t0, "itl": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
                        "tokens": n, "engine_ttft": handle.output.ttft})

    # submitting waits for the engine lock (a step may be running): off the event loop, as the server does it
    async def one_shot(prompt):
        t0 = time.perf_counter()
        ids = await asyncio.to_thread(engine.chat_template_ids, [{"role": "user", "content": prompt}])
        await consume(t0, await asyncio.to_thread(loop.submit, ids, gen))

    async def session(prompt):
        s = await asyncio.to_thread(engine.session)
        for t in range(args.turns):
            t0 = time.perf_counter()
            await consume(t0, await asyncio.to_thread(loop.submit_chat, s, f"{prompt} (turn {t})", gen))
        await asyncio.to_thread(s.close)

    # submitting waits for the engine lock in a worker thread: as many threads as the server's pool (anyio's 40)
    import concurrent.futures

    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(40))
    prompts = _prompts(args.clients)
    await asyncio.gather(*[session(p) if i < args.sessions else one_shot(p) for i, p in enumerate(prompts)])
    return records, errors


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from common import w4a16_checkpoint

    model, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.model)
    engine_opts = ["--max-batch-size", "64", "--session-len", "2048", "--kv-cache-gib", "1"]
    results = []

    # 1. served, in a subprocess
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen([sys.executable, "-m", "turbo.cli", "serve", str(model), "--port", str(port),
                             "--log-level", "warning", *engine_opts], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        wait_healthy(url, proc, 300)
        asyncio.run(_served_run(url, argparse.Namespace(**dict(vars(args), clients=4, sessions=1, turns=1))))  # warm
        before = httpx.get(f"{url}/metrics", timeout=30).text
        t = time.perf_counter()
        records, errors = asyncio.run(_served_run(url, args))
        results.append(_summary("served", records, time.perf_counter() - t, errors))
        time.sleep(0.5)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        hist = [_metric(m, f"liteturbo_time_to_first_token_seconds_{k}") for m in (metrics, before)
                for k in ("sum", "count")]
        results[-1]["engine_ttft_mean_s"] = (hist[0] - hist[2]) / (hist[1] - hist[3]) if hist[1] > hist[3] else None
        used = [float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("liteturbo_kv_blocks_used ")]
        results[-1]["kv_blocks_used_after"] = used[0] if used else None
    finally:
        proc.terminate()
        proc.wait(30)

    # 2. in-process, same workload and options
    torch.set_num_threads(args.threads)
    from turbo import Engine, EngineConfig
    from turbo.loop import EngineLoop

    engine = Engine(model, EngineConfig(max_batch_size=64, session_len=2048, kv_cache_gib=1.0))
    loop = EngineLoop(engine).start()
    try:
        asyncio.run(_inprocess_run(loop, argparse.Namespace(**dict(vars(args), clients=4, sessions=1, turns=1))))
        t = time.perf_counter()
        records, errors = asyncio.run(_inprocess_run(loop, args))
        results.append(_summary("in-process", records, time.perf_counter() - t, errors))
    finally:
        loop.stop()
    ratio = results[0]["tokens_per_s"] / results[1]["tokens_per_s"]
    ttft = results[0]["ttft_p50_s"] / results[1]["ttft_p50_s"]
    out = {"model": str(model), "clients": args.clients, "sessions": args.sessions, "turns": args.turns,
           "max_tokens": args.max_tokens, "threads": args.threads, "results": results,
           "served_vs_inprocess_throughput": ratio, "served_vs_inprocess_ttft_p50": ttft}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.clients} streaming clients ({args.sessions} sessions x {args.turns} turns, the rest one-shot), "
          f"{args.max_tokens} tokens per reply, {args.threads} threads")
    print(f"{'mode':>11} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'tok/s':>8}")
    for r in results:
        print(f"{r['mode']:>11} {r['requests']:>8} {r['errors']:>6} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s "
              f"{r['itl_p50_s'] * 1e3:>6.0f}ms {r['tokens_per_s']:>8.1f}")
    print(f"served / in-process throughput: {ratio:.2f}x; TTFT p50 {ttft:.2f}x; KV blocks in use after the served run: "
          f"{results[0].get('kv_blocks_used_after'):.0f}")


if __name__ == "__main__":
    main()
