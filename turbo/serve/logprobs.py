"""Log-probability entries of the HTTP API: tokens' own bytes and strings, completions' text offsets, and the entries
in the chat (``logprobs.content``) or completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``) shape.

Every entry carries its token's own raw bytes (:class:`Tokens`, from llguidance's view of the tokenizer), so the
entries' bytes joined are the reply's UTF-8 bytes (and what a stop string or the token limit cut off its text); the
``token`` string is their UTF-8 text, or OpenAI's ``bytes:\\xe6\\x88`` for part of a character
(:func:`token_text`). ``text_offset`` (:class:`TextOffsets`) counts the complete characters of the earlier tokens'
bytes (special tokens the text skips count none), clipped to the text's length; a stream sends the same offsets as
the non-streamed answer (:func:`logprob_entries`).
"""
from __future__ import annotations

import codecs
import json
import threading
from dataclasses import dataclass

from ..loop import RequestHandle

# the chosen token's logprob when it is not among the 20 most likely: the value OpenAI's API documents for that case
UNLIKELY_LOGPROB = -9999.0


def token_text(raw: bytes) -> str:
    """A log-probability entry's ``token`` string of a token's raw ``bytes``: their UTF-8 text when they are valid
    UTF-8, else OpenAI's form for part of a character: ``bytes:`` and each byte as ``\\x`` and two lowercase hex
    digits (``b"\\xe6\\x88"`` -> ``"bytes:\\\\xe6\\\\x88"``), so distinct byte tokens have distinct strings."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte in a byte-level BPE vocabulary
    (character -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:] + [256 + k for k in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs, cs)}


def _fallback_reader(tok):
    """id -> raw bytes for a tokenizer llguidance cannot read: a byte-level BPE vocabulary's token strings through
    GPT-2's byte map; otherwise (or for a token outside that alphabet, e.g. an added one) the token's decoded text."""
    try:
        dec = json.loads(tok.backend_tokenizer.to_str())["decoder"] or {}
    except Exception:  # noqa: BLE001 - not a fast tokenizer: decode it is
        dec = {}
    if "ByteLevel" not in {dec.get("type")} | {d.get("type") for d in dec.get("decoders") or ()}:
        return lambda tid: tok.decode([tid]).encode("utf-8")
    byte_of = _gpt2_byte_map()

    def read(tid: int) -> bytes:
        piece = tok.convert_ids_to_tokens(tid)
        if piece and all(c in byte_of for c in piece):
            return bytes(byte_of[c] for c in piece)
        return tok.decode([tid]).encode("utf-8")
    return read


class Tokens:
    """A tokenizer's token ids as log-probability entries need them (cached): ``tokens(id)`` is ``(token string,
    raw bytes as a list of ints 0-255)`` (see :func:`token_text`), and :meth:`text_bytes` what a token adds to the
    reply text.

    Raw bytes come from llguidance's view of the tokenizer (built on first use, ~0.3 s for a 49k vocabulary); for a
    tokenizer llguidance cannot read, from :func:`_fallback_reader`. Special tokens have their text's bytes (e.g.
    ``<|im_start|>``); ids outside the tokenizer's table (a model's vocabulary can be larger) have no bytes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.cache = tokenizer, {}
        self._lock = threading.Lock()
        self._read = None  # id -> bytes, built on first use
        self._skipped: set[int] = set()  # special ids: the reply text leaves them out

    def _reader(self):
        with self._lock:
            if self._read is None:
                tok = self.tokenizer
                self._skipped = set(getattr(tok, "all_special_ids", ())) | {
                    i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
                try:
                    import llguidance.hf
                    ll = llguidance.hf.from_tokenizer(tok)
                    read = lambda tid: ll.decode_bytes([tid])  # noqa: E731
                except Exception:  # noqa: BLE001 - any reason it cannot read it: the fallback can
                    read = _fallback_reader(tok)
                n = len(tok)
                self._read = lambda tid: read(tid) if 0 <= tid < n else b""
            return self._read

    def text_bytes(self, tid: int) -> bytes:
        """The bytes token ``tid`` adds to the reply text: its raw bytes, none for a special token (the engine's
        detokenizer, :mod:`turbo.core.detokenizer`, decodes with ``skip_special_tokens``)."""
        raw = bytes(self(tid)[1])  # first: builds the reader and the special ids
        return b"" if tid in self._skipped else raw

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self.cache.get(tid)
        if got is None:
            raw = self._reader()(tid)
            got = self.cache[tid] = (token_text(raw), list(raw))
        return got


class TextOffsets:
    """Completions' ``text_offset`` bookkeeping over one reply's generated tokens, in order: :attr:`chars` is the
    next token's offset, the characters of text before it, counted from the bytes the earlier tokens add to the
    text (:meth:`Tokens.text_bytes`) as UTF-8 decoding gives them: complete characters only (one split over tokens
    counts once its last byte came), an invalid byte sequence as the U+FFFD characters the decoder writes for it.
    :meth:`add` passes a token. The count can exceed the reply's text (a stop string cuts it, a token limit cuts an
    unfinished character off): callers clip it."""

    def __init__(self) -> None:
        self.chars = 0
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, text_bytes: bytes) -> None:
        self.chars += len(self._dec.decode(text_bytes))


@dataclass
class Logprobs:
    """Which log-probabilities a request returns: ``top`` alternatives per token (chat: top_logprobs; completions:
    logprobs). The engine is asked for the 20 most likely, so the chosen token's own logprob is found among them
    (it is always the first for greedy decoding); one outside them is reported as :data:`UNLIKELY_LOGPROB`."""

    top: int
    chat: bool

    @staticmethod
    def chosen(tid: int, top: list[tuple[int, float]]) -> float:
        return next((lp for t, lp in top if t == tid), UNLIKELY_LOGPROB)

    def entries(self, tokens: Tokens, ids: list[int], lps: list[list[tuple[int, float]]],
                offsets: list[int] | None = None):
        """The entries of generated tokens ``ids`` (with ``lps``, each token's top ``(id, logprob)`` list, most likely
        first). Chat: a list of ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``;
        completions: the ``tokens`` / ``token_logprobs`` / ``top_logprobs`` (dicts token string -> logprob; two
        alternatives with one string keep the likelier) / ``text_offset`` (= ``offsets``, one per token, see
        :class:`TextOffsets`) object. ``token`` strings and ``bytes`` are :class:`Tokens`'. Raises ``ValueError``
        when completions get no offset per token."""
        if self.chat:
            out = []
            for tid, top in zip(ids, lps):
                text, raw = tokens(tid)
                alts = [{"token": tokens(t)[0], "logprob": lp, "bytes": tokens(t)[1]} for t, lp in top[:self.top]]
                out.append({"token": text, "logprob": self.chosen(tid, top), "bytes": raw, "top_logprobs": alts})
            return out
        if offsets is None or len(offsets) != len(ids):
            raise ValueError(f"completions' logprobs need one text offset per token: {len(ids)} tokens, offsets "
                             f"{offsets!r}")
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        for tid, top in zip(ids, lps):
            res["tokens"].append(tokens(tid)[0])
            res["token_logprobs"].append(self.chosen(tid, top))
            alts: dict[str, float] = {}
            for t, lp in top[:self.top]:
                alts.setdefault(tokens(t)[0], lp)
            res["top_logprobs"].append(alts)
        return res


def _logprob_ids(handle: RequestHandle, start: int, end: int | None = None):
    """(positions in the output, ids, top logprobs) of generated tokens ``start:end`` (stop ids left out: their
    text is not shown) and the end (``None``: the tokens generated so far)."""
    req = handle.request
    n = len(req.output_ids) if end is None else end  # logprobs are appended before output_ids
    ids, lps = req.output_ids[start:n], req.logprobs[start:n]
    keep = [i for i, t in enumerate(ids) if t not in req.stop_ids]
    return [start + i for i in keep], [ids[i] for i in keep], [lps[i] for i in keep], n


def logprob_entries(want: Logprobs | None, tokens: Tokens, handle: RequestHandle, start: int, end: int | None,
                    offsets: TextOffsets, text_len: int):
    """(entries of generated tokens ``start:end``, where the next entries start) or (``None``, ``start``)
    without logprobs. Completions' ``text_offset`` come from ``offsets`` (at token ``start``), clipped to
    ``text_len``, the characters of text known: with an ``end``, the whole text (every entry to ``end`` is
    given); without (a stream, tokens generated so far), the text sent so far, and entries whose offset lies
    past it wait for later calls (a stop string may still cut the text there), so every offset sent indexes the
    final text and equals the non-streamed one."""
    if want is None:
        return None, start
    pos, ids, lps, n = _logprob_ids(handle, start, end)
    at: list[int] = []
    if not want.chat:
        for k, tid in enumerate(ids):
            if end is None and offsets.chars > text_len:
                ids, lps, n = ids[:k], lps[:k], pos[k]
                break
            at.append(min(offsets.chars, text_len))
            offsets.add(tokens.text_bytes(tid))
    return want.entries(tokens, ids, lps, at), n
