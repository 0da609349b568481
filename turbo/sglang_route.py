"""``liteturbo route``: sglang-router (``pip install sglang-router``, Rust) launched in front of ``liteturbo serve``
replicas that share one ``--session-dir``, with the flags that keep sessions on one replica.

How it routes (sglang-router's ``manual`` policy): a request carrying the header ``x-smg-routing-key`` goes to the
replica that key was first given to (``--assignment-mode min_load``: the least loaded then), so a client that sends
its session id as that key keeps every turn of the session on the replica holding its KV; requests without the
header are balanced. sglang-router polls each replica's ``/health`` (a stalled engine answers 503 there, see the
engine watchdog) and takes one that fails ``--health-failure-threshold`` polls out, and its keys move to a live
replica, which loads the session from the shared dir. It forwards its own list of routes only
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``, ``/generate``, ...): liteturbo's
sessions REST API (``/v1/sessions...``) is not among them, and it re-writes the chat completions it forwards,
dropping fields it does not know (``session_id``). What reaches the replica is the header: a chat completion whose
``x-smg-routing-key`` is a session id (``sess-`` + 24 lowercase hex digits, chosen by the client) is a turn of that
session, opened by its first turn (its system prompt a leading system message; :func:`turbo.serve.protocol.read_chat`).
``liteturbo route --builtin`` runs liteturbo's own proxy
(:mod:`turbo.router`), which routes the sessions REST API as well (docs/serving.md, "Replicas and routing").

What sglang-router writes into the bodies it forwards (its request types' serde defaults, recorded from
sglang-router 0.3.2 in front of a worker that logged what reached it) is here, for the replica's request readers to
accept: a missing ``model`` arrives as :data:`ROUTER_MODEL` ("unknown"; no header tells a router's request from a
client's, so a replica takes that name as "not given"), and :data:`ROUTER_FILLS` lists, per endpoint, the fields it
adds at the values it gives them that liteturbo reads nowhere else (accepted at those values, which are what liteturbo
does anyway; another value is a feature liteturbo lacks, a 400 naming it). The other fields it fills are ones the
replica reads anyway, at harmless values: chat ``logprobs: false``, ``stream: false``, ``ignore_eos: false``,
``max_tokens`` renamed ``max_completion_tokens``, ``tool_choice`` ``"auto"`` beside tools (``"none"`` beside an
empty list); completions ``stream``, ``echo: false``, ``ignore_eos``; responses ``store: true``, ``stream: null``,
``temperature: 1.0``, ``top_p: 1.0``, ``top_k: -1``, ``min_p: 0.0``, ``repetition_penalty: 1.0``,
``parallel_tool_calls: true`` and ``tool_choice: "auto"`` beside tools. (It does not route ``/v1/messages``, and it
requires ``model`` in a completion.)

:func:`router_command` builds the command line; :func:`launch` replaces this process with it.
"""
from __future__ import annotations

import importlib.util
import os
import sys

ROUTING_KEY_HEADER = "x-smg-routing-key"
ROUTER_MODEL = "unknown"  # what sglang-router writes as the model of a request that names none
ROUTER_FILLS = {  # endpoint -> {field: the value sglang-router adds}, for fields liteturbo reads nowhere else
    "chat": {"continue_final_message": False, "no_stop_trim": False, "return_hidden_states": False,
             "separate_reasoning": True, "skip_special_tokens": True, "stream_reasoning": True},
    "completion": {"no_stop_trim": False, "return_hidden_states": False, "skip_special_tokens": True},
    "responses": {"priority": 0},
}


def router_command(replicas: list[str], host: str = "127.0.0.1", port: int = 23333, health_interval: float = 1.0,
                   timeout: float = 600.0, log_level: str = "info", metrics_port: int = 29000) -> list[str]:
    """The sglang-router command line for ``replicas`` (``http://host:port`` of ``liteturbo serve``s sharing one
    session dir); ``metrics_port``: where it serves its Prometheus metrics (two routers on one host need two).
    Raises ``ValueError`` for no replica or a bad option."""
    if not replicas:
        raise ValueError("give at least one --replica http://HOST:PORT")
    if health_interval <= 0 or timeout <= 0:
        raise ValueError("--health-interval and --timeout must be > 0 seconds")
    level = {"critical": "error", "warning": "warn", "trace": "debug"}.get(log_level, log_level)
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *replicas, "--policy", "manual", "--assignment-mode", "min_load",
            "--health-check-endpoint", "/health", "--health-check-interval-secs", str(max(1, round(health_interval))),
            "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--request-timeout-secs", str(max(1, round(timeout))), "--log-level", level,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port)]


def check_ports(host: str, port: int, metrics_port: int) -> None:
    """Raises ``ValueError`` naming the flag when ``--port`` and ``--metrics-port`` are the same or one of them cannot
    be listened on (sglang-router would panic with a backtrace)."""
    import socket

    if port == metrics_port:
        raise ValueError(f"--port and --metrics-port are both {port}: the router and its metrics need two ports")
    for flag, p in (("--port", port), ("--metrics-port", metrics_port)):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, p))
            except OSError as e:
                raise ValueError(f"{flag} {p}: cannot listen on {host}:{p} ({e.strerror or e}); choose another "
                                 f"{flag}") from None


def launch(replicas: list[str], **options) -> None:
    """Replace this process with sglang-router in front of ``replicas`` (see :func:`router_command`). Exits with a
    message naming the fix when sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is None:
        sys.exit("liteturbo route runs sglang-router, which is not installed: pip install sglang-router "
                 "(or pip install 'liteturbo[router]'); or run liteturbo's own proxy with --builtin")
    cmd = router_command(list(replicas), **options)
    check_ports(options.get("host", "127.0.0.1"), options.get("port", 23333), options.get("metrics_port", 29000))
    print(f"[liteturbo] routing http://{options.get('host', '127.0.0.1')}:{options.get('port', 23333)}/v1 to "
          f"{len(replicas)} replica(s) with sglang-router (sessions: header {ROUTING_KEY_HEADER}: <session id>)",
          file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
