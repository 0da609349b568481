"""Tool calls under ``tool_choice: "auto"`` never come back malformed: N requests with random tool sets against the
served model, each reply checked.

    python bench/tools_auto.py [--requests 1000] [--model smollm2-135m-instruct] [--dtype bfloat16] [--workers 8]
                               [--seed 0] [--json]

Each request draws 1-4 tools from :data:`POOL` (strings, enums, integers with bounds, nested objects, arrays, no
arguments), a prompt that asks for one of them or for something else, ``parallel_tool_calls`` true or false, a
temperature in [0, 1.2] and ``max_tokens`` 48-160, and is sent through the server's app (in process, the official
``openai`` client, ``--workers`` at a time). A reply is **malformed** unless it is plain text without tool-call markup
(``<tool_call``, ``</tool_call``, ``[TOOL_CALLS]``, ``<|python_tag|>``) or calls that name a tool of the request,
whose arguments parse as a JSON object and validate against that tool's schema read with ``additionalProperties:
false`` (the rule of turbo/serve/schema_walk.py), with at most one call when parallel calls are off. One JSON line:
``requests``, ``malformed`` (with the first few in ``examples``), ``with_calls``, ``finish_length``, ``seconds``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from turbo import Engine, EngineConfig
from turbo.serve.app import create_app
from turbo.serve.schema_walk import close_objects

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests")
from conftest import serve_in_thread  # noqa: E402 - the tests' uvicorn-in-a-thread helper

S = {"type": "string"}
POOL = [
    ("get_weather", "Current weather in a city", {"type": "object", "properties": {
        "city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}),
    ("get_time", "Local time in a time zone", {"type": "object", "properties": {"timezone": S}, "required": ["timezone"]}),
    ("search_web", "Search the web", {"type": "object", "properties": {
        "query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["query"]}),
    ("add", "Add two numbers", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                "required": ["a", "b"]}),
    ("send_email", "Send an email", {"type": "object", "properties": {
        "to": S, "subject": S, "body": S, "cc": {"type": "array", "items": S}}, "required": ["to", "subject"]}),
    ("book_table", "Book a restaurant table", {"type": "object", "properties": {
        "restaurant": S, "people": {"type": "integer", "minimum": 1, "maximum": 20},
        "when": {"type": "object", "properties": {"date": S, "time": S}, "required": ["date"]}},
        "required": ["restaurant", "people"]}),
    ("convert_currency", "Convert money", {"type": "object", "properties": {
        "amount": {"type": "number"}, "from": {"enum": ["USD", "EUR", "JPY"]}, "to": {"enum": ["USD", "EUR", "JPY"]}},
        "required": ["amount", "from", "to"]}),
    ("list_files", "List the files of a folder", {"type": "object", "properties": {"path": S, "recursive": {
        "type": "boolean"}}, "required": ["path"]}),
    ("ping", "Check the server is up", {"type": "object", "properties": {}}),
]
ASKS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Search the web for llama recipes.",
        "What is 12.5 plus 7?", "Email bob@example.com that the meeting moved.", "Book a table for 4 at Luigi's tomorrow.",
        "Convert 100 USD to EUR.", "List the files in /tmp.", "Is the server up?", "Tell me a joke.",
        "Write one sentence about the sea.", "What is the capital of Japan?", "Weather in Oslo in fahrenheit, please.",
        "Say hello in French."]
MARKUP = ("<tool_call", "</tool_call", "[TOOL_CALLS]", "<|python_tag|>")


def request(rng: random.Random) -> dict:
    """One random chat completion body with tools under ``tool_choice: "auto"`` (see the module docstring)."""
    tools = rng.sample(POOL, rng.randint(1, 4))
    return {"messages": [{"role": "user", "content": rng.choice(ASKS)}],
            "tools": [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
                      for n, d, p in tools],
            "tool_choice": "auto", "parallel_tool_calls": rng.random() < 0.5,
            "temperature": round(rng.uniform(0, 1.2), 2), "max_tokens": rng.randint(48, 160), "seed": rng.randint(0, 9999)}


def problem(req: dict, choice) -> str | None:
    """Why a reply is malformed, or ``None``."""
    msg = choice.message
    if msg.content and any(m in msg.content for m in MARKUP):
        return f"markup in content: {msg.content[:120]!r}"
    calls = msg.tool_calls or []
    if len(calls) > 1 and not req["parallel_tool_calls"]:
        return f"{len(calls)} calls with parallel_tool_calls false"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in req["tools"]}
    for c in calls:
        if c.function.name not in schemas:
            return f"unknown tool {c.function.name!r}"
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            return f"arguments not JSON: {c.function.arguments[:120]!r}"
        if not isinstance(args, dict):
            return f"arguments not an object: {c.function.arguments[:120]!r}"
        try:
            jsonschema.validate(args, close_objects(schemas[c.function.name]))
        except jsonschema.ValidationError as e:
            return f"{c.function.name} arguments {c.function.arguments[:120]!r}: {e.message[:120]}"
    return None


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    engine = Engine(args.model, EngineConfig(dtype=args.dtype, max_batch_size=args.workers))
    url, stop = serve_in_thread(create_app(engine, model_name="m", api_keys=""))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(args.seed)
    reqs = [request(rng) for _ in range(args.requests)]
    tally = dict(requests=0, malformed=0, with_calls=0, finish_length=0, errors=0)
    examples: list[str] = []
    lock = threading.Lock()

    def run(req):
        try:
            r = client.chat.completions.create(model="m", **req)
        except openai.APIError as e:
            with lock:
                tally["errors"] += 1
                examples.append(f"HTTP error: {e}"[:200])
            return
        why = problem(req, r.choices[0])
        with lock:
            tally["requests"] += 1
            tally["with_calls"] += bool(r.choices[0].message.tool_calls)
            tally["finish_length"] += r.choices[0].finish_reason == "length"
            if why:
                tally["malformed"] += 1
                if len(examples) < 5:
                    examples.append(why)

    t0 = time.time()
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(run, reqs))
    finally:
        stop()
    row = dict(tally, seconds=round(time.time() - t0, 1), model=args.model, dtype=args.dtype, examples=examples)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
