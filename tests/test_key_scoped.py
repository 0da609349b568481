"""Sessions and stored responses belong to the API key that made them (issue 57): with ``--api-keys K1,K2`` a
session or stored response K1 made does not exist for K2 (every read, turn, DELETE and ``previous_response_id``
answers as for an unknown id), in one process and through the engine process, and after a restart over the session
dir (which keeps a hash of the key, never the key); without keys nothing changes."""
from __future__ import annotations

import httpx
import pytest

from turbo import Engine, EngineConfig
from turbo.engine_proc.sessions import SessionRegistry
from turbo.serve.app import create_app
from turbo.session_ids import new_session_id, owner_of

from conftest import serve_in_thread

K1, K2 = "sk-first-key-1111", "sk-second-key-2222"
OPTS = dict(dtype="float32", max_kv_tokens=1024, block_size=4, max_batch_size=8)
TURN = {"content": "the first of the year", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import build_tiny_llama, save_word_tokenizer

    path = build_tiny_llama(tmp_path_factory.mktemp("keys") / "tiny", initializer_range=0.2)
    save_word_tokenizer(path, 128, bos=True)
    return path


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, EngineConfig(**OPTS))


def _as(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _serve(engine, session_dir, keys: str):
    app = create_app(engine, model_name="tiny", api_keys=keys,
                     sessions=SessionRegistry(engine, session_dir=session_dir))
    return serve_in_thread(app)


def _not_found(r: httpx.Response, code: str, status: int = 404) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


def _foreign_session_is_unknown(http: httpx.Client, sid: str) -> None:
    """Every way K2 can name K1's session answers what an id nobody made answers (the message differs by the id)."""
    other = new_session_id()
    for method, path, body in (("GET", "/v1/sessions/{}", None), ("POST", "/v1/sessions/{}/chat", TURN),
                               ("DELETE", "/v1/sessions/{}", None)):
        got = _not_found(http.request(method, path.format(sid), json=body, headers=_as(K2)), "session_not_found")
        want = _not_found(http.request(method, path.format(other), json=body, headers=_as(K2)), "session_not_found")
        assert got["message"].replace(sid, other) == want["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "the year"}], "max_tokens": 3}
    _not_found(http.post("/v1/chat/completions", json=dict(chat, session_id=sid), headers=_as(K2)),
               "session_not_found")
    # create_session or sglang-router's routing key with K1's id: not opened again for K2, not continued either
    _not_found(http.post("/v1/chat/completions", json=dict(chat, session_id=sid, create_session=True),
                         headers=_as(K2)), "session_not_found")
    _not_found(http.post("/v1/chat/completions", json=chat, headers={**_as(K2), "x-smg-routing-key": sid}),
               "session_not_found")


def test_sessions_and_responses_belong_to_their_key_across_a_restart(engine, tmp_path):
    sdir = tmp_path / "sessions"
    url, stop = _serve(engine, sdir, f"{K1},{K2}")
    with httpx.Client(base_url=url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={"system": "be brief"}, headers=_as(K1)).json()["id"]
        assert http.post(f"/v1/sessions/{sid}/chat", json=TURN, headers=_as(K1)).status_code == 200
        assert len(http.get(f"/v1/sessions/{sid}", headers=_as(K1)).json()["messages"]) == 3
        _foreign_session_is_unknown(http, sid)
        assert len(http.get(f"/v1/sessions/{sid}", headers=_as(K1)).json()["messages"]) == 3  # K2 changed nothing

        r1 = http.post("/v1/responses", json={"model": "tiny", "input": "the year", "max_output_tokens": 3},
                       headers=_as(K1)).json()["id"]
        _not_found(http.get(f"/v1/responses/{r1}", headers=_as(K2)), "response_not_found")
        _not_found(http.delete(f"/v1/responses/{r1}", headers=_as(K2)), "response_not_found")
        cont = {"model": "tiny", "input": "and then", "max_output_tokens": 3, "previous_response_id": r1}
        err = _not_found(http.post("/v1/responses", json=cont, headers=_as(K2)), "previous_response_not_found", 400)
        unknown = _not_found(http.post("/v1/responses", json=dict(cont, previous_response_id="resp_" + "0" * 32),
                                       headers=_as(K2)), "previous_response_not_found", 400)
        assert err["message"].replace(r1, "resp_" + "0" * 32) == unknown["message"]  # as if it did not exist
        r2 = http.post("/v1/responses", json=cont, headers=_as(K1))
        assert r2.status_code == 200 and r2.json()["previous_response_id"] == r1
        # K2's own session is its own, and K1 cannot reach it either
        sid2 = http.post("/v1/sessions", json={}, headers=_as(K2)).json()["id"]
        _not_found(http.get(f"/v1/sessions/{sid2}", headers=_as(K1)), "session_not_found")
    stop()

    # the session dir keeps the owners as hashes, never the keys
    files = [f for f in sdir.rglob("*") if f.is_file()]
    assert files and not any(K1.encode() in f.read_bytes() or K2.encode() in f.read_bytes() for f in files)
    assert (sdir / f"{sid}.owner").read_text() == owner_of(K1.encode())

    url, stop = _serve(engine, sdir, f"{K1},{K2}")  # a restart over the same dir
    with httpx.Client(base_url=url, timeout=60) as http:
        _foreign_session_is_unknown(http, sid)
        assert http.post(f"/v1/sessions/{sid}/chat", json=TURN, headers=_as(K1)).status_code == 200
        _not_found(http.get(f"/v1/responses/{r1}", headers=_as(K2)), "response_not_found")
        assert http.get(f"/v1/responses/{r1}", headers=_as(K1)).status_code == 200
        _not_found(http.get(f"/v1/sessions/{sid2}", headers=_as(K1)), "session_not_found")
        assert http.delete(f"/v1/sessions/{sid}", headers=_as(K1)).json()["deleted"] is True
        assert http.delete(f"/v1/responses/{r1}", headers=_as(K1)).json()["deleted"] is True
        assert http.delete(f"/v1/sessions/{sid2}", headers=_as(K2)).json()["deleted"] is True
    stop()
    assert not (sdir / f"{sid}.owner").exists()


def test_without_keys_nothing_changes(engine, tmp_path):
    url, stop = _serve(engine, tmp_path / "s", "")
    with httpx.Client(base_url=url, timeout=60) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        # any (or no) Authorization header reaches every session, as before
        assert http.post(f"/v1/sessions/{sid}/chat", json=TURN, headers=_as("anything")).status_code == 200
        assert http.get(f"/v1/sessions/{sid}").status_code == 200
        rid = http.post("/v1/responses", json={"model": "tiny", "input": "the year", "max_output_tokens": 3}).json()["id"]
        assert http.get(f"/v1/responses/{rid}", headers=_as("other")).status_code == 200
        assert http.delete(f"/v1/sessions/{sid}", headers=_as("other")).status_code == 200
    stop()
    assert not list((tmp_path / "s").glob("*.owner"))


def test_key_scoped_sessions_through_the_engine_process(tiny, tmp_path):
    from turbo.engine_proc.mp_client import MPClient

    client = MPClient(tiny, OPTS, {"session_dir": str(tmp_path / "s")})
    url, stop = serve_in_thread(create_app(client, model_name="tiny", api_keys=[K1, K2], session_dir=True))
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            sid = http.post("/v1/sessions", json={}, headers=_as(K1)).json()["id"]
            assert http.post(f"/v1/sessions/{sid}/chat", json=TURN, headers=_as(K1)).status_code == 200
            _foreign_session_is_unknown(http, sid)
            assert len(http.get(f"/v1/sessions/{sid}", headers=_as(K1)).json()["messages"]) == 2
            assert http.delete(f"/v1/sessions/{sid}", headers=_as(K1)).status_code == 200
    finally:
        stop()
        client.close()
