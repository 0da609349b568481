"""Prometheus metrics of a served engine (``GET /metrics``), with prometheus-client.

Gauges are read at scrape time from the engine client's ``stats()`` (running and waiting requests, KV blocks in use
and in total, the host tier of session KV, speculative decoding) and its live sessions; counters and histograms
(generated and prompt tokens, finished requests by reason, time to first token, inter-token latency) and the
prefix-cache hit rate are fed when a request ends (:meth:`ServerMetrics.observe` is one of the client's
``observers``). Each :class:`ServerMetrics` has its own registry, so several apps in one process do not collide.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Metrics of one engine: ``engine`` answers ``stats()`` (an :class:`~turbo.engine_proc.client.EngineClient`);
    ``sessions``: a callable returning the number of live sessions."""

    def __init__(self, engine, sessions: Callable[[], int] = lambda: 0) -> None:
        self.engine, self._sessions = engine, sessions
        r = self.registry = CollectorRegistry()
        self.running = Gauge("liteturbo_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("liteturbo_requests_waiting", "Requests queued for the running batch", registry=r)
        self.blocks_used = Gauge("liteturbo_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("liteturbo_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.hit_rate = Gauge("liteturbo_prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens, since start", registry=r)
        self.sessions_gauge = Gauge("liteturbo_sessions", "Live chat sessions", registry=r)
        self.stalls = Gauge("liteturbo_engine_stalls", "Times the engine process made no progress for the stall "
                            "timeout with requests open, since start", registry=r)
        self.generated = Counter("liteturbo_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("liteturbo_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.finished = Counter("liteturbo_requests_finished", "Finished requests by finish reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("liteturbo_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("liteturbo_inter_token_latency_seconds", "Mean time between output tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tier = Gauge("liteturbo_session_host_tier", "The host tier of session KV (--session-host-gib): sessions, "
                          "bytes, spills, host_hits / disk_hits (restored instead of recomputed), dropped, "
                          "host_restore_seconds / disk_restore_seconds, spill_seconds",
                          ["figure"], registry=r)
        self.spec = Gauge("liteturbo_speculative", "Speculative decoding since start: steps (verify steps), drafted "
                          "and accepted tokens, acceptance (accepted / drafted), tokens_per_step", ["figure"],
                          registry=r)
        self._prompt_tokens = 0
        self._cached_tokens = 0

    def observe(self, out) -> None:
        """Record a finished request's :class:`~turbo.engine.GenerationOutput` (called by the engine loop's thread, or
        by an engine process's receiver thread)."""
        n = len(out.token_ids)
        self.generated.inc(n)
        self.prompt.inc(out.prompt_tokens)
        self.finished.labels(out.finish_reason).inc()
        self._prompt_tokens += out.prompt_tokens
        self._cached_tokens += out.cached_tokens
        if n:
            self.ttft.observe(out.ttft)
        if n > 1:
            self.itl.observe(out.decode_seconds / (n - 1))

    def render(self) -> bytes:
        """The text exposition format, with the gauges read now (during an engine stall: the stall count, the rest as
        last read)."""
        self.stalls.set(getattr(self.engine, "stalls", 0))
        if getattr(self.engine, "stalled", None):
            return generate_latest(self.registry)
        st = self.engine.stats()
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.blocks_total.set(st["blocks_total"])
        self.blocks_used.set(st["blocks_total"] - st["blocks_free"])
        self.hit_rate.set(self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0)
        self.sessions_gauge.set(self._sessions())
        steps, drafted, acc = st.get("spec_steps", 0), st.get("spec_drafted", 0), st.get("spec_accepted", 0)
        for k, v in (("steps", steps), ("drafted", drafted), ("accepted", acc),
                     ("acceptance", acc / drafted if drafted else 0.0),
                     ("tokens_per_step", (acc + steps) / steps if steps else 0.0)):
            self.spec.labels(k).set(v)
        for k, v in st.items():
            if k.startswith("host_tier_") and k != "host_tier_budget_bytes":
                self.tier.labels(k.removeprefix("host_tier_")).set(v)
        return generate_latest(self.registry)
