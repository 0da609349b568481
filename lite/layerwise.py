"""The layer-by-layer run kit shared by weight quantization (:mod:`lite.pipeline`) and KV calibration
(:mod:`lite.kv_calibration`).

- :class:`LazyCheckpoint`: a meta-device Hugging Face model whose tensors are read from safetensors one layer at a
  time (16-bit or W4A16 sources); it captures the inputs of decoder layer 0. In a Mixture-of-Experts model each
  sparse layer's block is :class:`lite.moe.SparseMoeBlock` (per-expert linears under the checkpoint's names).
- :func:`run_layer`: one decoder layer's float32 outputs for every calibration sample (the next layer's inputs).
- :func:`open_partial` and :func:`run_fingerprint`: the ``<work_dir>.partial`` folder that keeps finished layers,
  reused by ``--resume`` only when the options and the source weights are the same.
- :func:`resolve_device` (``--device`` → torch device) and :func:`peak_memory_gib` (what a run reports).
"""
from __future__ import annotations

import hashlib
import json
import resource
import shutil
import sys
from pathlib import Path

import torch

from .formats import LiteturboError, load_config, load_quantized_linears, make_dirs, quantization_spec, write_json
from .formats.arch import moe_config
from .formats.checkpoint import config_mismatch, weight_files
from .methods import LayerBatch, StopForward


def release_heap(collect: bool = False) -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op), after a garbage collection
    when ``collect`` (tenths of a second with transformers loaded): glibc keeps freed large blocks in its heap once its
    mmap threshold has grown, so without this a layer-by-layer run's resident memory climbs with every layer it frees."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_device(device: str) -> torch.device:
    """``--device`` of a lite command → torch device (``auto`` = cuda when available). Raises ``LiteturboError``
    when cuda is asked for without a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LiteturboError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def run_fingerprint(options: dict, source: Path) -> str:
    """Hash of a run's options and the source weights' names/sizes/mtimes (what ``--resume`` must match)."""
    files = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in weight_files(source)]
    blob = json.dumps({"cfg": options, "src": str(source.resolve()), "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def open_partial(out: Path, fingerprint: str, state: dict, resume: bool) -> Path:
    """The ``<out>.partial`` folder that keeps finished layers of a run: reused when ``resume`` and its
    fingerprint matches (``LiteturboError`` when it does not), otherwise started empty; ``state`` (with the
    fingerprint) is written to its ``state.json``."""
    partial = out.parent / f"{out.name}.partial"
    state_file = partial / "state.json"
    if partial.exists():
        old = json.loads(state_file.read_text()) if state_file.is_file() else {}
        if resume and old.get("fingerprint") != fingerprint:
            was, now = old.get("config", {}), state.get("config", {})
            diff = [f"{k}: {was[k]!r} then, {now[k]!r} now" for k in now if k in was and was[k] != now[k]]
            why = ("options differ (" + "; ".join(diff) + ")" if diff else
                   "the source weights or options differ")
            raise LiteturboError(f"{partial} cannot be resumed: {why}; rerun with the same options, or without "
                                 f"--resume to start over")
        if not resume:
            done = len(list(partial.glob("layer_*.safetensors")))
            if done:
                print(f"[liteturbo] discarding {done} finished layer(s) in {partial} (no --resume)", file=sys.stderr)
            shutil.rmtree(partial)
    elif resume:
        print(f"[liteturbo] nothing to resume in {partial}; starting from layer 0", file=sys.stderr)
    make_dirs(partial, "the partial-run folder")
    write_json(state_file, dict(state, fingerprint=fingerprint))
    return partial


class LazyCheckpoint:
    """A meta-device HF model whose tensors are read from safetensors on demand (accelerate).

    A W4A16 source (any format :mod:`lite.formats.quantized` reads) is accepted: its decoder linears are
    dequantized to float32 when their layer is materialized (used by ``calibrate-kv``). ``config`` is config.json;
    ``moe`` its :class:`~lite.formats.arch.MoEConfig` (``None`` for a dense model), whose sparse layers hold a
    :class:`lite.moe.SparseMoeBlock` instead of transformers' fused experts."""

    def __init__(self, path: Path, device: torch.device) -> None:
        from accelerate import init_empty_weights
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path, self.device = path, device
        self.config = load_config(path)
        self.qspec = quantization_spec(self.config)
        self.moe = moe_config(self.config)
        try:
            cfg = AutoConfig.from_pretrained(str(path))
            if self.qspec is not None:  # built as the 16-bit model; weights come dequantized
                cfg.quantization_config = None
                del cfg.quantization_config
            with init_empty_weights():
                self.model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        except Exception as e:  # transformers raises many types for malformed configs
            raise LiteturboError(f"transformers cannot build the model from {path / 'config.json'}: {e}") from e
        if self.moe is not None:
            from .moe import install_sparse_blocks

            install_sparse_blocks(self.model, self.config, self.moe)
        self.model.eval()
        # where each tensor lies, and its shape and safetensors dtype, read from the headers only: a tensor's bytes
        # are read when its layer is materialized, through a mapping that is closed right after (mapped pages of
        # a kept-open file would stay resident, so peak memory would grow with every layer read)
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtype_names: dict[str, str] = {}
        for f in weight_files(path):
            try:
                with safe_open(str(f), "pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        self.where[k], self.shapes[k], self.dtype_names[k] = str(f), tuple(sl.get_shape()), sl.get_dtype()
            except Exception as e:  # SafetensorError, OSError
                raise LiteturboError(f"cannot read {f}: {e}; the file is damaged or not safetensors") from e
        self.layers = self.model.model.layers
        self._module_keys: dict[str, list[str]] | None = None  # module path -> its tensor names (W4A16 sources)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor of the source checkpoint (CPU, stored dtype), read through a mapping closed at once."""
        from safetensors import safe_open

        if name not in self.where:
            raise LiteturboError(f"checkpoint {self.path} lacks tensor {name!r}")
        with safe_open(self.where[name], "pt") as h:
            return h.get_tensor(name)

    def check_shapes(self) -> None:
        """Raise ``LiteturboError`` (the message ``turbo`` gives) when the weights do not match config.json: a
        tensor of another shape, a missing tensor, or decoder layers beyond ``num_hidden_layers``."""
        n_layers = len(self.layers)
        extra = sorted({k.split(".")[2] for k in self.where if k.startswith("model.layers.")}
                       - {str(i) for i in range(n_layers)}, key=lambda s: (len(s), s))
        if extra:
            raise LiteturboError(f"the weights hold decoder layers beyond num_hidden_layers={n_layers} in config.json "
                                 f"(e.g. layer {extra[0]}); config.json does not belong to these weights")
        for name, p in self.model.named_parameters():
            if name not in self.where:
                if name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
                    continue
                raise LiteturboError(f"checkpoint {self.path} lacks tensor {name!r} (an incomplete copy or download, "
                                     f"or a config.json that does not belong to these weights)")
            shape = self.shapes[name]
            if shape != tuple(p.shape):
                raise config_mismatch(name, shape, tuple(p.shape))

    def materialize(self, module: torch.nn.Module, prefix: str, float32: bool = True) -> None:
        """Load ``module``'s parameters (``prefix.name``) onto the device in float32 (quantized linears of a
        W4A16 source dequantized); ``float32=False`` keeps each tensor in its stored dtype (half the memory of a
        16-bit layer, for a run that only reads the weights, such as RTN: ``.float()`` of them is the same)."""
        from accelerate.utils import set_module_tensor_to_device

        for n, _ in list(module.named_parameters()):
            key = f"{prefix}.{n}"
            if key not in self.where and self.qspec is not None and n.endswith(".weight"):
                value = self._dequantized(key[: -len(".weight")])
            else:
                value = self.tensor(key)
                value = value.float() if float32 or not value.is_floating_point() else value
            set_module_tensor_to_device(module, n, self.device, value=value, dtype=value.dtype)

    def _dequantized(self, prefix: str) -> torch.Tensor:
        """float32 ``[out, in]`` weight of the quantized linear ``prefix``."""
        if self._module_keys is None:  # one pass over the names, not one per linear (a MoE has thousands)
            self._module_keys = {}
            for k in self.where:
                self._module_keys.setdefault(k.rsplit(".", 1)[0], []).append(k)
        tensors = {k: self.tensor(k) for k in self._module_keys.get(prefix, ()) if k != f"{prefix}.bias"}
        qws = load_quantized_linears(tensors, self.qspec)
        if prefix not in qws:
            raise LiteturboError(f"checkpoint {self.path} lacks tensor {prefix + '.weight'!r} (nor its quantized form)")
        return qws[prefix].dequantize(torch.float32)

    def release(self, module: torch.nn.Module) -> None:
        """Drop ``module``'s weights (back to meta) and hand the freed memory back to the OS (:func:`release_heap`)."""
        module.to("meta")
        release_heap()

    def capture_inputs(self, samples: list[torch.Tensor],
                       dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[dict]]:
        """Hidden states entering layer 0 (``[1, T, hidden]``, stored in ``dtype``: by default the embeddings'
        float32) and its keyword arguments (rotary, mask), per sample. Each sample's states are converted as they
        are captured, so a 16-bit ``dtype`` never holds all of them in float32 (1 GiB at 8B shapes with the default
        128 x 512 calibration tokens)."""
        m = self.model.model
        self.materialize(m.embed_tokens, "model.embed_tokens")
        m.rotary_emb.to(self.device)
        store: list = []

        def hook(_mod, args, kwargs):
            """Keep layer 0's hidden states ``[1, T, hidden]`` and keyword arguments, then stop the forward."""
            h = args[0] if args else kwargs.pop("hidden_states")
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            store.append((h.detach() if dtype is None else h.detach().to(dtype), kw))
            raise StopForward

        handle = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                for s in samples:
                    try:
                        m(input_ids=s.to(self.device), use_cache=False)
                    except StopForward:
                        pass
        finally:
            handle.remove()
        self.release(m.embed_tokens)
        return [h for h, _ in store], [kw for _, kw in store]


def run_layer(layer, inps: list[torch.Tensor], kws: list[dict]) -> list[torch.Tensor]:
    """The float32 outputs of decoder ``layer`` for every sample: inputs ``inps`` (``[1, L, H]`` each) with their
    keyword arguments ``kws`` (rotary, mask) as :meth:`LazyCheckpoint.capture_inputs` returns them (``calibrate-kv``
    propagates in float32)."""
    return LayerBatch(inps, kws, torch.float32).run(layer)


def peak_memory_gib(device: torch.device) -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
