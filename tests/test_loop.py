"""The background engine loop: submitted requests and session turns, sync and async, cancellation, typed errors."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from turbo import Engine, EngineConfig, GenerationConfig
from turbo.errors import Conflict, InvalidRequest, OverCapacity, http_status
from turbo.loop import EngineLoop

G = GenerationConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(smollm2_rtn_g64):
    return Engine(smollm2_rtn_g64, EngineConfig(max_kv_tokens=8192, dtype="float32"))


@pytest.fixture()
def loop(engine):
    lp = EngineLoop(engine).start()
    yield lp
    lp.stop()
    assert not engine.has_unfinished()


def _wait_idle(engine, timeout=5.0):
    t = time.time()
    while engine.has_unfinished() and time.time() - t < timeout:
        time.sleep(0.02)
    return not engine.has_unfinished()


def test_sync_stream_equals_generate_and_runs_off_the_caller_thread(engine, loop, monkeypatch):
    ref = engine.generate("The capital of France is", G)
    threads = set()
    real = engine.step

    def spy():
        threads.add(threading.current_thread().name)
        return real()

    monkeypatch.setattr(engine, "step", spy)
    h = loop.submit("The capital of France is", G)
    text = "".join(h)
    assert text == ref.text and h.output.token_ids == ref.token_ids and h.output.finish_reason == "length"
    assert threads == {"liteturbo-engine-loop"}


@pytest.mark.e2e
def test_async_concurrent_requests_and_session_turns(engine, loop):
    prompts = [f"List {i} fruits:" for i in range(3)]
    refs = [engine.generate(p, G).text for p in prompts]

    async def one(p):
        h = loop.submit(p, G)
        return "".join([x async for x in h]), h.output

    async def main():
        outs = await asyncio.gather(*[one(p) for p in prompts])
        s = engine.session()
        replies = []
        for m in ["Hi! Who are you?", "What is 2+2?"]:
            h = loop.submit_chat(s, m, G)
            replies.append("".join([x async for x in h]))
        return outs, s, replies

    outs, s, replies = asyncio.run(main())
    assert [o[0] for o in outs] == refs  # float32: batching does not change greedy tokens here
    assert all(o[0] == o[1].text for o in outs)
    ref_s = engine.session()
    assert replies == [ref_s.chat(m, gen=G) for m in ["Hi! Who are you?", "What is 2+2?"]]
    assert s.messages == ref_s.messages and s.last.cached_tokens > 0
    s.close()
    ref_s.close()


def test_cancel_frees_blocks_and_session_stays_consistent(engine, loop):
    total = engine.block_manager.num_blocks
    h = loop.submit("Once upon a time, a dragon", GenerationConfig(max_new_tokens=200, ignore_eos=True))
    it = iter(h)
    next(it)
    it.close()  # the consumer goes away
    assert _wait_idle(engine) and engine.block_manager.num_free == total
    s = engine.session()
    h = loop.submit_chat(s, "Tell me a long story.", GenerationConfig(max_new_tokens=200, ignore_eos=True),
                         keep_partial=True)
    it = iter(h)
    first = next(it)
    it.close()
    assert _wait_idle(engine)
    assert s.last.finish_reason == "cancelled" and s.messages[-1]["role"] == "assistant"
    assert s.messages[-1]["content"].startswith(first)
    assert not s.busy
    s.close()


def test_typed_errors(engine, loop):
    with pytest.raises(InvalidRequest) as e:
        loop.submit("", G)
    assert http_status(e.value) == 400
    s = engine.session()
    h = loop.submit_chat(s, "Tell me a long story.", GenerationConfig(max_new_tokens=100, ignore_eos=True))
    with pytest.raises(Conflict) as e:
        loop.submit_chat(s, "And another?", G)
    assert http_status(e.value) == 409
    h.cancel()
    assert _wait_idle(engine)
    small = EngineLoop(engine, max_waiting=0).start()
    try:
        with pytest.raises(OverCapacity) as e:
            small.submit("hi", G)
        assert http_status(e.value) == 503 and e.value.retry_after > 0
    finally:
        small.stop()
    s.close()


def test_a_failing_step_ends_its_requests_with_the_error(engine, loop, monkeypatch):
    def boom(step):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.runner, "run", boom)
    h = loop.submit("The sky is", G)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        h.result()
    monkeypatch.undo()
    assert _wait_idle(engine) and engine.block_manager.num_free == engine.block_manager.num_blocks
    assert "".join(loop.submit("The sky is", G))  # the loop survived


def test_engine_astream_runs_on_the_engine_loop_not_the_event_loop(engine, monkeypatch):
    threads = set()
    real = engine.step

    def spy():
        threads.add(threading.current_thread().name)
        return real()

    monkeypatch.setattr(engine, "step", spy)

    async def main():
        return [x async for x in engine.astream("The sky is", G)]

    items = asyncio.run(main())
    assert items[-1].text == "".join(items[:-1]) and items[-1].finish_reason == "length"
    assert threads == {"liteturbo-engine-loop"}
    engine.loop.stop()
