"""The host tier of session KV: what an idle session's evicted KV blocks held, kept in host memory under a byte budget,
so its next turn copies the history back instead of recomputing it.

When the scheduler evicts a session's blocks (the pool needs room, :meth:`~turbo.core.scheduler.Scheduler.evict`),
its output carries a ``KVStore``: the engine exports the K/V of the computed tokens in the cache's stored form (16-bit
values, or int8/int4 codes with their scales, on the CPU: see :meth:`backends.kv_cache.PagedKVCache.export`) into a
:class:`HostTier` before the step writes the pool. When the session is admitted again, the scheduler allocates blocks
for the longest prefix its next prompt shares (``Sequence.host_kv``) and its output carries a ``KVLoad``: the engine
takes the copy back (:meth:`HostTier.take`) and loads it before the run. Least recently spilled sessions leave the tier first when the budget is exceeded
(their next turn recomputes, counted as ``dropped``). The disk tier is a session's own saved KV (``Session.save`` with
``include_kv``; the server's ``--session-dir`` saves after every turn): a session found in neither recomputes. Source
of the idea: LMCache / SGLang HiCache (host offload of
prefix caches); here it is per session, in the stored form, with no format change.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    seq: object  # the Sequence whose host_kv names this entry (cleared when the entry leaves)
    token_ids: list[int]
    kv: dict[str, torch.Tensor]
    nbytes: int


@dataclass
class HostTier:
    """Sessions' spilled KV by sequence id, least recently spilled first, at most ``budget_bytes`` in all.

    Counters: ``spills`` (sessions put), ``host_hits`` / ``disk_hits`` (loaded back from here, or from the session's
    own saved KV on disk), ``dropped`` (pushed out by the budget, or too large for it), ``host_restore_seconds`` /
    ``disk_restore_seconds`` / ``spill_seconds`` (loads and exports, timed by the engine)."""

    budget_bytes: int
    entries: OrderedDict = field(default_factory=OrderedDict)
    nbytes: int = 0
    counters: dict = field(default_factory=lambda: {"spills": 0, "host_hits": 0, "disk_hits": 0, "dropped": 0,
                                                    "host_restore_seconds": 0.0, "disk_restore_seconds": 0.0,
                                                    "spill_seconds": 0.0})

    def put(self, seq, token_ids: list[int], kv: dict[str, torch.Tensor]) -> None:
        """Keep ``kv`` (the stored K/V of ``token_ids``, per tensor ``[tokens, ...]``) for the sequence ``seq`` and
        set its ``host_kv`` (what the scheduler reads to plan the load back), pushing out the least recently spilled
        sessions past the budget (their ``host_kv`` cleared); one larger than the whole budget is not kept."""
        self.drop(seq.seq_id)
        size = sum(t.numel() * t.element_size() for t in kv.values())
        if size > self.budget_bytes:
            self.counters["dropped"] += 1
            return
        while self.entries and self.nbytes + size > self.budget_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            old.seq.host_kv = None
            self.counters["dropped"] += 1
        seq.host_kv = list(token_ids)
        self.entries[seq.seq_id] = _Entry(seq, seq.host_kv, kv, size)
        self.nbytes += size
        self.counters["spills"] += 1

    def take(self, seq_id: int) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The spilled ``(token ids, kv)`` of ``seq_id``, removed from the tier; ``None`` when it holds none."""
        e = self.entries.pop(seq_id, None)
        if e is None:
            return None
        self.nbytes -= e.nbytes
        e.seq.host_kv = None
        return e.token_ids, e.kv

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id``'s spilled KV (the session was reset, closed or failed)."""
        e = self.entries.pop(seq_id, None)
        if e is not None:
            self.nbytes -= e.nbytes
            e.seq.host_kv = None

    def stats(self) -> dict:
        """``host_tier_sessions``, ``host_tier_bytes``, ``host_tier_budget_bytes`` and the counters, prefixed."""
        return {"host_tier_sessions": len(self.entries), "host_tier_bytes": self.nbytes,
                "host_tier_budget_bytes": self.budget_bytes, **{f"host_tier_{k}": v for k, v in self.counters.items()}}


def saved_kv_ref(path, token_ids: list[int]) -> tuple:
    """What a sequence records of its saved KV (``Sequence.disk_kv``): the file, the token ids it holds, and the file's
    size and modification time (a file another process replaced since is not used)."""
    st = os.stat(path)
    return str(path), list(token_ids), (st.st_size, st.st_mtime_ns)


def load_saved_kv(path: str, token_ids: list[int], stamp: tuple) -> tuple[list[int], dict[str, torch.Tensor]] | None:
    """The disk tier: ``(token_ids, kv)`` from a session's saved ``kv.safetensors`` (:meth:`turbo.session.Session.save`
    with ``include_kv`` records it on its sequence, :func:`saved_kv_ref`), ``None`` when it is gone, unreadable or
    replaced since (then the history is recomputed)."""
    from safetensors.torch import load_file
    try:
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != stamp:
            return None
        return list(token_ids), load_file(path)
    except Exception:  # noqa: BLE001 - deleted, truncated, replaced: the turn recomputes
        return None


def prefix_kv(kv: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The stored K/V of the first ``n`` tokens (every tensor is ``[tokens, ...]``)."""
    return {k: t[:n] for k, t in kv.items()}


@contextlib.contextmanager
def timed(counters: dict, key: str):
    """Add the seconds the ``with`` block takes to ``counters[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        counters[key] += time.perf_counter() - t0
