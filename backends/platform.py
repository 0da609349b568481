"""One place for device facts: kind, name, memory, dtype support and which backends can run there.

``current_platform(device)`` resolves ``"auto" | "cpu" | "cuda[:N]" | "npu[:N]"`` into a :class:`Platform`. Kinds:
``cpu``; ``cuda`` (an NVIDIA GPU through CUDA builds of torch); ``rocm`` (an AMD GPU through HIP builds of torch,
which use the ``cuda`` device type, told apart by ``torch.version.hip``); ``npu`` (Huawei Ascend through the
``torch_npu`` plug-in, which registers the ``npu`` device type and ``torch.npu``). ``auto`` picks a GPU, then an
NPU, then the CPU. Everything device-specific that the engine, the CLI and ``liteturbo env`` ask goes through
here; backends say whether they run on a platform through ``Backend.unsupported_reason``, and
:meth:`Platform.usable_backends` asks every class of :mod:`backends.registry`. :func:`liteturbo_home` is the cache
folder (converted models, compiled CPU kernels); :func:`torch_npu_module` imports Ascend's plug-in where installed.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import platform as _pyplatform
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")


def liteturbo_home() -> Path:
    """Cache folder: ``$LITETURBO_HOME``, default ``~/.cache/liteturbo``."""
    return Path(os.environ.get("LITETURBO_HOME", Path.home() / ".cache" / "liteturbo"))


def torch_npu_module():
    """The ``torch_npu`` module when it is installed (importing it registers ``torch.npu``), else None."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    """Whether ``torch_npu`` is installed and sees an NPU."""
    if torch_npu_module() is None:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


# the names turbo/cli.py imports today (tests/test_structure.py's allow-list); the public ones above are the API


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _pyplatform.processor() or _pyplatform.machine()


def cpu_flags() -> list[str]:
    """SIMD features of the CPU that matter to kernels (avx2, avx512f, avx512_bf16, avx512_vnni, amx_*, fma...)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512_fp16",
              "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "neon", "asimd", "sve")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


@dataclass(frozen=True)
class Platform:
    """Facts about one device.

    kind: ``cpu``, ``cuda``, ``rocm`` or ``npu``. device: the torch device tensors go to. name: the CPU model or the
    accelerator's name. total_memory: bytes of RAM (CPU) or of device memory.
    """

    kind: str
    device: torch.device
    name: str
    total_memory: int

    @property
    def is_gpu(self) -> bool:
        """CUDA or ROCm."""
        return self.kind in ("cuda", "rocm")

    @property
    def dist_backend(self) -> str:
        """The ``torch.distributed`` backend tensor parallelism uses here: ``nccl`` on CUDA (RCCL on ROCm, under the
        same name), ``hccl`` on Ascend NPUs (registered by ``torch_npu``), ``gloo`` on CPUs."""
        return {"cuda": "nccl", "rocm": "nccl", "npu": "hccl"}.get(self.kind, "gloo")

    def rank_device(self, rank: int) -> str:
        """The device of tensor-parallel rank ``rank`` when rank 0 runs here: the ``rank``-th accelerator counting
        from this one's index (``cuda:1`` → ``cuda:1, cuda:2, ...``), the CPU for every rank on a CPU."""
        if self.kind == "cpu":
            return "cpu"
        return f"{self.device.type}:{(self.device.index or 0) + rank}"

    def free_memory(self) -> int:
        """Bytes free on the device now: free device memory (``mem_get_info``), or available RAM on CPU."""
        if self.is_gpu:
            return int(torch.cuda.mem_get_info(self.device)[0])
        if self.kind == "npu":
            return int(torch.npu.mem_get_info(self.device)[0])
        import psutil

        return int(psutil.virtual_memory().available)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` is a sensible compute dtype here (bf16 needs native support on CPU and pre-Ampere GPUs
        lack it; float16 on CPU is emulated and slow, so it counts as unsupported for ``auto``)."""
        if dtype == torch.float32:
            return True
        if self.kind == "cpu":
            if dtype == torch.bfloat16:
                return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
            return False
        if self.is_gpu and dtype == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported())
        return dtype in (torch.float16, torch.bfloat16)

    def default_dtype(self) -> torch.dtype:
        """The compute dtype of ``dtype="auto"``: bfloat16 where native, else float16 on accelerators and
        float32 on CPUs."""
        if self.kind == "cpu":
            return torch.bfloat16 if self.supports_dtype(torch.bfloat16) else torch.float32
        if self.is_gpu and self.supports_dtype(torch.bfloat16):
            return torch.bfloat16
        return torch.float16

    def usable_backends(self) -> list[str]:
        """Registered backends that can run here, best first (Triton on CUDA/ROCm, Ascend on NPUs, torch last; on a
        CPU torch first: Triton runs there only in its interpreter, for tests)."""
        from .registry import backend_classes

        order = {"triton": 0, "ascend": 0, "torch": 0 if self.kind == "cpu" else 9}
        ok = [n for n, cls in backend_classes().items() if cls.unsupported_reason(self) is None]
        return sorted(ok, key=lambda n: (order.get(n, 5), n))

    def default_backend(self) -> str:
        """What ``backend="auto"`` means here."""
        usable = self.usable_backends()
        return usable[0] if usable else "torch"

    def describe(self) -> dict:
        """JSON-ready facts (for ``liteturbo env``)."""
        return {"kind": self.kind, "device": str(self.device), "name": self.name,
                "total_memory_bytes": self.total_memory, "free_memory_bytes": self.free_memory(),
                "default_dtype": str(self.default_dtype()).replace("torch.", ""),
                "usable_backends": self.usable_backends(), "default_backend": self.default_backend()}


def _gpu_kind() -> str:
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def current_platform(device: str | torch.device = "auto") -> Platform:
    """Resolve ``device`` (``auto``, ``cpu``, ``cuda[:N]``, ``npu[:N]``, or a torch device) to a :class:`Platform`.

    Raises ``ValueError`` naming the problem and the fix for an unknown device or one this machine lacks.
    """
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (optionally with :N) or a torch.device, "
                         f"got {device!r}")
    dev = str(device).strip().lower()
    if dev == "auto":
        if torch.cuda.is_available():
            dev = "cuda"
        elif npu_available():
            dev = "npu"
        else:
            dev = "cpu"
    kind, _, index = dev.partition(":")
    if kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit()) or (kind == "cpu" and index not in ("", "0")):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (cuda and npu optionally with a device "
                         f"index :N, N >= 0), got {device!r}")
    if kind == "cpu":
        import psutil

        return Platform("cpu", torch.device("cpu"), cpu_name(), int(psutil.virtual_memory().total))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev!r} was asked for but torch sees no CUDA/ROCm GPU (torch "
                             f"{torch.__version__}); use device='cpu', or install a CUDA/ROCm build of torch")
        d = torch.device(dev)
        idx = d.index if d.index is not None else torch.cuda.current_device()
        if idx >= torch.cuda.device_count():
            raise ValueError(f"device {dev!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        props = torch.cuda.get_device_properties(idx)
        return Platform(_gpu_kind(), torch.device("cuda", idx), props.name, int(props.total_memory))
    if not npu_available():
        why = "torch_npu is not installed" if torch_npu_module() is None else "torch_npu sees no NPU"
        raise ValueError(f"device {dev!r} was asked for but {why}; install Ascend's torch_npu matching torch "
                         f"{torch.__version__}, or use device='cpu'")
    d = torch.device(dev)
    idx = d.index or 0
    name = torch.npu.get_device_name(idx)
    total = int(torch.npu.get_device_properties(idx).total_memory)
    return Platform("npu", torch.device("npu", idx), name, total)


def triton_interpret() -> bool:
    """Whether Triton kernels run in Triton's interpreter (numpy on the CPU): ``TRITON_INTERPRET`` read as Triton
    reads it (``1``, ``true``, ``on``, ``yes``, ``y``, any case; anything else is off)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")
