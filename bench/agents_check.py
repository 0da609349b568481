"""The agents' API end to end: the official ``openai`` client against ``liteturbo serve`` (a subprocess), checking
structured outputs, tool calls, ``n`` > 1, ``logit_bias`` and vLLM's guided fields on real replies.

    python bench/agents_check.py [--checkpoint DIR] [--kv-cache-dtype auto|int8|int4] [--prompts 20] [--json]

Without ``--checkpoint`` the embedded SmolLM2-135M-Instruct is quantized (RTN W4A16 g64) into a temporary folder.
Checks (each counted, the last JSON line holds them all and ``all_ok``):

1. ``response_format`` json_schema (strict; nested object, array, enum, required fields) over ``--prompts``
   different prompts: every reply parses and validates (``jsonschema``), streamed and not;
2. ``tool_choice="required"`` with two tools: every reply is a call naming one of them with arguments that validate
   against its parameters; the streamed ``tool_calls`` deltas joined (as the client joins them) equal the
   non-streamed call made from the same cache state (both after a first request cached the prompt; whether that
   first reply was the same is reported as ``tools_first_equals_cached``); a named ``tool_choice`` calls that tool;
3. ``n=3`` with ``seed``: three choices, the same on a repeat;
4. ``logit_bias`` of -100 on the first token of the greedy reply keeps that token out of the reply;
5. ``guided_regex`` and ``guided_choice`` (vLLM's fields, through ``extra_body``) hold.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import regex

from common import free_port, wait_healthy, w4a16_checkpoint

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "skills", "address", "role"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                         "role": {"enum": ["engineer", "artist", "teacher", "doctor", "other"]},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                                     "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "country": {"type": "string", "maxLength": 24}}}}}
SUBJECTS = ["a nurse from Kenya", "a Japanese carpenter", "a Brazilian footballer", "an old fisherman",
            "a startup founder", "a French chef", "a kindergarten teacher", "a night-shift doctor", "a glassblower",
            "a Canadian hockey coach", "a street musician", "a data scientist", "an astronaut", "a tailor in Milan",
            "a village baker", "a museum guide", "a crossword author", "a river pilot", "a comic artist",
            "a wind-turbine technician", "a beekeeper in Crete", "a lighthouse keeper", "a court reporter",
            "a dog trainer"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a time zone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                       "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}]
ASKS = ["What's the weather in Paris?", "What time is it in Tokyo?", "Is it cold in Oslo right now?",
        "Tell me the time in New York.", "How warm is it in Cairo?", "What's the local time in Sydney?"]


def _valid(obj, schema) -> bool:
    import jsonschema
    try:
        jsonschema.validate(obj, schema)
        return True
    except jsonschema.ValidationError:
        return False


def _json_ok(text: str | None) -> bool:
    try:
        return _valid(json.loads(text or ""), PERSON)
    except ValueError:
        return False


def check_schema(client, model: str, n: int) -> dict:
    """Check 1: ``n`` strict json_schema replies, non-streamed and streamed, validated with jsonschema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ok = ok_stream = 0
    for i in range(n):
        msgs = [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} as a JSON object."}]
        r = client.chat.completions.create(model=model, messages=msgs, response_format=fmt, max_tokens=300,
                                           temperature=0.7, seed=i)
        ok += r.choices[0].finish_reason == "stop" and _json_ok(r.choices[0].message.content)
        text, finish = "", None
        for chunk in client.chat.completions.create(model=model, messages=msgs, response_format=fmt, max_tokens=300,
                                                    temperature=0.7, seed=100 + i, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        ok_stream += finish == "stop" and _json_ok(text)
    return {"json_schema": f"{ok}/{n}", "json_schema_stream": f"{ok_stream}/{n}", "ok": ok == n and ok_stream == n}


def _call_ok(name: str, args: str) -> bool:
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        return name in spec and _valid(json.loads(args), spec[name])
    except ValueError:
        return False


def _stream_calls(client, **kw) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            got = calls.setdefault(tc.index, ["", ""])
            got[0] += (tc.function.name or "") if tc.function else ""
            got[1] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)], finish


def check_tools(client, model: str) -> dict:
    """Check 2: tool_choice required (valid calls; stream joined == non-streamed) and a named tool_choice."""
    ok = joined = cached_same = 0
    for ask in ASKS:
        kw = dict(model=model, messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=0)
        first = client.chat.completions.create(**kw)
        # the prompt's full KV blocks are cached now: the reply below and the stream both read them (with an int8/int4
        # cache, a reply over cached KV can differ from the first one, computed in one prefill: not a tool matter)
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        cached_same += [(c.function.name, c.function.arguments) for c in first.choices[0].message.tool_calls or []] \
            == calls
        ok += bool(calls) and all(_call_ok(n, a) for n, a in calls) and r.choices[0].finish_reason == "tool_calls"
        streamed, finish = _stream_calls(client, **kw)
        joined += (finish == "tool_calls" and [n for n, _ in streamed] == [n for n, _ in calls]
                   and [json.loads(a) for _, a in streamed] == [json.loads(a) for _, a in calls])
    named = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASKS[0]}], tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=200, temperature=0)
    named_calls = named.choices[0].message.tool_calls or []
    named_ok = len(named_calls) >= 1 and all(c.function.name == "get_time" and _call_ok("get_time", c.function.arguments)
                                             for c in named_calls)
    k = len(ASKS)
    return {"tools_required": f"{ok}/{k}", "tools_stream_joined": f"{joined}/{k}", "tools_named": named_ok,
            "tools_first_equals_cached": f"{cached_same}/{k}", "ok": ok == k and joined == k and named_ok}


def check_n_bias_guided(client, model: str) -> dict:
    """Checks 3-5: n=3 with a seed repeats; logit_bias -100 bans a token; guided_regex / guided_choice hold."""
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    a = client.chat.completions.create(model=model, messages=msgs, n=3, seed=7, temperature=0.9, max_tokens=24)
    b = client.chat.completions.create(model=model, messages=msgs, n=3, seed=7, temperature=0.9, max_tokens=24)
    ta, tb = [c.message.content for c in a.choices], [c.message.content for c in b.choices]
    n_ok = len(ta) == 3 and [c.index for c in a.choices] == [0, 1, 2] and ta == tb
    greedy = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, logprobs=True)
    first = greedy.choices[0].logprobs.content[0]
    tok_id = _token_id(client, model, first.bytes)
    biased = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
                                            logit_bias={str(tok_id): -100})
    bias_ok = tok_id is not None and all(e.bytes != first.bytes for e in biased.choices[0].logprobs.content)
    rx = r"[A-Z][a-z]{2,9} [0-9]{1,3}"
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a street and number."}],
                                       max_tokens=30, temperature=0.8, seed=1, extra_body={"guided_regex": rx})
    regex_ok = bool(regex.fullmatch(rx, r.choices[0].message.content or ""))
    choices = ["positive", "negative", "neutral"]
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Sentiment of: I love it!"}],
                                       max_tokens=10, temperature=0, extra_body={"guided_choice": choices})
    choice_ok = c.choices[0].message.content in choices
    return {"n3_seed_repeat": n_ok, "n3_texts": ta, "logit_bias_ban": bias_ok, "banned_token": tok_id,
            "guided_regex": regex_ok, "guided_choice": choice_ok, "ok": n_ok and bias_ok and regex_ok and choice_ok}


def _token_id(client, model: str, raw: list[int]) -> int | None:
    """The id of the token whose bytes are ``raw``: the completions endpoint echoes ids nowhere, so find it by
    sampling: the tokenizer of the served checkpoint (loaded here, read-only) maps bytes back."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.environ["AGENTS_CHECK_MODEL"])
    ids = tok.encode(bytes(raw).decode("utf-8", errors="strict"), add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import openai
    path, _tmp = w4a16_checkpoint("smollm2-135m-instruct", 64, args.checkpoint)
    os.environ["AGENTS_CHECK_MODEL"] = str(path)
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "turbo.cli", "serve", str(path), "--port", str(port),
                             "--kv-cache-dtype", args.kv_cache_dtype], stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        out = {"kv_cache_dtype": args.kv_cache_dtype}
        for part in (check_schema(client, model, args.prompts), check_tools(client, model),
                     check_n_bias_guided(client, model)):
            ok = part.pop("ok")
            out.update(part)
            out["all_ok"] = out.get("all_ok", True) and ok
            if not args.json:
                print(json.dumps(part))
        print(json.dumps(out))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
