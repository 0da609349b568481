"""Shared helpers of the benchmark scripts (not a library module)."""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def copy_gb_s(mib: int = 1024, repeats: int = 5) -> float:
    """This machine's copy bandwidth at torch's current thread count: GB/s read + written (STREAM's convention),
    the best of ``repeats`` copies of a ``mib`` MiB tensor after one warm-up. What the CPU benchmarks compare a
    kernel's bytes per second with, measured in the same run."""
    import torch

    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def w4a16_checkpoint(model: str, group_size: int, given: str | None) -> tuple[str, object]:
    """The W4A16 checkpoint to benchmark: ``given``, or RTN of ``model`` made in a temporary folder."""
    if given:
        return given, None
    from lite.pipeline import QuantConfig, quantize_checkpoint

    tmp = tempfile.TemporaryDirectory()
    path = quantize_checkpoint(model, QuantConfig(w_group_size=group_size, work_dir=str(Path(tmp.name) / "w4a16")))
    return str(path), tmp


def add_batch_invariant_flag(ap) -> None:
    """``--batch-invariant``: run turbo with ``EngineConfig(batch_invariant=True)``."""
    ap.add_argument("--batch-invariant", action="store_true",
                    help="run turbo with EngineConfig(batch_invariant=True): bit-exact 16-bit outputs, slower prefill")


def text_prompts(tokenizer, n: int, length: int, offset: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens cut from WikiText-2 valid."""
    import calib_data

    ids = tokenizer("".join(calib_data.load_rows("wikitext2", "valid")), add_special_tokens=False)["input_ids"]
    return [ids[offset + i * length: offset + (i + 1) * length] for i in range(n)]


def free_port() -> int:
    """A free TCP port on loopback (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    """Wait until ``url``/health answers 200; ``SystemExit`` with the server's stderr if ``proc`` exits or
    ``seconds`` pass first."""
    import httpx

    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{url} did not start: {proc.stderr.read()[-3000:] if proc.stderr else ''}")
        time.sleep(0.3)
