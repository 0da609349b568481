"""Answering a generation request: queueing its choices and waiting for them, or streaming them.

:func:`submit_choices` queues the ``n`` choices of one prompt (a ``seed`` gives choice ``i`` the seed ``seed + i``);
:func:`respond` answers a :class:`~turbo.serve.responses.Job` with its server-sent events or, once every choice
ended, its JSON (:func:`wait_all`: a client that disconnects cancels the requests, which frees their KV blocks).
"""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..config import GenerationConfig
from ..engine import GenerationOutput
from ..loop import RequestHandle
from .responses import Job, cancelled_error, engine_error, event_stream, reply_body



async def wait_all(request: Request, handles: list[RequestHandle], job: Job | None = None
                   ) -> list[GenerationOutput] | None:
    """The requests' outputs; ``None`` if the client went away (the requests are cancelled then). A chat ``job``
    with tools reads each reply as it comes and stops one that repeats a call (its finish reason is then ``stop``,
    see :mod:`turbo.tool_parsers`)."""
    async def collect(handle):
        """``handle``'s output once it ends, stopping the reply (finish reason ``stop``) at a repeated tool call."""
        reader = job.tool_parser.streamer(job.tools.max_calls, tools=job.tools.schemas) \
            if job and job.tool_parser else None
        async for piece in handle:
            if reader is not None and not reader.repeated:
                reader.feed(piece)
                if reader.repeated:
                    handle.cancel("stop")
        return handle.output

    task = asyncio.ensure_future(asyncio.gather(*(collect(h) for h in handles)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                break
            if await request.is_disconnected():
                return None
        try:
            outs = task.result()
        except BaseException as e:  # noqa: BLE001 - the request's own error, answered as JSON
            raise engine_error(e) from None
        if any(out.finish_reason == "cancelled" for out in outs):
            raise cancelled_error()
        return outs
    finally:
        if not task.done():
            task.cancel()
        for h in handles:
            if h.output is None:
                h.cancel()


async def respond(request: Request, job: Job, handles: list[RequestHandle]) -> Response:
    """The job's answer: a stream of server-sent events, or its JSON once the generations end."""
    tokens = request.app.state.served.tokens
    if job.stream:
        return event_stream(job, handles, tokens)
    outs = await wait_all(request, handles, job)
    if outs is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(reply_body(job, outs, tokens, handles))


def submit_choices(c, prompt, gen: GenerationConfig, n: int) -> list[RequestHandle]:
    """Queue ``n`` choices of one prompt, all before the engine's next step, so a repeat is batched the same way
    (they share its prefill: the engine holds the later ones until the first computed the prompt, then they take
    its KV blocks from the prefix cache). With a ``seed``, choice ``i`` draws with ``seed + i``, so each choice
    repeats on a repeat."""
    if n == 1:
        return [c.submit(prompt, gen)]
    gens = [gen if i == 0 or gen.seed is None else dataclasses.replace(gen, seed=(gen.seed + i) % 2**63)
            for i in range(n)]
    return c.submit_many(prompt, gens)
