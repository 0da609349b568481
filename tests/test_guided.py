"""Constrained decoding (turbo/core/guided.py): llguidance's masks against a brute-force check of every token on a
tiny byte-level BPE tokenizer, and the engine's constrained requests (alone, in a mixed batch, with int4 KV, in a
session, with logprobs; bad and unfinishable constraints)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import regex
import torch
import transformers

from lite.formats import LiteturboError
from turbo import Engine, GenerationConfig
from turbo.core.guided import Guide, bitmask_words, mask_bias
from turbo.errors import InvalidRequest

VOCAB = 320  # the model's vocabulary: 300 tokenizer entries + 20 padding ids no text maps to
TEXTS = ['{"name": "Ann", "age": 3, "tags": ["x", "y"]}', "yes no maybe café naïve 123-ab 45-cd", "the cat sat"] * 20


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, tr)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return hf


@pytest.fixture(scope="module")
def byte_tok():
    return _byte_tokenizer()


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte_llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   eos_token_id=0, bos_token_id=None, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    _byte_tokenizer().save_pretrained(path)
    return path


def _bytelevel(piece: str) -> bytes:
    """GPT-2's byte-to-unicode map inverted: a byte-level BPE token's raw bytes (independent of llguidance)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    return bytes(dec[ch] for ch in piece)


def _choice_ok(done: bytes, choices: list[str], full: bool) -> bool:
    enc = [c.encode() for c in choices]
    return done in enc if full else any(c.startswith(done) for c in enc)


def _regex_ok(done: bytes, pattern: str, full: bool) -> bool:
    try:
        s = done.decode("ascii")  # the patterns below are ASCII-only: other bytes never fit
    except UnicodeDecodeError:
        return False
    return bool(regex.fullmatch(pattern, s)) if full else bool(regex.fullmatch(pattern, s, partial=True))


def _brute_force_walk(tok, gen: GenerationConfig, ok, seed: int, exact: bool = True) -> int:
    """Walk random allowed paths; at every position the mask must equal the brute-force set of tokens whose bytes
    keep the text a prefix of the language (EOS: the text is in it). ``exact=False``: a subset that is never empty
    (llguidance allows only the canonical tokenization of a fixed string, see guidance-ai/guidance#1352). Returns
    steps."""
    guide = Guide(gen, tok, VOCAB)
    rng = random.Random(seed)
    done, steps = b"", 0
    table = {t: _bytelevel(tok.convert_ids_to_tokens(t)) for t in range(1, len(tok))}
    while not guide.stopped:
        bm = torch.zeros((1, bitmask_words(VOCAB)), dtype=torch.int32)
        guide.fill(bm, 0)
        got = set(torch.nonzero(mask_bias(bm, VOCAB)[0] == 0).flatten().tolist())
        want = {t for t, b in table.items() if ok(done + b, False)}
        if ok(done, True):
            want.add(tok.eos_token_id)
        assert got <= want, f"after {done!r}: allowed but invalid {sorted(got - want)[:5]}"
        assert got == want or not exact and got, f"after {done!r}: missing {sorted(want - got)[:5]}"
        nxt = rng.choice(sorted(got))
        guide.consume(nxt)
        steps += 1
        if nxt == tok.eos_token_id:
            break
        done += table[nxt]
    assert ok(done, True)
    return steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_masks_equal_brute_force(byte_tok, seed):
    choices = ["café", "cab", "naïve", "yes"]  # shared prefixes and multi-byte characters split over tokens
    gen = GenerationConfig(choice=choices)
    assert _brute_force_walk(byte_tok, gen, lambda d, full: _choice_ok(d, choices, full), seed, exact=False) >= 2


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_regex_masks_equal_brute_force(byte_tok, seed):
    pattern = r"[0-9]{2,3}-(ab|cd)( [a-z]+)?"
    gen = GenerationConfig(regex=pattern)
    assert _brute_force_walk(byte_tok, gen, lambda d, full: _regex_ok(d, pattern, full), seed) >= 3


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                           "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                                   "required": ["kind"], "additionalProperties": False}},
          "required": ["name", "age", "tags", "pet"], "additionalProperties": False}


def _run(engine, prompts_gens):
    reqs = [engine.add_request(p, g) for p, g in prompts_gens]
    while any(not r.finished for r in reqs):
        engine.step()
    return [engine.output(r) for r in reqs]


def test_engine_constraints_hold_and_mixed_batch_equals_alone(byte_model):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=4096, block_size=16)
    free = ("the cat", GenerationConfig(max_new_tokens=12, ignore_eos=True))
    cases = [("name:", GenerationConfig(json_schema=SCHEMA, max_new_tokens=120)),
             ("num:", GenerationConfig(regex=r"[0-9]{2,3}-(ab|cd)", max_new_tokens=20)),
             ("pick:", GenerationConfig(choice=["café", "naïve", "yes"], max_new_tokens=20)),
             ("json:", GenerationConfig(json_schema={"type": "object"}, max_new_tokens=60, temperature=0.8, seed=3))]
    alone = [_run(e, [c])[0] for c in [free] + cases]
    together = _run(e, [free] + cases)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.text == b.text
    out = dict(zip(["free", "json", "regex", "choice", "object"], together))
    assert out["json"].finish_reason == "stop", out["json"].text
    jsonschema.validate(json.loads(out["json"].text), SCHEMA)
    assert regex.fullmatch(r"[0-9]{2,3}-(ab|cd)", out["regex"].text) and out["regex"].finish_reason == "stop"
    assert out["choice"].text in ("café", "naïve", "yes") and out["choice"].finish_reason == "stop"
    if out["object"].finish_reason == "stop":
        assert isinstance(json.loads(out["object"].text), dict)
    else:  # unfinished within max_new_tokens: length, never claimed complete
        assert out["object"].finish_reason == "length"
    assert len(out["free"].token_ids) == 12


def test_unfinishable_constraint_ends_with_length(byte_model):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=1024, block_size=16)
    out = _run(e, [("x", GenerationConfig(regex="a{40}", max_new_tokens=5))])[0]
    assert out.finish_reason == "length" and 1 <= len(out.text) <= 40 and set(out.text) == {"a"}


def test_constrained_logprobs_cover_only_allowed_tokens(byte_model, byte_tok):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=1024, block_size=16)
    out = _run(e, [("pick:", GenerationConfig(choice=["café", "cab"], logprobs=20, max_new_tokens=8))])[0]
    first = out.logprobs[0]
    allowed = {t for t in range(1, len(byte_tok)) if "café".encode().startswith(_bytelevel(byte_tok.convert_ids_to_tokens(t)))
               or b"cab".startswith(_bytelevel(byte_tok.convert_ids_to_tokens(t)))}
    finite = [(t, lp) for t, lp in first if lp > float("-inf")]
    assert {t for t, _ in finite} == allowed  # all allowed ones, nothing else, and they carry all the mass
    assert abs(sum(torch.tensor([lp for _, lp in finite]).exp().tolist()) - 1.0) < 1e-4


def test_int4_kv_session_and_prefix_cache_keep_constraints(byte_model):
    e = Engine(byte_model, dtype="float32", kv_cache_dtype="int4", max_kv_tokens=2048, block_size=16)
    s = e.session(system="a test")
    for turn in ("first person", "second person"):
        out = s.chat(turn, gen=GenerationConfig(json_schema=SCHEMA, max_new_tokens=150))
        text = out if isinstance(out, str) else out.text
        jsonschema.validate(json.loads(text), SCHEMA)
    a = _run(e, [("name: Ann", GenerationConfig(json_schema=SCHEMA, max_new_tokens=150))])[0]
    b = _run(e, [("name: Ann", GenerationConfig(json_schema=SCHEMA, max_new_tokens=150))])[0]  # prefix-cache hit
    assert b.cached_tokens > 0 or len(e.encode("name: Ann")) < 16
    jsonschema.validate(json.loads(b.text), SCHEMA)
    assert a.finish_reason == b.finish_reason == "stop"


@pytest.mark.parametrize("kw, words", [
    (dict(json_schema={"type": "foo"}), "json_schema"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(regex="(ab"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", 3]), "non-empty list"),
    (dict(regex="a", choice=["a"]), "one constraint"),
])
def test_bad_constraints_are_refused_naming_the_field(byte_model, kw, words):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=512, block_size=16)
    with pytest.raises(LiteturboError, match=words) as got:
        e.add_request("x", GenerationConfig(**kw))
    if "json_schema" in kw and "foo" in str(kw["json_schema"]) or "regex" in kw and "choice" not in kw:
        assert isinstance(got.value, InvalidRequest)
    assert not e.has_unfinished()  # nothing was queued


def test_empty_language_is_refused(byte_model):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=512, block_size=16)
    with pytest.raises(LiteturboError):
        e.add_request("x", GenerationConfig(json_schema={"type": "string", "minLength": 5, "maxLength": 2}))


def test_batch_invariant_and_stop_strings_with_a_constraint(byte_model):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=2048, block_size=16, batch_invariant=True)
    gen = GenerationConfig(json_schema=SCHEMA, max_new_tokens=150)
    alone = _run(e, [("name:", gen)])[0]
    with_others = _run(e, [("the cat", GenerationConfig(max_new_tokens=20, ignore_eos=True)), ("name:", gen),
                           ("yes no", GenerationConfig(regex="[a-z ]{5,30}", max_new_tokens=30))])[1]
    assert alone.token_ids == with_others.token_ids and alone.finish_reason == "stop"
    jsonschema.validate(json.loads(alone.text), SCHEMA)
    # a stop string is the caller's own cut: it ends the reply there (before the constraint is complete)
    cut = _run(e, [("name:", GenerationConfig(json_schema=SCHEMA, max_new_tokens=150, stop=['"age"']))])[0]
    assert cut.finish_reason == "stop" and alone.text.startswith(cut.text) and '"age"' not in cut.text


def test_many_choices_gbnf_and_short_errors(byte_model):
    import time
    e = Engine(byte_model, dtype="float32", max_kv_tokens=1024, block_size=16)
    choices = [f"c{i}" for i in range(20000)] + ["café", "a.b|c", "(x)"]  # regex meta characters stay literal
    t0 = time.perf_counter()
    out = _run(e, [("pick:", GenerationConfig(choice=choices, max_new_tokens=12))])[0]
    assert out.text in choices and out.finish_reason == "stop" and time.perf_counter() - t0 < 10
    for c in ("a.b|c", "(x)"):
        forced = _run(e, [("pick:", GenerationConfig(choice=[c], max_new_tokens=12))])[0]
        assert forced.text == c
    gbnf = _run(e, [("x", GenerationConfig(grammar='root ::= "yes" | "no" | "maybe"', max_new_tokens=8))])[0]
    assert gbnf.text in ("yes", "no", "maybe") and gbnf.finish_reason == "stop"
    with pytest.raises(InvalidRequest) as got:
        e.add_request("x", GenerationConfig(grammar="root ::= (", max_new_tokens=8))
    assert "GBNF" in str(got.value)
    with pytest.raises(InvalidRequest) as got:  # llguidance's reason, without its parser-state dump
        e.add_request("x", GenerationConfig(json_schema={"type": "string", "pattern": "(?=a)b"}))
    assert "<state>" not in str(got.value) and len(str(got.value)) < 400


def test_a_session_turn_that_fails_before_any_text_leaves_the_conversation(byte_model, monkeypatch):
    e = Engine(byte_model, dtype="float32", max_kv_tokens=1024, block_size=16)
    s = e.session(system="a test")
    s.chat("first", max_new_tokens=3)
    before = list(s.messages)

    def refuse(self, token_id):
        raise InvalidRequest(f"the {self.field} constraint refused token {token_id}")

    monkeypatch.setattr(Guide, "consume", refuse)
    with pytest.raises(InvalidRequest, match="refused token"):
        s.chat("second", choice=["yes", "no"], max_new_tokens=3)
    monkeypatch.undo()
    assert s.messages == before and s.last.finish_reason == "error"
    assert s.chat("second", choice=["yes", "no"], max_new_tokens=3) in ("yes", "no")
