"""The web chat page (turbo/serve/static/chat.html, served at ``GET /``) end to end in headless Chromium, over a live server
on a loopback port with the RTN W4A16 SmolLM2: the page creates a session, streams greedy replies equal to the
engine's, shows tokens/s and TTFT, resets to a new session, and shows the server's errors.

Chromium is Debian's ``chromium`` package; when it is missing and this runs as root with apt-get, it is installed
(``apt-get install -y --no-install-recommends chromium``, about 10 s with a reachable mirror), else the tests skip
saying why. The browser is driven over the DevTools protocol on ``--remote-debugging-pipe`` (JSON messages ending
with NUL on file descriptors 3 and 4), so no websocket package is needed: ``--dump-dom`` with
``--virtual-time-budget`` does not wait for a streaming ``fetch``. The page's ``autotest`` / ``autoreset`` query
parameters run the steps; ``<body data-autotest>`` turns ``done`` (or ``error``) when they end.

``LITETURBO_WEB_SCREENSHOT=docs/web_chat.png pytest tests/test_web_page.py`` also saves the screenshot of the
two-turn chat where the docs show it."""
from __future__ import annotations

import base64
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import time
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.serve.app import create_app

from conftest import serve_in_thread

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

pytestmark = pytest.mark.slow
KEY = "sk-web-test"
MODEL = "smollm2-test"
SIZE = (1000, 700)  # the viewport, in CSS pixels
MAX_TOKENS = 24
ROOT = Path(__file__).resolve().parents[1]


# --- Chromium: found or installed, driven over the DevTools protocol ------------------------------------------------

def _find() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _install() -> str:
    """Installs Debian's chromium with apt-get; returns what happened (for the skip reason)."""
    if os.name != "posix" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium is not installed, and it cannot be installed here (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    t0 = time.time()
    try:
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:  # stale package lists: refresh them once
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"installing chromium failed: {e}"
    print(f"[test_web_page] apt-get install chromium: rc {r.returncode} in {time.time() - t0:.1f} s", file=sys.stderr)
    if r.returncode != 0:
        return f"`{' '.join(install)}` failed (rc {r.returncode}): {(r.stderr or r.stdout)[-500:]}"
    return "apt-get installed chromium but no chromium executable is on PATH"


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find()
    if path is None:
        why = _install()
        path = _find()
        if path is None:
            pytest.skip(why)
    return path


# runs argv[3:] with the pipe ends argv[1] as fd 3 and argv[2] as fd 4 (moved above 9 first, so neither overwrites
# the other); a shell cannot do it portably (dash takes one-digit descriptors only), and preexec_fn is unsafe here
# (the server runs in a thread)
_ON_FDS_3_4 = ("import fcntl, os, sys; fds = [int(f) for f in sys.argv[1:3]]; "
               "high = [fcntl.fcntl(f, fcntl.F_DUPFD, 10) for f in fds]; [os.close(f) for f in fds]; "
               "os.dup2(high[0], 3); os.dup2(high[1], 4); [os.close(f) for f in high]; "
               "os.execv(sys.argv[3], sys.argv[3:])")


class Browser:
    """One headless Chromium (its own profile) and one page, driven by DevTools protocol commands over the pipe."""

    def __init__(self, exe: str, profile: Path, log: Path) -> None:
        cmd_r, self._cmd_w = os.pipe()  # we write commands; chromium reads them on fd 3
        self._out_r, out_w = os.pipe()  # chromium writes replies and events on fd 4
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                 "--no-default-browser-check", "--hide-scrollbars", f"--user-data-dir={profile}",
                 f"--window-size={SIZE[0]},{SIZE[1]}", "about:blank"]
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _ON_FDS_3_4, str(cmd_r), str(out_w), exe, *flags],
                                         pass_fds=(cmd_r, out_w), stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0
        try:
            page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            self.page("Emulation.setDeviceMetricsOverride", width=SIZE[0], height=SIZE[1], deviceScaleFactor=1,
                      mobile=False)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, _session: str | None = None, _timeout: float = 30.0, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if _session:
            msg["sessionId"] = _session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + _timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:  # anything else is an event: not needed here
                    assert "error" not in reply, f"{method}: {reply['error']}"
                    return reply["result"]
            left = deadline - time.time()
            if left <= 0 or not select.select([self._out_r], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} in {_timeout} s")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited; its log: {self.log.read_text(errors='replace')[-2000:]}")
            self._buf += chunk

    def page(self, method: str, **params):
        return self.call(method, _session=self._session, **params)

    def eval(self, expression: str):
        return self.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", _timeout=5)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)


# --- the dumped DOM, read back into a small tree -------------------------------------------------------------------

class Node:
    def __init__(self, tag: str, attrs: dict) -> None:
        self.tag, self.attrs, self.children = tag, attrs, []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find(self, cls: str) -> list["Node"]:
        out = [self] if cls in self.classes else []
        for c in self.children:
            if isinstance(c, Node):
                out += c.find(cls)
        return out


class _TreeBuilder(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        self.stack[-1].children.append(data)


class Page:
    """What the page shows, read from its DOM: the turns, the per-reply stats, the errors."""

    def __init__(self, html: str) -> None:
        builder = _TreeBuilder()
        builder.feed(html)
        root = builder.root
        self.html = html
        self.body = _first(root, "body")
        log = _by_id(root, "log")
        self.turns = [("user" if "user" in m.classes else "assistant", m.find("text")[0].text())
                      for m in log.find("msg")]
        self.stats = log.find("stats")
        self.errors = [e.text() for e in log.find("error")]
        footer = _by_id(root, "session").text()
        self.session_id = footer.split()[-1] if footer.startswith("session ") else None

    def texts(self, role: str) -> list[str]:
        return [t for r, t in self.turns if r == role]


def _walk(node: Node):
    yield node
    for c in node.children:
        if isinstance(c, Node):
            yield from _walk(c)


def _first(root: Node, tag: str) -> Node:
    return next(n for n in _walk(root) if n.tag == tag)


def _by_id(root: Node, id_: str) -> Node:
    return next(n for n in _walk(root) if n.attrs.get("id") == id_)


# --- the server -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(smollm2_rtn_g64):
    """(base url, app) of a server with an API key on a free loopback port; stopped at the end."""
    engine = Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=2048, max_batch_size=8))
    app = create_app(engine, model_name=MODEL, api_keys=[KEY])
    url, stop = serve_in_thread(app)
    yield url, app
    stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def app(served):
    return served[1]


def open_page(chromium: str, tmp_path: Path, url: str, steps: list[tuple[str, str]], key: str | None = KEY,
              max_tokens: int = MAX_TOKENS, screenshot: Path | None = None, timeout: float = 60.0) -> tuple[Page, str]:
    """Loads ``url/?...`` (greedy, ``max_tokens``) in a fresh headless Chromium, waits until the page's autotest
    steps end, and returns the page as shown and its end state ("done" or "error"); saves a PNG screenshot when
    asked."""
    query = [("temperature", "0"), ("max_tokens", str(max_tokens))] + ([("key", key)] if key else []) + steps
    tmp_path.mkdir(parents=True, exist_ok=True)
    browser = Browser(chromium, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        browser.page("Page.navigate", url=f"{url}/?{urlencode(query)}")
        deadline, state = time.time() + timeout, None
        while state not in ("done", "error"):
            assert time.time() < deadline, f"the page did not finish in {timeout} s (state {state!r})"
            time.sleep(0.05)
            state = browser.eval("document.body ? document.body.dataset.autotest || null : null")
        assert browser.eval("document.title") == f"liteturbo chat: {state}"
        if key:  # the key went to localStorage and out of the address bar
            assert browser.eval("localStorage.getItem('liteturbo-api-key')") == key
            assert "key=" not in browser.eval("location.href")
        html = browser.eval("document.documentElement.outerHTML")
        if screenshot is not None:
            png = base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(png)
    finally:
        browser.close()
    return Page(html), state


def engine_reply(app, messages: list[dict]) -> str:
    """The engine's own greedy reply to ``messages`` (stateless, through the server's loop)."""
    ids = app.state.engine.chat_template_ids(messages)
    return app.state.loop.submit(ids, GenerationConfig(max_new_tokens=MAX_TOKENS, temperature=0.0)).result().text


# --- the tests ------------------------------------------------------------------------------------------------------

def test_page_is_served_self_contained_and_packaged(url):
    r = httpx.get(f"{url}/")  # no API key needed for the page itself (its /v1 calls carry the key)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert html == (resources.files("turbo.serve") / "static" / "chat.html").read_text(encoding="utf-8")
    # no external resources: no CDN scripts, styles, fonts or images
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|@import|url\(\s*["']?(https?:)?//""", html)
    for used in ("/v1/sessions", "/v1/models", "getReader()", "[DONE]"):  # the sessions API, streamed
        assert used in html
    # shipped in the wheel: the package data of pyproject.toml covers the file
    if tomllib is None:
        return
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["turbo"]
    assert any(p.name == "chat.html" for g in data for p in (ROOT / "turbo").glob(g))


def test_two_turns_stream_the_engines_replies_with_stats(chromium, url, app, tmp_path):
    questions = ["What is the capital of France?", "And of Japan?"]
    shot = tmp_path / "web_chat.png"
    page, state = open_page(chromium, tmp_path / "run", url, [("autotest", q) for q in questions], screenshot=shot)
    assert state == "done" and page.errors == [], page.errors
    assert page.body.attrs.get("data-state") == "idle"
    assert [r for r, _ in page.turns] == ["user", "assistant"] * 2
    assert page.texts("user") == questions
    replies = page.texts("assistant")
    assert all(replies), replies
    # the replies are the engine's greedy ones: turn 1 stateless, turn 2 with the history
    assert replies[0] == engine_reply(app, [{"role": "user", "content": questions[0]}])
    assert replies[1] == engine_reply(app, [{"role": "user", "content": questions[0]},
                                            {"role": "assistant", "content": replies[0]},
                                            {"role": "user", "content": questions[1]}])
    # ... and what the server recorded for the page's session
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        info = http.get(f"/v1/sessions/{page.session_id}").json()
    assert info["messages"] == [{"role": r, "content": t} for r, t in page.turns]
    # each reply shows its token count, TTFT and tokens/s
    assert len(page.stats) == 2
    usage = info["last_usage"]
    for stats in page.stats:
        text = stats.text()
        assert re.search(r"\d+ tokens · TTFT \d+ ms · \d+\.\d tokens/s · prompt \d+ \(cached \d+\) · (stop|length)",
                         text), text
        assert float(stats.attrs["data-tokens-per-s"]) > 0 and float(stats.attrs["data-ttft-ms"]) > 0
        assert int(stats.attrs["data-pieces"]) > 1  # streamed: shown piece by piece, not in one go
    assert int(page.stats[1].attrs["data-tokens"]) == usage["completion_tokens"]
    assert f"prompt {usage['prompt_tokens']} (cached {usage['prompt_tokens_details']['cached_tokens']})" in \
        page.stats[1].text()
    # the screenshot: a PNG of the viewport
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == SIZE
    target = os.environ.get("LITETURBO_WEB_SCREENSHOT")
    if target:
        shutil.copyfile(shot, ROOT / target)


def test_reset_deletes_the_session_and_clears_the_view(chromium, url, app, tmp_path):
    before = {sid for sid, _ in app.state.sessions.items()}
    page, state = open_page(chromium, tmp_path, url,
                            [("autotest", "Name a color."), ("autoreset", "1"), ("autotest", "Name a fruit.")])
    assert state == "done" and page.errors == [], page.errors
    assert page.turns[0] == ("user", "Name a fruit.") and len(page.turns) == 2
    # a fresh session: the reply has no memory of the first turn
    assert page.texts("assistant") == [engine_reply(app, [{"role": "user", "content": "Name a fruit."}])]
    # the first session was deleted; the page's new one is the only one added
    assert {sid for sid, _ in app.state.sessions.items()} - before == {page.session_id}


def test_errors_are_shown_in_the_page(chromium, url, tmp_path):
    # no API key: the server's 401 message is shown
    page, state = open_page(chromium, tmp_path / "nokey", url, [("autotest", "Hi")], key=None)
    assert state == "error" and page.turns == []
    assert len(page.errors) == 1 and page.errors[0].startswith("401: no API key was given"), page.errors
    assert page.body.attrs.get("data-state") == "error"
    # a turn the server refuses: its 400 message is shown under the turn, which is marked failed
    page, state = open_page(chromium, tmp_path / "bad", url, [("autotest", "Hi")], max_tokens=0)
    assert state == "error" and page.texts("user") == ["Hi"]
    assert len(page.errors) == 1 and "'max_tokens' must be an integer >= 1" in page.errors[0], page.errors
    assert page.stats[0].text() == "failed"
