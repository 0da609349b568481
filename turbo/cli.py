"""The ``liteturbo`` command line: ``liteturbo chat`` (``--url``: on a server, :mod:`turbo.remote`), ``liteturbo
serve`` (the HTTP API, :mod:`turbo.serve`), ``liteturbo route`` (:mod:`turbo.router`), ``liteturbo plan`` (will a
model fit: :mod:`turbo.plan`), ``liteturbo pack`` (save the engine's layout of the weights beside them:
:mod:`turbo.core.serving_layout`; the ``lite`` commands do it after writing), ``liteturbo env`` (hardware, versions, backends and their op coverage) and
``liteturbo lite ...``: the quantizer's group from :mod:`lite.cli`, mounted here with one command added,
``lite eval-ppl`` (perplexity through turbo's engine, :mod:`turbo.perplexity`).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform as pyplat
import sys
from pathlib import Path

import click

import calib_data
from lite.cli import DEFAULT_MODEL, friendly_errors, lite
from lite.formats import LiteturboError
from lite.formats.checkpoint import weight_files
from lite.memory import quantize_fit

from .cli_options import device_options as _device_options
from .tool_parsers import PARSERS as TOOL_PARSERS
from .cli_options import kv_options as _kv_options


KV_TRANSFORM_NOTE = {"none": "", "rotated": ", rotated (Hadamard)", "calibrated": ", calibrated keys"}


def kv_summary(engine) -> str:
    """One line about the KV pool: dtype, bytes per token, tokens held."""
    st = engine.stats()
    cal = KV_TRANSFORM_NOTE[st["kv_transform"]]
    return (f"KV cache {st['kv_cache_dtype']}{cal}: {st['kv_bytes_per_token']} bytes/token, pool "
            f"{st['blocks_total']} blocks x {st['block_size']} = {st['kv_pool_tokens']} tokens "
            f"({st['kv_cache_bytes'] / 2**20:.1f} MiB)")


@click.group()
def main() -> None:
    """liteturbo: quantize LLMs (lite) and run them (turbo) on constrained hardware."""


main.add_command(lite)


def _pack(model, config) -> None:
    """Save and report the serving layout of ``model`` for an engine with ``config`` (:mod:`turbo.core.serving_layout`)."""
    import time

    from turbo.core import pack_serving_layout

    t = time.perf_counter()
    folder = pack_serving_layout(config, model)
    if folder is None:
        why = ("tensor-parallel ranks each load their shard from the checkpoint" if config.tensor_parallel_size > 1
               else "this device's backend loads the checkpoint itself")
        click.echo(f"[liteturbo] no serving layout written: {why}", err=True)
    else:
        size = sum(f.stat().st_size for f in folder.iterdir())
        click.echo(f"[liteturbo] serving layout for this machine's engine: {folder} ({size / 2**30:.2f} GiB, "
                   f"{time.perf_counter() - t:.1f} s); {_who_maps(config)}", err=True)


def _who_maps(config) -> str:
    """Which loads map a layout packed for ``config`` (the layout's key is the backend, dtype and head kind)."""
    if config.lm_head == "16bit":
        return ("loads with a 16-bit head map it: turbo.Engine(..., lm_head=\"16bit\") (liteturbo chat and serve run "
                "the default head)")
    if config.batch_invariant:
        return "loads in batch-invariant mode map it: liteturbo serve --batch-invariant, or turbo.Engine(..., " \
               "batch_invariant=True)"
    return "loads with the same --dtype map it (liteturbo chat, serve, turbo.Engine)"


@lite.result_callback()
def _after_writing(result, **_) -> None:
    """After a ``lite`` command that wrote a checkpoint (it returns the folder unless ``--no-serving-layout``):
    save the serving layout for this machine's default engine, so the first load maps it. The checkpoint is
    complete either way, so a layout that cannot be saved is a warning, not a failed command."""
    if isinstance(result, Path):
        from .config import EngineConfig

        try:
            _pack(result, EngineConfig())
        except LiteturboError as e:
            click.echo(f"warning: the checkpoint {result} is complete, but its serving layout was not saved ({e}); "
                       f"loads will repack it, `liteturbo pack {result}` retries", err=True)


@main.command()
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--lm-head", default="auto", show_default=True, type=click.Choice(["auto", "int8", "16bit"]),
              help="The output head the engine will run (auto: int8 for quantized checkpoints on CPUs).")
@click.option("--batch-invariant", is_flag=True, help="For engines started in batch-invariant mode.")
@_device_options
@friendly_errors
def pack(model, dtype, lm_head, batch_invariant, device_opts) -> None:
    """Save MODEL's weights as the engine holds them here (CPU: 4-bit tiles, fused q/k/v and gate/up, int8 head)
    in MODEL/serving/, so that loads with the same options map them instead of repacking (`liteturbo lite` does
    this after quantizing; docs/engine.md, "Loading")."""
    from .config import EngineConfig

    try:
        config = EngineConfig(dtype=dtype, lm_head=lm_head, batch_invariant=batch_invariant, **device_opts)
    except ValueError as e:
        raise LiteturboError(f"bad option: {e}") from None
    _pack(model, config)


@lite.command("eval-ppl")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--dataset", default="wikitext2", show_default=True,
              type=click.Choice(["wikitext2", "wikitext2-valid", "zh"]),
              help="Evaluation text: WikiText-2 test (the standard), WikiText-2 valid, or the Chinese sample (zh); "
                   "rows joined with \"\\n\\n\". Score on a text the model was not calibrated on.")
@click.option("--seqlen", default=2048, show_default=True, help="Tokens per window.")
@click.option("--max-windows", default=None, type=int, help="Score only the first N windows.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help='Print {"model", "dataset", "seqlen", "ppl", "tokens", "windows", "seconds", "kv_cache_dtype", '
                   '"kv_calibrated", "kv_transform"} as JSON.')
@_device_options
@_kv_options
@friendly_errors
def eval_ppl(model, dataset, seqlen, max_windows, dtype, as_json, device_opts, kv_opts) -> None:
    """Perplexity of MODEL on a bundled dataset's test text (WikiText-2: rows joined with "\\n\\n").

    Windows are scored in chunks through the engine's paged KV cache, so with --kv-cache-dtype int8/int4 every
    token attends to the earlier tokens' keys and values as the quantized cache returns them."""
    from turbo import Engine, EngineConfig
    from turbo.perplexity import perplexity

    if seqlen < 2:
        raise LiteturboError(f"--seqlen must be at least 2 tokens, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise LiteturboError(f"--max-windows must be at least 1, got {max_windows} (leave it out to score all)")
    from lite.formats import load_config, resolve_model

    ecfg = EngineConfig(dtype=dtype, **device_opts, max_kv_tokens=seqlen, lm_head="16bit", **kv_opts)
    ctx = load_config(resolve_model(model)).get("max_position_embeddings")
    if ctx and seqlen > ctx:  # before the engine sizes a KV pool of --seqlen tokens
        raise LiteturboError(f"--seqlen {seqlen} exceeds the model's context of {ctx} tokens; give at most {ctx}")
    engine = Engine(model, ecfg)
    r = perplexity(engine, calib_data.eval_text(dataset), seqlen, max_windows, progress=not as_json)
    st = engine.stats()
    if as_json:
        click.echo(json.dumps({"model": str(model), "dataset": dataset, "seqlen": seqlen, "ppl": r["ppl"],
                                "tokens": r["tokens"], "windows": r["windows"], "seconds": r["seconds"],
                                "kv_cache_dtype": st["kv_cache_dtype"], "kv_calibrated": st["kv_calibrated"],
                                "kv_transform": st["kv_transform"]}))
    else:
        cal = KV_TRANSFORM_NOTE[st["kv_transform"]]
        click.echo(f"{model}: {dataset} PPL {r['ppl']:.3f} over {r['windows']} window{'s' if r['windows'] != 1 else ''} of {seqlen} tokens, "
                   f"KV cache {st['kv_cache_dtype']}{cal} ({r['seconds']:.0f} s)")


@main.command()
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--max-new-tokens", default=256, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int)
@click.option("--system", default=None, help="System prompt.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--session-len", default=None, type=int, help="Longest conversation in tokens.")
@click.option("--max-kv-tokens", default=None, type=int,
              help="KV pool size in tokens (default: 90% of the memory left on a GPU/NPU, 16384 on a CPU).")
@click.option("--kv-cache-gib", default=None, type=float, help="KV pool size in GiB.")
@click.option("--cache-max-entry-count", default=None, type=float,
              help="KV pool as a fraction of the memory left after the weights (0-1].")
@click.option("--url", default=None,
              help="Chat with a running `liteturbo serve` at this address (e.g. http://127.0.0.1:23333).")
@click.option("--api-key", default=None, envvar="LITETURBO_API_KEY", help="Bearer token for --url.")
@click.option("--speculative", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Draft up to this many tokens per step from the conversation (speculative decoding, verified "
                   "exactly; 0: off).")
@_device_options
@_kv_options
@friendly_errors
def chat(model, max_new_tokens, temperature, top_k, top_p, seed, system, dtype, session_len, max_kv_tokens,
         kv_cache_gib, cache_max_entry_count, url, api_key, speculative, device_opts, kv_opts) -> None:
    """Interactive chat with MODEL on one stateful session (/reset, /exit). Reads piped stdin too. With --url, chat
    with a running `liteturbo serve` through its sessions API instead (MODEL and the engine options are unused)."""
    from turbo import Engine, EngineConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, speculative=speculative)
    if url:
        from turbo.remote import RemoteSession

        session = RemoteSession(url, system, api_key=api_key)
        click.echo(f"[liteturbo] session {session.id} on {session.url}; /reset clears the history, /exit quits",
                   err=True)
    else:
        engine = Engine(model, EngineConfig(dtype=dtype, **device_opts, session_len=session_len,
                                            max_kv_tokens=max_kv_tokens, kv_cache_gib=kv_cache_gib,
                                            cache_max_entry_count=cache_max_entry_count, **kv_opts))
        session = engine.session(system)
    interactive = sys.stdin.isatty()
    if not url:
        click.echo(f"[liteturbo] {engine.path} ({engine.model.quant_method or '16/32-bit'} weights, compute "
                   f"{str(engine.dtype).removeprefix('torch.')}, {engine.backend.name} backend on "
                   f"{engine.platform.device}); "
                   f"{kv_summary(engine)}; /reset clears the history, /exit quits", err=True)
    total_tokens, total_s = 0, 0.0
    while True:
        if interactive:
            click.echo(">>> ", nl=False)
        line = sys.stdin.readline()
        if not line:
            break
        # undecodable input bytes (kept as surrogates by the locale's stdin decoder) become U+FFFD
        line = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace").strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0].lower()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.reset()
                click.echo("[session reset]")
                continue
            click.echo(f"unknown command {cmd}; commands: /reset, /exit", err=True)
            continue
        if not interactive:
            click.echo(f"user: {line}")
            click.echo("assistant: ", nl=False)
        try:
            for piece in session.chat(line, stream=True, gen=gen):
                click.echo(piece, nl=False)
        except LiteturboError as e:
            click.echo(f"\nerror: {e}; type /reset to start a new conversation", err=True)
            continue
        click.echo()
        out = session.last
        if out is not None:
            total_tokens += max(len(out.token_ids) - 1, 0)
            total_s += out.decode_seconds
            click.echo(f"[{len(out.token_ids)} tokens, prefill {out.prompt_tokens - out.cached_tokens} "
                       f"(cached {out.cached_tokens}), TTFT {out.ttft * 1000:.0f} ms, decode "
                       f"{out.decode_tokens_per_s:.1f} tok/s]", err=interactive)
    if total_s > 0:
        click.echo(f"[liteturbo] decode speed over the chat: {total_tokens / total_s:.1f} tokens/s", err=interactive)
    if url:
        session.close()  # the server forgets the conversation when the chat ends


@main.command()
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then give --api-keys).")
@click.option("--port", default=23333, show_default=True, type=int)
@click.option("--model-name", default=None, help="The model id clients pass as `model` (default: MODEL's folder name).")
@click.option("--api-keys", default=None, envvar="LITETURBO_API_KEYS", show_envvar=True,
              help="Comma-separated Bearer tokens; /v1 requests without one of them get 401.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--max-batch-size", default=64, show_default=True, type=int, help="Sequences run together at most.")
@click.option("--max-num-batched-tokens", default=1024, show_default=True, type=int,
              help="Tokens computed per step (prompts are prefilled in chunks of this size).")
@click.option("--block-size", default=64, show_default=True, type=int, help="Tokens per KV cache block.")
@click.option("--session-len", default=None, type=int, help="Longest sequence (prompt + reply) in tokens.")
@click.option("--max-kv-tokens", default=None, type=int,
              help="KV pool size in tokens (default: 90% of the memory left on a GPU/NPU, 16384 on a CPU).")
@click.option("--kv-cache-gib", default=None, type=float, help="KV pool size in GiB.")
@click.option("--cache-max-entry-count", default=None, type=float,
              help="KV pool as a fraction of the memory left after the weights (0-1].")
@click.option("--max-request-bytes", default=1 << 20, show_default=True, type=int,
              help="Larger request bodies get 413.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]))
@click.option("--session-dir", default=None, type=click.Path(file_okay=False),
              help="Save every session there after each turn (with its KV) and restore them at start.")
@click.option("--max-sessions", default=256, show_default=True, type=int,
              help="Sessions keeping their KV cache resident; past it the least recently used give it up.")
@click.option("--session-idle-timeout", default=3600.0, show_default=True, type=float,
              help="Seconds a session may stay unused before it is forgotten.")
@click.option("--batch-invariant", is_flag=True,
              help="Outputs independent of batching (bit-exact in 16-bit: a seed then gives the same text whatever "
                   "runs beside it); about half the prefill speed on a CPU.")
@click.option("--engine-process/--no-engine-process", default=True, show_default=True,
              help="Run the engine core in a process of its own (the HTTP front never waits for a step), or in "
                   "the server's process.")
@click.option("--session-host-gib", default=0.0, show_default=True, type=float,
              help="Host-memory budget for idle sessions' KV: when the pool needs room, an idle session's KV moves "
                   "there (stored form) and its next turn copies it back instead of recomputing (0: off).")
@click.option("--session-overflow", type=click.Choice(["refuse", "drop-oldest"]), default="refuse",
              show_default=True, help="A session turn past --session-len: refuse it (400 with both numbers) or drop "
                                      "the oldest whole turns, keeping the system prompt.")
@click.option("--speculative", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Default draft tokens per step (drafted from the request's history and the server's recent "
                   "outputs, verified exactly at any temperature; a request's 'speculative' overrides it; 0: off). "
                   "See docs/engine.md, Speculative decoding.")
@click.option("--speculative-drafter", type=click.Choice(["suffix", "ngram"]), default="suffix", show_default=True,
              help="Where drafts come from: the longest earlier match in the request's history or the server's "
                   "recent outputs (suffix), or prompt lookup in the request's own history (ngram).")
@click.option("--speculative-recent-tokens", default=65536, show_default=True, type=click.IntRange(min=0),
              help="Tokens of recent outputs kept for drafts (0: none; drafts from other requests' outputs make a "
                   "request faster when another produced the same text, a timing signal between users).")
@click.option("--tool-call-parser", type=click.Choice(list(TOOL_PARSERS)), default=None,
              help="The format the model writes tool calls in (default: the one its chat template writes, else "
                   "hermes, which the fallback tool prompt asks for).")
@click.option("--reasoning-parser", type=click.Choice(["auto", "none", "deepseek_r1", "qwen3"]), default="auto",
              show_default=True, help="Split a thinking model's <think> text into reasoning_content (auto: when the "
                                      "chat template thinks; none: keep it in content).")
@click.option("--stall-timeout", default=20.0, show_default=True, type=click.FloatRange(min=0.5),
              help="Seconds the engine process may make no progress (idle too: the front pings it) before /health "
                   "answers 503 and open requests end with a 503 (a hung or stopped engine); raise it when one "
                   "prefill chunk of a big model takes longer.")
@_device_options
@_kv_options
@friendly_errors
def serve(model, host, port, model_name, api_keys, batch_invariant, engine_process, session_host_gib, session_overflow,
          speculative, speculative_drafter, speculative_recent_tokens, tool_call_parser, reasoning_parser, stall_timeout,
          dtype, max_batch_size, max_num_batched_tokens,
          block_size, session_len, max_kv_tokens, kv_cache_gib, cache_max_entry_count, max_request_bytes, log_level,
          session_dir, max_sessions, session_idle_timeout, device_opts, kv_opts) -> None:
    """Serve MODEL over HTTP: OpenAI-compatible /v1/chat/completions and /v1/completions (streaming or not) and
    stateful /v1/sessions (docs/serving.md)."""
    try:
        from turbo.serve.app import serve as run
    except ImportError as e:
        raise LiteturboError(f"the server needs the serve extra ({e}); install it with "
                             f"pip install 'liteturbo[serve]'") from None
    if max_sessions < 1 or not session_idle_timeout > 0:
        raise LiteturboError(f"--max-sessions must be >= 1 and --session-idle-timeout > 0, got {max_sessions} and "
                             f"{session_idle_timeout}")
    run(model, host=host, port=port, model_name=model_name, api_keys=api_keys or "",
        max_request_bytes=max_request_bytes, log_level=log_level, session_dir=session_dir, max_sessions=max_sessions,
        session_idle_timeout=session_idle_timeout, engine_process=engine_process, tool_call_parser=tool_call_parser,
        speculative=speculative, stall_timeout=stall_timeout, reasoning_parser=reasoning_parser,
        dtype=dtype, **device_opts,
        batch_invariant=batch_invariant, session_host_gib=session_host_gib, session_overflow=session_overflow,
        speculative_drafter=speculative_drafter, speculative_recent_tokens=speculative_recent_tokens,
        max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        session_len=session_len, max_kv_tokens=max_kv_tokens, kv_cache_gib=kv_cache_gib,
        cache_max_entry_count=cache_max_entry_count, **kv_opts)


@main.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def route(args) -> None:
    """Route clients to `liteturbo serve` replicas by session (turbo/router.py; `liteturbo route --help`)."""
    from turbo.router import route_command
    route_command.main(list(args), prog_name="liteturbo route")


@main.command()
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--gpu-mem", default=None,
              help="Plan for a device with this much memory (24GiB, 24GB, 24000MiB; a bare number is GiB). Default: "
                   "the memory free on --device now.")
@click.option("--device", default=None,
              help="cpu, cuda, rocm or npu (default: cuda with --gpu-mem, else this machine's auto device).")
@click.option("--backend", default="auto", show_default=True, help="auto, torch, triton or ascend.")
@click.option("--dtype", default="auto", show_default=True, help="Compute dtype: auto, bfloat16, float16, float32.")
@click.option("--w-bits", default=None, type=click.Choice(["4", "8", "16"]),
              help="Weight bits (default: the checkpoint's; 4 for a 16-bit model, as after `liteturbo lite`).")
@click.option("--w-group-size", default=None, type=int, help="Group size (default: the checkpoint's, else 128).")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="auto (the compute dtype), bf16, fp16, fp32, int8, int4.")
@click.option("--session-len", default=None, type=int,
              help="Tokens of one session (default: the model's max_position_embeddings).")
@click.option("--max-batch-size", default=64, show_default=True, type=int)
@click.option("--max-num-batched-tokens", default=1024, show_default=True, type=int)
@click.option("--block-size", default=64, show_default=True, type=int)
@click.option("--max-kv-tokens", default=None, type=int,
              help="KV pool in tokens (CPUs; default 16384). GPUs/NPUs take 90% of what is left.")
@click.option("--tp", "--tensor-parallel-size", "tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Plan for N devices (tensor parallelism): figures and --gpu-mem per device.")
@click.option("--quant-method", default="awq", show_default=True, type=click.Choice(["awq", "gptq", "rtn"]),
              help="Method whose peak memory the quantization line reports.")
@click.option("--calib-samples", default=128, show_default=True, type=int)
@click.option("--calib-seqlen", default=512, show_default=True, type=int)
@click.option("--session-host-gib", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Count a host tier of this many GiB for idle sessions' KV (serve --session-host-gib).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object (with a boolean `fits`).")
@friendly_errors
def plan(model, gpu_mem, device, backend, dtype, w_bits, w_group_size, kv_cache_dtype, session_len, max_batch_size,
         max_num_batched_tokens, block_size, max_kv_tokens, tp, quant_method, calib_samples, calib_seqlen,
         session_host_gib, as_json) -> None:
    """Will MODEL fit, with how much context and how many sessions? MODEL: a checkpoint folder (16-bit or
    quantized), a folder with only config.json, or a config.json file; nothing is loaded. Prints weights by part,
    workspace, KV bytes per token, pool tokens, sessions at once, whether it fits, the options to serve it, and
    whether `liteturbo lite` can quantize it there (docs/deploy-24gb.md)."""
    from turbo import plan as planner

    if calib_samples < 1 or calib_seqlen < 1:
        raise LiteturboError(f"--calib-samples and --calib-seqlen must be >= 1, got {calib_samples} and {calib_seqlen}")
    p, quantize_first = planner.plan_checkpoint(
        model, gpu_mem=gpu_mem, device=device, backend=backend, dtype=dtype,
        w_bits=None if w_bits is None else int(w_bits), w_group_size=w_group_size, kv_cache_dtype=kv_cache_dtype,
        session_len=session_len, max_batch_size=max_batch_size, max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size, max_kv_tokens=max_kv_tokens, tp=tp)
    p.with_host_tier(session_host_gib)
    if quantize_first:  # the lite side: can this device run the layer-by-layer pipeline for it?
        import torch

        from lite.methods import compute_dtype

        # lite's calibration forwards run in bfloat16 on GPUs and CPUs that multiply it natively, else float32
        cpu_f32 = p.device == "cpu" and compute_dtype("auto", torch.device("cpu")) == torch.float32
        try:
            p.quantization = quantize_fit(p.raw_config, quant_method, calib_samples, calib_seqlen,
                                          p.budget - p.reserve, p.device, compute_bytes=4 if cpu_f32 else 2)
        except ValueError as e:
            raise LiteturboError(str(e)) from None
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    click.echo(p.table())
    if not p.fits:
        click.echo("commands: none as asked (it does not fit); rerun `liteturbo plan` with one of the options above"
                   if p.suggestions else "commands: none (it does not fit)")
        return
    if p.weight_bits == 8:
        click.echo("commands: none (liteturbo writes and loads 4-bit checkpoints; W8A16 is shown for comparison)")
        return
    bare = Path(model).is_file() or (Path(model).is_dir() and not weight_files(Path(model)))
    src = f"<16-bit {p.model} checkpoint>" if bare else model
    if quantize_first:
        sub = {"awq": "auto-awq", "gptq": "gptq", "rtn": "rtn"}[quant_method]
        flag = "" if p.group_size == 128 else f" --w-group-size {p.group_size}"
        out = f"./{p.model}-{quant_method}"
        click.echo(f"commands: liteturbo lite {sub} {src}{flag} --work-dir {out}\n"
                   f"          {p.serve_command(out)}")
    else:
        click.echo(f"command: {p.serve_command(src)}")


def env_report(device: str = "auto") -> dict:
    """What ``liteturbo env`` reports, JSON-ready: ``hardware`` (CPU name, SIMD flags, cores, RAM; GPUs and NPUs torch
    sees), ``software`` (python, torch, CUDA/HIP, triton, transformers, torch_npu versions; ``TRITON_INTERPRET``),
    ``cpu_kernels``: :func:`backends.cpu_ext.status`), ``platform`` (:meth:`backends.platform.Platform.describe` of
    ``device``) and ``backends`` (every registered
    backend: ``usable``, ``reason`` when not, ``default``, ``ops``: its op coverage on that platform).
    Raises ``LiteturboError`` for an unknown device or one this machine lacks."""
    import psutil
    import torch

    from backends import backend_classes, cpu_ext
    from backends.platform import npu_available, cpu_flags, cpu_name, current_platform, triton_interpret

    def version(dist: str) -> str:
        """The installed version of distribution ``dist``, or ``"not installed"``."""
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    try:
        plat = current_platform(device)
    except ValueError as e:
        raise LiteturboError(str(e)) from None
    vm = psutil.virtual_memory()
    gpus, npus = [], []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "kind": "rocm" if torch.version.hip else "cuda", "name": p.name,
                         "total_memory_bytes": int(p.total_memory),
                         "capability": f"{getattr(p, 'major', '?')}.{getattr(p, 'minor', '?')}"})
    try:
        npu_seen = npu_available()
    except (ImportError, ValueError):
        npu_seen = False
    if npu_seen:
        for i in range(torch.npu.device_count()):
            npus.append({"index": i, "name": torch.npu.get_device_name(i),
                         "total_memory_bytes": int(torch.npu.get_device_properties(i).total_memory)})
    hardware = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "logical_cores": os.cpu_count(),
                "physical_cores": psutil.cpu_count(logical=False), "torch_threads": torch.get_num_threads(),
                "ram_total_bytes": int(vm.total), "ram_available_bytes": int(vm.available), "gpus": gpus, "npus": npus}
    software = {"python": pyplat.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "hip": getattr(torch.version, "hip", None), "triton": version("triton"),
                "transformers": version("transformers"), "torch_npu": _torch_npu_version(version("torch_npu")),
                "triton_interpret": triton_interpret(), "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
                "cpu_kernels": cpu_ext.status(), "LITETURBO_CPU_EXT": os.environ.get("LITETURBO_CPU_EXT")}
    default = plat.default_backend()
    backends_ = {}
    for name, cls in backend_classes().items():
        why = cls.unsupported_reason(plat)
        backends_[name] = {"usable": why is None, "reason": why, "default": name == default,
                           "ops": cls.op_coverage(plat)}
    return {"hardware": hardware, "software": software, "platform": plat.describe(), "backends": backends_}


def _torch_npu_version(from_metadata: str) -> str:
    """``torch_npu``'s version: package metadata, else the importable module's ``__version__``."""
    if from_metadata != "not installed":
        return from_metadata
    from backends.platform import torch_npu_module

    try:
        mod = torch_npu_module()
    except (ImportError, ValueError):
        mod = None
    return "not installed" if mod is None else str(getattr(mod, "__version__", "installed (version unknown)"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_env(r: dict) -> str:
    """:func:`env_report` as plain aligned text (``liteturbo env`` without ``--json``)."""
    hw, sw, pl = r["hardware"], r["software"], r["platform"]
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, str]], indent: str = "  ") -> None:
        """Append a titled block of ``key  value`` rows, keys padded to one width."""
        lines.append(title)
        width = max(len(k) for k, _ in rows)
        lines.extend(f"{indent}{k:<{width}}  {v}" for k, v in rows)

    section("platform", [
        ("device", f"{pl['device']} ({pl['kind']}): {pl['name']}, {_gib(pl['total_memory_bytes'])}, "
                   f"{_gib(pl['free_memory_bytes'])} free"),
        ("default dtype", pl["default_dtype"]),
        ("backend auto", f"{pl['default_backend']} (usable here: {', '.join(pl['usable_backends']) or 'none'})")])
    gpus = [f"{g['index']}: {g['name']} ({g['kind']}, {_gib(g['total_memory_bytes'])})" for g in hw["gpus"]]
    npus = [f"{n['index']}: {n['name']} ({_gib(n['total_memory_bytes'])})" for n in hw["npus"]]
    section("hardware", [
        ("CPU", f"{hw['cpu']} ({hw['logical_cores']} logical / {hw['physical_cores']} physical cores, "
                f"torch threads {hw['torch_threads']})"),
        ("CPU flags", " ".join(hw["cpu_flags"]) or "none of the tracked SIMD flags"),
        ("RAM", f"{_gib(hw['ram_total_bytes'])} total, {_gib(hw['ram_available_bytes'])} available"),
        ("GPU", "; ".join(gpus) or f"none seen by torch {sw['torch']}"),
        ("NPU", "; ".join(npus) or ("none (torch_npu not installed)" if sw["torch_npu"] == "not installed"
                                    else "none seen by torch_npu"))])
    interp = sw["TRITON_INTERPRET"]
    section("software", [
        ("python", sw["python"]),
        ("torch", f"{sw['torch']} (CUDA {sw['cuda'] or '-'}, HIP {sw['hip'] or '-'})"),
        ("triton", sw["triton"]), ("transformers", sw["transformers"]), ("torch_npu", sw["torch_npu"]),
        ("TRITON_INTERPRET", f"{interp if interp is not None else 'unset'} "
                             f"({'interpreter on' if sw['triton_interpret'] else 'interpreter off'})"),
        ("C++ CPU kernels", {"off": "off (LITETURBO_CPU_EXT=0)", "failed": "failed to build or load; torch ops instead",
                             "loaded": "loaded", "built": "built (cached)",
                             "not built yet": "not built yet (compiled at the first engine start, ~25-60 s)"}
         [sw["cpu_kernels"]])])
    section(f"backends on {pl['kind']}", [
        (name, ("usable" + (", default" if b["default"] else "")) if b["usable"] else f"not usable: {b['reason']}")
        for name, b in r["backends"].items()])
    lines.append("op coverage")
    for name, b in r["backends"].items():
        section(f"  {name}", list(b["ops"].items()), indent="    ")
    return "\n".join(lines)


@main.command("env")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda[:N] or npu[:N].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@friendly_errors
def env(device, as_json) -> None:
    """The hardware, library versions and every backend: usable here or why not, and which implementation runs
    each op."""
    r = env_report(device)
    click.echo(json.dumps(r, indent=2) if as_json else format_env(r))


if __name__ == "__main__":
    main()
