"""Log-probability entries of tokens that hold part of a multi-byte UTF-8 character (turbo/serve/responses.py):
each entry carries its token's own raw bytes (they join to the reply's UTF-8 bytes), a partial token's string is
OpenAI's ``bytes:\\xe5\\x9b``, legacy ``top_logprobs`` keep distinct byte tokens apart, and ``text_offset`` counts
complete characters, is clipped to the text and is the same streamed or not. Checked on the SmolLM2 tokenizer
against its own ``decode``, directly and end to end through the server over the float32 SmolLM2."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from turbo.serve.logprobs import UNLIKELY_LOGPROB, Logprobs, TextOffsets, Tokens, logprob_entries

from conftest import serve_in_thread

MODEL = "smollm2-f32"


def expected_token(raw: bytes) -> str:
    """OpenAI's token string of raw bytes, written out independently of the server's code."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join("\\x%02x" % b for b in raw)


def token_bytes(token: str) -> bytes:
    """The bytes a completions token string stands for (the inverse of :func:`expected_token`)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token[len("bytes:"):].replace("\\x", ""))
    return token.encode("utf-8")


def decoded_chars(tok, ids: list[int]) -> int:
    """Complete characters of the text of ``ids`` by the tokenizer's own decode (a trailing U+FFFD is the
    decoder's stand-in for an unfinished character: not counted)."""
    d = tok.decode(ids, skip_special_tokens=True)
    return len(d) - d.endswith("\ufffd")


def handle_of(ids: list[int], lps: list, stop_ids=()) -> SimpleNamespace:
    """What ``logprob_entries`` reads of a request handle."""
    return SimpleNamespace(request=SimpleNamespace(output_ids=list(ids), logprobs=list(lps), stop_ids=set(stop_ids)))


def greedy_lps(ids: list[int], alternatives: list[int]) -> list[list[tuple[int, float]]]:
    """Top lists where the chosen token is the most likely, then ``alternatives`` (skipping the chosen one)."""
    return [[(t, -0.25)] + [(a, -1.0 - k) for k, a in enumerate(x for x in alternatives if x != t)] for t in ids]


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from turbo.core.startup import load_tokenizer

    return load_tokenizer(smollm2_path)


# --- Tokens, TextOffsets, Logprobs.entries -------------------------------------------------------------------------

TEXT = "中国人 😀 こんにちは 日本語"


def test_token_bytes_rebuild_text_and_partial_tokens_are_bytes_strings(tok):
    tokens = Tokens(tok)
    ids = tok.encode("中国人")
    assert ids == [28589, 23022, 138, 40249]  # 国 (e5 9b bd) is split over two tokens
    assert [tokens(t)[0] for t in ids] == ["中", "bytes:\\xe5\\x9b", "bytes:\\xbd", "人"]
    assert [tokens(t)[1] for t in ids] == [list("中".encode()), [0xe5, 0x9b], [0xbd], list("人".encode())]

    ids = tok.encode(TEXT)
    raws = [bytes(tokens(t)[1]) for t in ids]
    assert b"".join(raws) == TEXT.encode("utf-8")
    for i, (t, raw) in enumerate(zip(ids, raws)):
        assert tokens(t)[0] == expected_token(raw)
        # each prefix of bytes decodes as the tokenizer decodes that prefix of ids
        assert b"".join(raws[:i + 1]).decode("utf-8", "replace") == tok.decode(ids[:i + 1])
    assert sum(tokens(t)[0].startswith("bytes:") for t in ids) >= 10
    # ids past the tokenizer's table (a model's vocabulary can be larger) have no bytes
    assert tokens(len(tok) + 7) == ("", []) and tokens.text_bytes(len(tok) + 7) == b""
    # special tokens: their text as bytes, but the reply text skips them
    assert tokens(1) == ("<|im_start|>", list(b"<|im_start|>")) and tokens.text_bytes(1) == b""


def test_fallback_readers(tok, tmp_path, monkeypatch):
    import llguidance.hf

    ref = Tokens(tok)
    want = [ref(t) for t in range(len(tok))]

    def refuse(*a, **k):
        raise ValueError("cannot read this tokenizer")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", refuse)
    fallback = Tokens(tok)  # GPT-2 byte map over the byte-level vocabulary
    assert [fallback(t) for t in range(len(tok))] == want
    assert fallback(len(tok)) == ("", [])
    monkeypatch.undo()

    from tiny_models import save_word_tokenizer
    from transformers import AutoTokenizer

    save_word_tokenizer(tmp_path, 64)
    word_tok = AutoTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(Exception):
        llguidance.hf.from_tokenizer(word_tok)
    words = Tokens(word_tok)  # then each token's decoded text
    assert [words(t) for t in range(64)] == [(word_tok.decode([t]), list(word_tok.decode([t]).encode()))
                                            for t in range(64)]
    assert words(64) == ("", []) and words(10 ** 6) == ("", [])


def test_text_offsets_count_complete_characters(tok):
    tokens, offsets = Tokens(tok), TextOffsets()
    ids = tok.encode(TEXT)
    got = []
    for t in ids:
        got.append(offsets.chars)
        offsets.add(tokens.text_bytes(t))
    assert got == [decoded_chars(tok, ids[:i]) for i in range(len(ids))]
    assert offsets.chars == len(TEXT) and got[:5] == [0, 1, 1, 2, 3]


def test_entries_completions_keep_distinct_byte_tokens(tok):
    tokens = Tokens(tok)
    ids = tok.encode("中国人")
    alts = [23022, 138, 28589]  # two partial tokens, both "\ufffd" when decoded alone
    lps = greedy_lps(ids, alts)
    res = Logprobs(3, chat=False).entries(tokens, ids, lps, [0, 1, 1, 2])
    assert res["tokens"] == ["中", "bytes:\\xe5\\x9b", "bytes:\\xbd", "人"]
    assert res["text_offset"] == [0, 1, 1, 2] and res["token_logprobs"] == [-0.25] * 4
    assert res["top_logprobs"][0] == {"中": -0.25, "bytes:\\xe5\\x9b": -1.0, "bytes:\\xbd": -2.0}
    assert all(len(top) == 3 for top in res["top_logprobs"])
    with pytest.raises(ValueError, match="one text offset per token"):
        Logprobs(3, chat=False).entries(tokens, ids, lps, [0])

    chat = Logprobs(2, chat=True).entries(tokens, ids, lps)
    assert b"".join(bytes(e["bytes"]) for e in chat) == "中国人".encode()
    assert chat[1]["top_logprobs"] == [{"token": "bytes:\\xe5\\x9b", "logprob": -0.25, "bytes": [0xe5, 0x9b]},
                                      {"token": "bytes:\\xbd", "logprob": -1.0, "bytes": [0xbd]}]
    assert Logprobs.chosen(5, lps[0]) == UNLIKELY_LOGPROB


def test_streamed_offsets_wait_for_the_text_and_equal_the_reply(tok):
    """A stop string ("。") cut the text to "中国" after 7 tokens: the offsets sent while streaming never pass the
    text sent so far, and joined they equal the reply's (clipped to its 2 characters)."""
    tokens = Tokens(tok)
    ids = [1] + tok.encode("中国。但是") + [2]  # <|im_start|> (skipped in text), ..., <|im_end|> (a stop id)
    lps = greedy_lps(ids, [23022, 138])
    want = Logprobs(2, chat=False)
    full, _ = logprob_entries(want, tokens, handle_of(ids, lps, {2}), 0, len(ids), TextOffsets(), 2)
    assert full["text_offset"] == [0, 0, 1, 1, 2, 2, 2, 2]  # unclipped: [0, 0, 1, 1, 2, 3, 3, 4]
    assert full["tokens"][:4] == ["<|im_start|>", "中", "bytes:\\xe5\\x9b", "bytes:\\xbd"]

    offsets, sent, streamed = TextOffsets(), 0, []
    for n, chars in ((2, 1), (4, 2), (8, 2)):  # (tokens generated, characters sent) at each piece
        lp, sent = logprob_entries(want, tokens, handle_of(ids[:n], lps[:n], {2}), sent, None, offsets, chars)
        assert all(o <= chars for o in lp["text_offset"])
        streamed.append(lp)
    assert sent == 5  # "但" (offset 3) waits: the text may still be cut before it
    lp, _ = logprob_entries(want, tokens, handle_of(ids, lps, {2}), sent, len(ids), offsets, 2)
    streamed.append(lp)
    assert {k: sum((s[k] for s in streamed), []) for k in full} == full


# --- end to end through the server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(smollm2_path):
    from turbo import Engine, EngineConfig
    from turbo.serve.app import create_app

    engine = Engine(smollm2_path, EngineConfig(dtype="float32", max_kv_tokens=1024, max_batch_size=4))
    app = create_app(engine, model_name=MODEL, api_keys=[])
    url, stop = serve_in_thread(app)
    with httpx.Client(base_url=url, timeout=120) as c:
        c.app = app
        yield c
    stop()


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def _engine_ids(http, prompt, **gen) -> list[int]:
    from turbo import GenerationConfig

    return http.app.state.loop.submit(prompt, GenerationConfig(temperature=0, **gen)).result().token_ids


@pytest.mark.slow
@pytest.mark.parametrize("prompt,stop", [("中国的首都是北京。日本的首都是", None), ("Emoji: 😀 😃 😄 😁", ["🌸🌹"])])
def test_completions_logprobs_of_split_characters(http, tok, prompt, stop):
    body = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=5, stop=stop)
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    text, lp = c["text"], c["logprobs"]
    ids = _engine_ids(http, prompt, max_new_tokens=8, stop=stop or [])
    assert len(lp["tokens"]) == len(ids) == 8 and sum(t.startswith("bytes:") for t in lp["tokens"]) >= 3
    raws = [token_bytes(t) for t in lp["tokens"]]
    assert [expected_token(r) for r in raws] == lp["tokens"]
    for i in range(len(ids)):  # each token's bytes are those the tokenizer decodes
        assert b"".join(raws[:i + 1]).decode("utf-8", "replace") == tok.decode(ids[:i + 1])
    joined = b"".join(raws)
    assert joined.startswith(text.encode())
    raw_offsets = [decoded_chars(tok, ids[:i]) for i in range(len(ids))]
    assert lp["text_offset"] == [min(o, len(text)) for o in raw_offsets]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and max(lp["text_offset"]) <= len(text)
    if stop:  # the stop string cut the text: offsets past it are clipped
        assert text == " 😊" and max(raw_offsets) > len(text)
    assert all(len(top) == 5 for top in lp["top_logprobs"])  # distinct byte tokens keep distinct keys
    for chosen, tok_str, top in zip(lp["token_logprobs"], lp["tokens"], lp["top_logprobs"]):
        assert top[tok_str] == chosen == max(top.values())  # greedy

    chunks = _events(http.post("/v1/completions", json=dict(body, stream=True)))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == text
    streamed = {k: sum((ch["choices"][0]["logprobs"][k] for ch in chunks if ch["choices"][0]["logprobs"]), [])
                for k in lp}
    assert streamed == lp


@pytest.mark.slow
def test_chat_logprob_bytes_rebuild_the_reply(http, tok):
    msgs = [{"role": "user", "content": "请用中文回答：你好吗？"}]
    body = dict(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    r = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content, entries = r["message"]["content"], r["logprobs"]["content"]
    assert len(entries) == 12 and sum(e["token"].startswith("bytes:") for e in entries) >= 4
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.startswith(content.encode())
    tail = joined[len(content.encode()):]
    if tail:  # the token limit cut a character off the text
        assert r["finish_reason"] == "length" and len(tail) < 4
        with pytest.raises(UnicodeDecodeError):
            tail.decode("utf-8")
    for e in entries:
        assert e["token"] == expected_token(bytes(e["bytes"]))
        assert len(e["top_logprobs"]) == 5 and e["top_logprobs"][0]["bytes"] == e["bytes"]
        assert all(a["token"] == expected_token(bytes(a["bytes"])) for a in e["top_logprobs"])

    chunks = _events(http.post("/v1/chat/completions", json=dict(body, stream=True)))
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == content
    streamed = sum((ch["choices"][0]["logprobs"]["content"] for ch in chunks
                    if ch["choices"] and ch["choices"][0]["logprobs"]), [])
    assert streamed == entries
