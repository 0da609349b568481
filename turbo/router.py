"""liteturbo's own session-affine proxy in front of several ``liteturbo serve`` replicas (``liteturbo route
--builtin``; plain ``liteturbo route`` launches sglang-router, :mod:`turbo.sglang_route`). It is kept for the one
part sglang-router cannot do: route liteturbo's sessions REST API (``/v1/sessions...``), which is not among the
routes sglang-router forwards.

``create_router_app(replicas)`` builds a FastAPI app that forwards every request to one replica with httpx;
``route(replicas, host, port, ...)`` runs it under uvicorn. How a request's replica is chosen:

- a session's requests (``/v1/sessions/{id}...``, ``/v1/chat/completions`` with ``session_id``) go to its owner:
  :func:`rendezvous` (highest-random-weight) hashing of the session id over the healthy replicas, so every turn of
  a session lands on the replica that holds its KV cache, and when a replica is down only its own sessions move;
- ``POST /v1/sessions`` gets an id chosen here (:func:`~turbo.session_ids.new_session_id`, or the client's
  ``id``) and goes to that id's owner;
- everything else (``/v1/chat/completions`` without ``session_id``, ``/v1/completions``, ``/v1/models``, the web
  page) goes to the least loaded healthy replica: fewest requests in flight through this router.

Every replica's ``/health`` is polled (``health_interval`` seconds); one that refuses connections, or fails three
polls in a row, is down until a poll succeeds. A request whose replica cannot be reached, or breaks before it
answered, is sent again to the next choice (for a session: the owner among the replicas left, which loads it from
the session dir all replicas share). Answers (server-sent events included) are passed on chunk by chunk as they
arrive, with the header ``x-liteturbo-replica`` naming the replica; a stream whose replica dies ends with one
``data: {"error": ...}`` event and ``data: [DONE]``. A client that goes away closes its upstream request, so the
replica cancels it and frees its KV blocks. ``GET /health`` (no key) answers 503 when no replica is up;
``GET /router/status`` lists the replicas, their load and the counters.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable, Iterable
from urllib.parse import urlsplit

import click
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from lite.cli import friendly_errors
from lite.formats import LiteturboError

from .http_errors import APIError
from .session_ids import new_session_id

REPLICA_HEADER = "x-liteturbo-replica"
API_KEYS_ENV = "LITETURBO_API_KEYS"
# hop-by-hop headers and those httpx / the ASGI server set themselves: never copied between the two connections
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})
_DOWN_AFTER = 3  # failed health polls in a row (timeouts, 5xx) before a replica that still accepts connections is down


# --- choosing a replica ----------------------------------------------------------------------------------------------

def _weight(replica: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}\n{key}".encode(), digest_size=8).digest(), "big")


def rendezvous(key: str, replicas: Iterable[str]) -> str | None:
    """The replica (from ``replicas``, any order) with the highest hash of (replica, ``key``); ``None`` when there is
    none. Removing a replica moves only the keys it had; each replica gets ~1/n of the keys."""
    return max(replicas, key=lambda r: (_weight(r, key), r), default=None)


def replica_url(url: str) -> str:
    """``url`` as ``scheme://host:port`` (a bare ``host:port`` means ``http://``). Raises ``LiteturboError``."""
    u = urlsplit(url.strip() if "://" in url else "http://" + url.strip())
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None or u.path not in ("", "/") \
            or u.query or u.fragment:
        hint = " without the path (the router adds /v1 itself)" if u.path not in ("", "/") else ""
        raise LiteturboError(f"--replica {url!r} is not a server address; give http://HOST:PORT of a `liteturbo "
                             f"serve`{hint} (e.g. http://127.0.0.1:23334)")
    return f"{u.scheme}://{u.netloc}"


@dataclass
class Replica:
    """One ``liteturbo serve`` behind the router: whether it is up, its requests in flight and served (through this
    router), its failed health polls in a row and the last error."""

    url: str
    healthy: bool = False
    inflight: int = 0
    requests: int = 0
    fails: int = 0
    error: str | None = None

    def status(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "inflight": self.inflight, "requests": self.requests,
                "error": self.error}


class Router:
    """The replicas, how to pick one, and the httpx client that talks to them (made when the app starts).

    ``failovers`` counts session requests answered by a replica other than the session's home (its owner when all
    replicas are up); ``retries`` counts requests sent again after their replica failed."""

    def __init__(self, urls: Iterable[str], api_keys: Iterable[str] = (), health_interval: float = 1.0,
                 health_timeout: float = 10.0, timeout: float = 600.0, max_request_bytes: int = 16 << 20) -> None:
        reps = [replica_url(u) for u in urls]
        if not reps or len(set(reps)) != len(reps):
            raise LiteturboError(f"give one or more different --replica addresses, got {list(urls)!r}")
        if not (health_interval > 0 and health_timeout > 0 and timeout > 0):
            raise LiteturboError("health_interval, health_timeout and timeout must be > 0 seconds")
        self.replicas = {u: Replica(u) for u in reps}
        self.keys = [k.encode() for k in api_keys if k]
        self.health_interval, self.health_timeout, self.timeout = health_interval, health_timeout, timeout
        self.max_request_bytes = max_request_bytes
        self.failovers = self.retries = 0
        self.client: httpx.AsyncClient | None = None

    def healthy(self, exclude: Iterable[Replica] = ()) -> list[Replica]:
        skip = {r.url for r in exclude}
        return [r for r in self.replicas.values() if r.healthy and r.url not in skip]

    def home(self, sid: str) -> Replica:
        """Where session ``sid`` lives while every replica is up."""
        return self.replicas[rendezvous(sid, self.replicas)]

    def owner(self, sid: str, exclude: Iterable[Replica] = ()) -> Replica | None:
        """Where session ``sid`` goes now: rendezvous over the healthy replicas not in ``exclude``."""
        up = {r.url: r for r in self.healthy(exclude)}
        return up.get(rendezvous(sid, up))

    def least_loaded(self, exclude: Iterable[Replica] = ()) -> Replica | None:
        """The healthy replica with the fewest requests in flight (then the fewest served)."""
        return min(self.healthy(exclude), key=lambda r: (r.inflight, r.requests), default=None)

    def new_id(self, exclude: Iterable[Replica] = ()) -> str | None:
        """A new session id whose home is the least loaded healthy replica (drawn until it is: ~n draws for n
        replicas), so that new sessions spread by load and stay put when every replica is up; ``None`` when no
        replica is up."""
        target = self.least_loaded(exclude)
        if target is None:
            return None
        for _ in range(64 * len(self.replicas)):
            sid = new_session_id()
            if self.home(sid) is target:
                return sid
        return sid  # (unreachable in practice: a miss has probability (1 - 1/n)^(64 n) < 1e-27)

    def set_health(self, rep: Replica, ok: bool, why: str | None = None, hard: bool = False) -> None:
        """Record a health poll or a failed request (``hard``: down at once, e.g. the connection was refused)."""
        was = rep.healthy
        rep.fails = 0 if ok else rep.fails + 1
        rep.error = why
        rep.healthy = ok or (was and not hard and rep.fails < _DOWN_AFTER)
        if rep.healthy != was:
            state = "up" if rep.healthy else f"down ({why}); its sessions go to the other replicas"
            print(f"[liteturbo] replica {rep.url} is {state}", file=sys.stderr, flush=True)

    async def poll(self, rep: Replica) -> None:
        """One ``GET /health`` of ``rep``."""
        try:
            r = await self.client.get(f"{rep.url}/health", timeout=self.health_timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            return self.set_health(rep, False, f"{type(e).__name__}: {e}", hard=True)
        except httpx.HTTPError as e:
            return self.set_health(rep, False, f"{type(e).__name__}: {e}")
        self.set_health(rep, r.status_code == 200, None if r.status_code == 200 else
                        f"/health answered {r.status_code}")

    async def watch(self) -> None:
        """Poll every replica's health forever (the app's background task)."""
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self.poll(r) for r in self.replicas.values()))

    def status(self) -> dict:
        return {"replicas": [r.status() for r in self.replicas.values()], "failovers": self.failovers,
                "retries": self.retries}


def router_of(request: Request) -> Router:
    return request.app.state.router


# --- forwarding ------------------------------------------------------------------------------------------------------

class _ClientGone(Exception):
    """The client disconnected before the replica answered."""


async def _send(request: Request, r: Router, rep: Replica, body: bytes) -> httpx.Response:
    """Send ``request`` (with ``body``) to ``rep`` and return its response once its headers arrive, the body unread.
    Raises ``_ClientGone`` (the upstream request is closed, so the replica cancels it) or httpx's errors."""
    url = rep.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
    task = asyncio.ensure_future(r.client.send(r.client.build_request(request.method, url, headers=headers,
                                                                      content=body), stream=True))
    rep.inflight += 1
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone()
    except BaseException:
        rep.inflight -= 1
        if not task.done():
            task.cancel()  # closes the connection: the replica sees its client go and cancels the request
        elif not task.cancelled() and task.exception() is None:
            await task.result().aclose()
        raise


class Proxied(StreamingResponse):
    """A replica's answer passed on chunk by chunk, with :data:`REPLICA_HEADER`; closing it (also when the client
    goes away) closes the upstream response."""

    def __init__(self, up: httpx.Response, rep: Replica, router: Router) -> None:
        headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
        headers[REPLICA_HEADER] = rep.url
        super().__init__(self._chunks(), status_code=up.status_code, headers=headers)
        self.up, self.rep, self.router, self.closed = up, rep, router, False
        self.sse = up.headers.get("content-type", "").startswith("text/event-stream")

    async def _chunks(self):
        tail = b"\n\n"
        try:
            async for chunk in self.up.aiter_raw():
                if chunk:
                    tail = chunk[-2:]
                    yield chunk
        except httpx.TransportError as e:
            stalled = isinstance(e, httpx.TimeoutException)  # silent for `timeout` seconds, not (yet) dead
            if not stalled:
                self.router.set_health(self.rep, False, f"it broke an answer off: {type(e).__name__}: {e}", hard=True)
            if not self.sse:
                raise
            why = (f"sent nothing for {self.router.timeout:.0f} s" if stalled else
                   f"stopped in the middle of this answer ({type(e).__name__}); it did not save this turn")
            err = APIError(502 if not stalled else 504, f"the replica {self.rep.url} {why}: send the request again",
                           code="replica_failed")
            yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + \
                f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.rep.inflight -= 1
            await self.up.aclose()

    async def read_all(self) -> bytes:
        """The whole answer (instead of passing it on); closes the upstream response."""
        try:
            return await self.up.aread()
        finally:
            await self.close()


Pick = Callable[[list[Replica]], "tuple[Replica | None, bytes]"]


async def forward(request: Request, pick: Pick, sid: str | None = None) -> Response:
    """Send ``request`` to ``pick(tried)``'s replica with its body, again to the next pick while replicas fail
    before answering. ``sid``: the session the request belongs to (counts failovers)."""
    r = router_of(request)
    tried: list[Replica] = []
    while True:
        rep, body = pick(tried)
        if rep is None:
            down = "; ".join(f"{x.url}: {x.error or 'not up yet'}" for x in r.replicas.values() if not x.healthy)
            return APIError(503, f"no replica can take this request now ({down or 'every replica failed on it'}); "
                                 f"retry shortly", headers={"Retry-After": "1"}).response()
        try:
            up = await _send(request, r, rep, body)
        except _ClientGone:
            return Response(status_code=499)
        except (httpx.ReadTimeout, httpx.WriteTimeout) as e:  # it may still be working on it: not sent twice
            return APIError(504, f"the replica {rep.url} did not answer in time ({type(e).__name__}); retry").response()
        except httpx.TransportError as e:  # refused, reset or closed before answering: the next choice gets it
            r.set_health(rep, False, f"{type(e).__name__}: {e}", hard=not isinstance(e, httpx.PoolTimeout))
            tried.append(rep)
            r.retries += 1
            continue
        rep.requests += 1
        if sid is not None and rep is not r.home(sid):
            r.failovers += 1
        return Proxied(up, rep, r)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 beyond ``limit`` bytes."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise APIError(413, f"the request body is larger than the router's limit of {limit} bytes",
                           code="request_too_large")
    return bytes(buf)


def _auth(request: Request) -> dict:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def check_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` with one of the router's keys (if any)."""
    keys = router_of(request).keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip().encode()
    if not (scheme.lower() == "bearer" and sum(hmac.compare_digest(token, k) for k in keys) > 0):
        raise APIError(401, "no valid API key; send the header 'Authorization: Bearer <key>' with one of the "
                            "router's --api-keys", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# --- routes ----------------------------------------------------------------------------------------------------------

async def health(request: Request):
    r = router_of(request)
    up = len(r.healthy())
    body = {"status": "ok" if up else "unavailable", "replicas": len(r.replicas), "healthy": up}
    return JSONResponse(body, status_code=200 if up else 503)


async def status(request: Request):
    check_key(request)
    return router_of(request).status()


async def create_session(request: Request):
    """``POST /v1/sessions``: the id is chosen here (or the client's ``id`` is kept), then its owner creates it."""
    check_key(request)
    r = router_of(request)
    raw = await read_body(request, r.max_request_bytes)
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        data = None
    if not isinstance(data, dict) or ("id" in data and not isinstance(data["id"], str)):
        return await forward(request, lambda tried: (r.least_loaded(tried), raw))  # the replica answers the 400
    chosen, sent = data.get("id"), []

    def pick(tried):
        # the client's id goes to its owner; else an id is drawn whose owner is the least loaded replica (a new one
        # after a failure: the failed replica may have made the last one)
        sent.append(chosen if chosen is not None else r.new_id(tried))
        return r.owner(sent[-1], tried) if sent[-1] else None, json.dumps({**data, "id": sent[-1]}).encode()

    resp = await forward(request, pick, sid=chosen)
    if not isinstance(resp, Proxied) or resp.status_code != 201:
        return resp
    body = await resp.read_all()
    got = json.loads(body).get("id")
    if got != sent[-1]:  # a replica that ignores "id": the session would not be found at its hash's owner
        await r.client.delete(f"{resp.rep.url}/v1/sessions/{got}", headers=_auth(request))
        return APIError(502, f"the replica {resp.rep.url} made session {got!r} instead of the id {sent[-1]!r} the "
                             f"router chose: it does not take a client-chosen id; run a liteturbo serve whose POST "
                             f"/v1/sessions reads 'id'").response()
    return Response(body, status_code=201, headers=resp.headers)


async def session_request(request: Request):
    """Anything under ``/v1/sessions/{sid}``: to the session's owner."""
    check_key(request)
    r, sid = router_of(request), request.path_params["sid"]
    raw = await read_body(request, r.max_request_bytes)
    return await forward(request, lambda tried: (r.owner(sid, tried), raw), sid=sid)


async def chat_completions(request: Request):
    """``POST /v1/chat/completions``: with ``session_id`` to the session's owner, else to the least loaded."""
    check_key(request)
    r = router_of(request)
    raw = await read_body(request, r.max_request_bytes)
    try:
        sid = json.loads(raw).get("session_id")
    except (ValueError, AttributeError):
        sid = None
    if isinstance(sid, str):
        return await forward(request, lambda tried: (r.owner(sid, tried), raw), sid=sid)
    return await forward(request, lambda tried: (r.least_loaded(tried), raw))


async def stateless(request: Request):
    """Every other path (``/v1/completions``, ``/v1/models``, the web page, ...): to the least loaded replica."""
    if request.url.path.startswith("/v1"):
        check_key(request)
    r = router_of(request)
    raw = await read_body(request, r.max_request_bytes)
    return await forward(request, lambda tried: (r.least_loaded(tried), raw))


# --- the app ---------------------------------------------------------------------------------------------------------

@asynccontextmanager
async def _lifespan(app: FastAPI):
    r: Router = app.state.router
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    timeout = httpx.Timeout(r.timeout, connect=min(5.0, r.timeout))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        r.client = client
        await asyncio.gather(*(r.poll(x) for x in r.replicas.values()))
        watcher = asyncio.create_task(r.watch())
        try:
            yield
        finally:
            watcher.cancel()


async def _api_error(request: Request, e: APIError):
    return e.response()


def create_router_app(replicas: Iterable[str], api_keys: str | Iterable[str] | None = None, **options) -> FastAPI:
    """The router's FastAPI app in front of ``replicas`` (``http://host:port`` of ``liteturbo serve`` servers that
    share one ``--session-dir``). api_keys: Bearer tokens every ``/v1`` request must carry (a list or one
    comma-separated string; ``None`` reads ``LITETURBO_API_KEYS``; empty: none); the ``Authorization`` header is
    passed on to the replicas as it came. options: :class:`Router`'s (``health_interval``, ``health_timeout``,
    ``timeout`` in seconds, ``max_request_bytes``). Raises ``LiteturboError`` for a bad address or option."""
    if api_keys is None:
        api_keys = os.environ.get(API_KEYS_ENV, "")
    if isinstance(api_keys, str):
        api_keys = api_keys.split(",")
    app = FastAPI(title="liteturbo router", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = Router(replicas, [k.strip() for k in api_keys if k.strip()], **options)
    app.add_exception_handler(APIError, _api_error)
    every = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/router/status", status, methods=["GET"])
    app.add_api_route("/v1/sessions", create_session, methods=["POST"])
    app.add_api_route("/v1/sessions/{sid}", session_request, methods=every)
    app.add_api_route("/v1/sessions/{sid}/{rest:path}", session_request, methods=every)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/{path:path}", stateless, methods=every)
    return app


def route(replicas: Iterable[str], host: str = "127.0.0.1", port: int = 23333, api_keys: str | None = None,
          log_level: str = "info", **options) -> None:
    """Run :func:`create_router_app` under uvicorn on ``host:port`` until interrupted (``liteturbo route``)."""
    import uvicorn

    app = create_router_app(replicas, api_keys, **options)
    r: Router = app.state.router
    if not r.keys and host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[liteturbo] warning: routing on {host} without --api-keys: anyone who can reach this port can use "
              f"the replicas", file=sys.stderr)
    print(f"[liteturbo] routing http://{host}:{port}/v1 to {len(r.replicas)} replica(s): "
          f"{', '.join(r.replicas)}", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


@click.command("route")
@click.option("--replica", "replicas", multiple=True, required=True, metavar="URL",
              help="http://HOST:PORT of a `liteturbo serve`; repeat for each replica (all with one --session-dir).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then give --api-keys).")
@click.option("--port", default=23333, show_default=True, type=int)
@click.option("--api-keys", default=None, envvar=API_KEYS_ENV, show_envvar=True,
              help="Comma-separated Bearer tokens every /v1 request must carry (passed on to the replicas as sent).")
@click.option("--health-interval", default=1.0, show_default=True, type=float, help="Seconds between /health polls.")
@click.option("--timeout", default=600.0, show_default=True, type=float,
              help="Seconds to wait for a replica's answer (or its next streamed chunk).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]))
@click.option("--metrics-port", default=29000, show_default=True, type=int,
              help="sglang-router's Prometheus port (each router on a host needs its own).")
@click.option("--builtin", is_flag=True,
              help="Run liteturbo's own proxy (it also routes the sessions REST API /v1/sessions...) instead of "
                   "sglang-router.")
@friendly_errors
def route_command(replicas, host, port, api_keys, health_interval, timeout, log_level, metrics_port, builtin) -> None:
    """Route clients to `liteturbo serve` replicas that share one --session-dir with sglang-router: a session's
    requests (its id in the header x-smg-routing-key) to the replica holding its KV cache, other requests balanced;
    when a replica dies or stalls, its sessions continue on the others. --builtin: liteturbo's own proxy
    (docs/serving.md, "Replicas and routing")."""
    if not builtin:
        from .sglang_route import launch

        replicas = [replica_url(u) for u in replicas]  # LiteturboError naming a bad address
        if len(set(replicas)) != len(replicas):
            raise LiteturboError("give each server once: two --replica addresses are the same server")

        if api_keys:  # sglang-router passes the Authorization header on: the replicas check the keys
            print("[liteturbo] --api-keys: with sglang-router the replicas check the keys (start them with the same "
                  "--api-keys)", file=sys.stderr)
        try:
            launch(list(replicas), host=host, port=port, health_interval=health_interval, timeout=timeout,
                   log_level=log_level, metrics_port=metrics_port)
        except ValueError as e:
            raise LiteturboError(str(e)) from None
        return
    if metrics_port != 29000:
        print("[liteturbo] --metrics-port is sglang-router's; with --builtin the replicas' /metrics are scraped "
              "directly", file=sys.stderr)
    route(replicas, host=host, port=port, api_keys=api_keys or "", log_level=log_level,
          health_interval=health_interval, timeout=timeout)
