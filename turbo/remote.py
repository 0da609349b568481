"""A chat session on a running ``liteturbo serve`` through its sessions API (``liteturbo chat --url``), with httpx.

:class:`RemoteSession` mirrors :class:`turbo.session.Session`'s chat surface: ``chat(message, stream=True, gen=...)``
yields text pieces as the server streams them (server-sent events of ``POST /v1/sessions/{id}/chat``), ``last``
describes the finished turn (tokens, prompt and cached tokens, time to first token, decode speed), ``reset()``
starts a new conversation, ``close()`` deletes it on the server. Server errors raise ``LiteturboError`` with the
server's message.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from lite.formats import LiteturboError

from .config import GenerationConfig


@dataclass
class RemoteTurn:
    """What ``last`` holds after a remote turn (the fields ``liteturbo chat`` prints)."""

    text: str
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    decode_seconds: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed after the first token, as the client saw it (tokens/s)."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class RemoteSession:
    """A session on the server at ``url`` (e.g. ``http://127.0.0.1:23333``). ``api_key``: a Bearer token when the
    server asks for one. Raises ``LiteturboError`` when the server cannot be reached or refuses."""

    def __init__(self, url: str, system: str | None = None, api_key: str | None = None, timeout: float = 600.0):
        try:
            import httpx
        except ImportError:
            raise LiteturboError("chat --url needs httpx: pip install 'liteturbo[serve]'") from None
        url = url.strip()
        if "://" not in url:
            url = "http://" + url  # `host:port` as `liteturbo serve` prints it
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        except httpx.InvalidURL as e:
            raise LiteturboError(f"--url {url!r} is not a valid URL ({e}); give http://HOST:PORT as `liteturbo serve` "
                                 f"prints it") from None
        self.system = system
        self.last: RemoteTurn | None = None
        self.id = self._create()

    def _request(self, method: str, path: str, **kw):
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise LiteturboError(f"cannot reach the server at {self.url} ({e}); is `liteturbo serve` running "
                                 f"there?") from None
        if r.status_code >= 400:
            raise LiteturboError(f"the server answered {r.status_code}: {_message(r.text)}")
        return r

    def _create(self) -> str:
        body = {} if self.system is None else {"system": self.system}
        return self._request("POST", "/v1/sessions", json=body).json()["id"]

    def chat(self, message: str, stream: bool = False, gen: GenerationConfig | None = None):
        """Send ``message``; the reply text, or with ``stream=True`` an iterator of its pieces."""
        it = self._turn(message, gen or GenerationConfig())
        return it if stream else "".join(it)

    def _turn(self, message: str, gen: GenerationConfig):
        import httpx

        body = {"content": message, "stream": True, "max_tokens": gen.max_new_tokens,
                "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
        if gen.seed is not None:
            body["seed"] = gen.seed
        if gen.speculative:
            body["speculative"] = gen.speculative
        t0 = time.perf_counter()
        t_first, pieces, final = None, [], None
        try:
            with self._http.stream("POST", f"/v1/sessions/{self.id}/chat", json=body) as r:
                if r.status_code >= 400:
                    raise LiteturboError(f"the server answered {r.status_code}: {_message(r.read().decode())}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise LiteturboError(f"the server failed the turn: {ev['error'].get('message')}")
                    if ev.get("delta"):
                        if t_first is None:
                            t_first = time.perf_counter()
                        pieces.append(ev["delta"])
                        yield ev["delta"]
                    if ev.get("finish_reason"):
                        final = ev
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise LiteturboError(f"lost the server at {self.url} ({e})") from None
        t_end = time.perf_counter()
        usage = (final or {}).get("usage") or {}
        n = int(usage.get("completion_tokens", 0))
        t_first = t_first or t_end
        self.last = RemoteTurn("".join(pieces), [None] * n, (final or {}).get("finish_reason", "cancelled"),
                               int(usage.get("prompt_tokens", 0)),
                               int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                               t_first - t0, t_end - t_first)

    def reset(self) -> None:
        """Forget the conversation: delete the server's session and start a new one (same system prompt)."""
        self.close()
        self.id = self._create()

    def close(self) -> None:
        """Delete the session on the server."""
        try:
            self._request("DELETE", f"/v1/sessions/{self.id}")
        except LiteturboError:
            pass


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
