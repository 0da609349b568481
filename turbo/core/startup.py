"""Engine start-up as plain functions, one path for every rank: :func:`load_rank` resolves the model and options
(with tensor parallelism, the rank's shard), sizes the threads, refuses before loading what cannot fit, loads the
weights (mapped from a saved serving layout when one matches, :mod:`turbo.core.serving_layout`) and KV parameters
and counts the KV blocks free memory leaves room for. Rank 0 runs it through :func:`start`,
which then builds the runner, block manager and scheduler and returns them as one :class:`EngineParts`; with
``tensor_parallel_size > 1`` rank 0's :func:`load_rank` also spawns the workers
(:class:`turbo.core.tp.group.WorkerGroup`), each of which runs :func:`load_rank` as its own rank
(:mod:`turbo.core.tp.worker`).

Memory is counted with :mod:`turbo.core.planner`: weights and a step's workspace are checked against the free memory
of the device before any weight is read (memory other processes use is not free), then the pool takes what is
free after loading, less the workspace. What cannot fit is refused with the shortfall and the options that would fit.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends import Backend, KVCacheSpec, KVQuantParams, get_backend
from backends.cpu_threads import ThreadController, apply_threads, usable_cpus
from backends.onednn_caches import bound_onednn_caches
from backends.platform import Platform, current_platform
from lite.formats import LiteturboError, load_config, load_kv_params, resolve_model

from ..config import EngineConfig
from . import planner, serving_layout
from .block_manager import BlockManager
from .model import LlamaModel, ModelConfig
from .runner import ModelRunner
from .scheduler import Scheduler
from .tp.group import ParallelRunner, WorkerGroup
from .tp.shard import Shard, check_split, rank_config


@dataclass
class EngineParts:
    """What :func:`start` builds; the engine core holds them. Sizes in bytes, lengths in tokens."""

    path: Path
    platform: Platform
    backend: Backend
    dtype: torch.dtype
    model: LlamaModel
    tokenizer: object
    kv_cache_dtype: str
    kv_params: KVQuantParams | None
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    session_len: int
    eos_token_ids: set[int]
    workspace_bytes: int
    thread_control: ThreadController = field(default_factory=ThreadController.inert)  # backends/cpu_threads.py


@dataclass
class Fit:
    """The facts the memory checks read: resolved options and the model's config and weight layout."""

    path: Path
    config: EngineConfig
    platform: Platform
    backend: Backend
    dtype: torch.dtype
    model_cfg: ModelConfig
    weights: planner.WeightChoice
    lm_int8: bool
    kv_cache_dtype: str
    raw_config: dict  # config.json, read once
    shard: Shard | None = None  # tensor parallelism: this process's rank (None at tensor_parallel_size 1)

    def workspace(self, context_tokens: int | None = None) -> dict[str, int]:
        """A step's workspace by part (:func:`turbo.core.planner.workspace_breakdown`), of this rank."""
        c, m = self.config, self.model_cfg
        return planner.workspace_breakdown(
            m, type(self.backend), self.dtype, self.kv_cache_dtype, self.weights.bits < 16, self.lm_int8,
            c.max_num_batched_tokens, c.max_batch_size,
            min(c.session_len or m.max_position_embeddings, m.max_position_embeddings), c.batch_invariant,
            context_tokens, tp=c.tensor_parallel_size, kv_in_place=self.kv_in_place())

    def kv_in_place(self) -> bool:
        """Whether the backend's attention reads this KV cache in place (:meth:`backends.base.Backend.reads_kv_in_place`)."""
        return type(self.backend).reads_kv_in_place(self.kv_cache_dtype, self.dtype, self.backend.device.type,
                                                    self.config.batch_invariant)


def engine_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    """The engine's options from ``config`` or keywords (not both). Raises ``LiteturboError``."""
    if config is not None and kwargs:
        raise LiteturboError(f"give options either as config=EngineConfig(...) or as keywords, not both "
                             f"(got config and {sorted(kwargs)})")
    if config is not None and not isinstance(config, EngineConfig):
        raise LiteturboError(f"config must be an EngineConfig, got {type(config).__name__}; "
                             f"use EngineConfig(**options) or pass the options as keywords")
    try:
        return config or EngineConfig(**kwargs)
    except TypeError as e:
        raise LiteturboError(f"bad Engine option: {e}") from None


def kv_spec(fit: Fit, num_blocks: int) -> KVCacheSpec:
    """The KV cache's shape and storage (of this rank's KV heads). Raises ``LiteturboError`` for a bad
    combination."""
    m = rank_config(fit.model_cfg, fit.config.tensor_parallel_size)
    try:
        return KVCacheSpec(fit.kv_cache_dtype, num_blocks, fit.config.block_size, m.num_layers, m.num_kv_heads,
                           m.head_dim)
    except ValueError as e:
        raise LiteturboError(str(e)) from None


def resolve(config: EngineConfig, model: str | Path | None, rank: int = 0) -> Fit:
    """Model folder, platform, backend, compute dtype, lm_head and KV storage, from the options and config.json;
    with tensor parallelism, the shard of ``rank``, refusing (before loading) a split that breaks a head or a
    quantization group, or more ranks than devices."""
    path = resolve_model(model)
    platform = config.platform()
    tp = config.tensor_parallel_size
    if tp > 1 and platform.kind != "cpu":
        try:
            for r in range(tp):
                current_platform(platform.rank_device(r))
        except ValueError as e:
            raise LiteturboError(f"tensor_parallel_size={tp} needs {tp} devices counting from {platform.device}: "
                                 f"{e}") from None
    try:
        backend = get_backend(config.backend, platform.device, batch_invariant=config.batch_invariant)
    except (ValueError, RuntimeError) as e:
        raise LiteturboError(str(e)) from None
    dtype = config.torch_dtype()
    if platform.kind == "cpu" and dtype == torch.float16:
        warnings.warn("float16 on a CPU is emulated: about 10x slower than bfloat16 here; use dtype='bfloat16' "
                      "(or 'auto')", stacklevel=5)
    raw_cfg = load_config(path)
    lm_int8 = config.lm_head == "int8" or (
        config.lm_head == "auto" and bool(raw_cfg.get("quantization_config"))
        and backend.device.type == "cpu" and dtype != torch.float32)
    # config + weight layout the planner counts with, read from the headers once
    model_cfg, weights = ModelConfig.from_dict(raw_cfg), planner.weight_choice(path, raw_cfg, lm_int8)
    shard = None
    if tp > 1:
        check_split(model_cfg, tp, weights.bits, weights.group_size)
        shard = Shard.of(model_cfg, rank, tp)
    return Fit(path, config, platform, backend, dtype, model_cfg, weights, lm_int8, config.kv_storage_dtype(),
               raw_cfg, shard)


def pack_serving_layout(config: EngineConfig, model: str | Path | None) -> Path | None:
    """Save the serving layout of ``model`` as an engine with ``config`` would load it here
    (:func:`turbo.core.serving_layout.save`); returns its folder, or ``None`` when this backend has none (a GPU
    backend) or with tensor parallelism (each rank loads its shard from the checkpoint). Raises ``LiteturboError``
    for a bad model or option, or a folder that cannot be written."""
    if config.tensor_parallel_size > 1:
        return None
    fit = resolve(config, model)
    return serving_layout.save(fit.path, fit.backend, fit.dtype, fit.lm_int8)


def rank_free(fit: Fit) -> int:
    """Bytes free for this rank now: its device's free memory, or on a CPU the available RAM shared out between
    the tensor-parallel ranks."""
    free = fit.platform.free_memory()
    return free // fit.config.tensor_parallel_size if fit.platform.kind == "cpu" else free


def check_fits_before_loading(fit: Fit, free: int) -> None:
    """Refuse, before reading any weight, a model whose weights and step workspace exceed ``free`` bytes (memory
    other processes use is not free), naming the shortfall and what would help. Raises ``LiteturboError``."""
    wc, c = fit.weights, fit.config
    tp = c.tensor_parallel_size
    weights = sum(planner.weight_breakdown(fit.model_cfg, type(fit.backend), fit.platform.device.type, fit.dtype,
                                           wc, tp).values())
    ws = sum(fit.workspace(context_tokens=c.block_size).values())
    if weights + ws <= free:
        return
    raise LiteturboError(
        f"{fit.path.name} does not fit on {fit.platform.device}: its weights take {planner.gib(weights)} "
        f"({'W%dA16' % wc.bits if wc.bits < 16 else str(fit.dtype).removeprefix('torch.')}) and a step's "
        f"workspace {planner.gib(ws)} (max_num_batched_tokens={c.max_num_batched_tokens}, "
        f"max_batch_size={c.max_batch_size}), but only {planner.gib(free)} of {fit.platform.kind} memory is "
        f"free (the rest is in use{'; per rank of %d' % tp if tp > 1 else ''}): {planner.gib(weights + ws - free)} "
        f"short, before any KV cache. "
        + ("Quantize it to 4 bits (liteturbo lite auto-awq), " if wc.bits > 4 else "")
        + f"lower max_num_batched_tokens / max_batch_size / session_len, free memory, or use a larger "
          f"device; `liteturbo plan {fit.path}` shows the accounting")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. Raises ``LiteturboError`` naming the missing files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise LiteturboError(f"cannot load the tokenizer of {path} ({str(e).splitlines()[0][:200]}); the "
                             f"folder needs the tokenizer files of the original model (tokenizer.json, "
                             f"tokenizer_config.json); copy them from it") from None


def kv_transform(fit: Fit, model_cfg: ModelConfig) -> KVQuantParams | None:
    """The transform of an int8/int4 cache: the checkpoint's calibrated parameters unless turned off, else the
    rotated mode where ``kv_rotation`` asks for it (default: int4 with a power-of-two ``head_dim``), else ``None``
    (plain per-token). Raises ``LiteturboError`` for a damaged file, one made for another model shape, or
    ``kv_rotation=True`` with a head size that is not a power of two."""
    if fit.kv_cache_dtype not in ("int8", "int4"):
        return None
    params = load_kv_params(fit.path, fit.raw_config) if fit.config.kv_calibration else None
    if params is None:
        d = model_cfg.head_dim
        rotation = fit.config.kv_rotation
        if rotation and d & (d - 1):
            raise LiteturboError(f"kv_rotation needs a power-of-two head_dim (a Hadamard rotation); this model's is "
                                 f"{d}: leave kv_rotation unset or pass False (--no-kv-rotation)")
        if rotation or (rotation is None and fit.kv_cache_dtype == "int4" and not d & (d - 1)):
            params = KVQuantParams.rotation_only(model_cfg.num_layers, model_cfg.num_kv_heads, d)
    else:
        bad = params.mismatch(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim)
        if bad:
            raise LiteturboError(f"the KV parameter file of {fit.path} was made for another model ({bad}); "
                                 f"run `liteturbo lite calibrate-kv` on this model, or pass kv_calibration=False "
                                 f"(--no-kv-calibration)")
    return params if fit.shard is None else fit.shard.kv_params(params)


def fit_hint(fit: Fit, fitting_tokens: int, session: bool = False) -> str:
    """The options that would make the KV pool fit, for error messages."""
    cfg = fit.config
    hints = []
    if session:
        hints.append("a smaller session_len (--session-len), or a larger pool (max_kv_tokens / kv_cache_gib / "
                     "cache_max_entry_count; --max-kv-tokens, --kv-cache-gib, --cache-max-entry-count)")
    elif fitting_tokens >= cfg.block_size:
        hints.append(f"max_kv_tokens={fitting_tokens} (--max-kv-tokens {fitting_tokens}: the most that fits), or "
                     f"cache_max_entry_count=0.9")
    if fit.kv_cache_dtype not in ("int8", "int4"):
        hints.append("kv_cache_dtype='int8' (--kv-cache-dtype int8: about half the bytes per token) or 'int4'")
    elif fit.kv_cache_dtype == "int8":
        hints.append("kv_cache_dtype='int4' (--kv-cache-dtype int4)")
    if not session:
        hints.append("a smaller max_num_batched_tokens or max_batch_size (less workspace)")
    return "; ".join(hints) + f" (`liteturbo plan {fit.path}` shows the accounting)"


def pool_blocks(fit: Fit, free: int) -> tuple[int, int]:
    """(KV blocks to allocate, workspace bytes set aside), see :func:`turbo.core.planner.size_pool`: ``free −
    workspace`` after the weights are loaded, sized by the one pool option given, or the default, counting the real
    bytes of a block in the chosen KV dtype (scales included). Raises ``LiteturboError`` naming the shortfall and
    the options that would fit when the pool, or one session of an explicit ``session_len``, does not fit."""
    cfg, mcfg = fit.config, fit.model_cfg
    bs = cfg.block_size
    block_bytes = kv_spec(fit, 1).bytes_per_block()
    paged = fit.kv_in_place()
    length = min(cfg.session_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    pool, ws = planner.size_pool(
        free, lambda ctx: fit.workspace(context_tokens=ctx), block_bytes, bs,
        num_blocks=cfg.num_blocks, kv_cache_gib=cfg.kv_cache_gib, cache_max_entry_count=cfg.cache_max_entry_count,
        max_kv_tokens=cfg.max_kv_tokens, accelerator=fit.platform.kind != "cpu",
        context_cap=None if paged else cfg.max_batch_size * length)
    workspace_bytes = sum(ws.values())
    fitting_tokens = int(pool.available // block_bytes) * bs
    if pool.asked < block_bytes and pool.what.split("=")[0] in ("kv_cache_gib", "cache_max_entry_count") \
            and pool.available >= block_bytes:
        raise LiteturboError(f"{pool.what} is less than one KV block ({block_bytes} bytes of {bs} tokens); give "
                             f"at least {block_bytes / 2**30:.6f} GiB, or use max_kv_tokens (--max-kv-tokens)")
    if pool.blocks < 1:
        raise LiteturboError(
            f"{pool.what} asks for a KV cache of {planner.gib(max(pool.asked, block_bytes))} but only "
            f"{planner.gib(pool.available)} is left of the {planner.gib(free)} of {fit.platform.kind} memory free "
            f"after loading the weights, once a step's workspace ({planner.gib(workspace_bytes)}: "
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_batch_size={cfg.max_batch_size}) is set "
            f"aside: {planner.gib(max(pool.asked, block_bytes) - pool.available)} short. To fit: "
            + fit_hint(fit, fitting_tokens))
    tokens = pool.blocks * bs
    wanted = cfg.session_len and min(cfg.session_len, mcfg.max_position_embeddings)
    if wanted and wanted > tokens:
        raise LiteturboError(
            f"session_len={wanted} needs {wanted} tokens of KV cache but the pool ({pool.what}) holds {tokens} "
            f"({planner.gib(-(-wanted // bs) * block_bytes - pool.blocks * block_bytes)} short). To fit: "
            + fit_hint(fit, fitting_tokens, session=True))
    return pool.blocks, workspace_bytes


@dataclass
class RankLoad:
    """One rank's start-up, done (:func:`load_rank`): its resolved options, its shard of the weights loaded, and the
    KV pool it has room for. Sizes in bytes."""

    fit: Fit
    model: LlamaModel
    kv_params: KVQuantParams | None
    num_blocks: int  # KV blocks this rank has room for; rank 0 with workers: the fewest any rank has room for
    workspace_bytes: int
    thread_control: ThreadController
    tokenizer: object | None = None  # rank 0 only
    group: WorkerGroup | None = None  # rank 0 of a tensor-parallel engine: the workers, loaded

    def kv_spec(self, num_blocks: int) -> KVCacheSpec:
        """This rank's KV cache of ``num_blocks`` blocks (:func:`kv_spec`)."""
        return kv_spec(self.fit, num_blocks)


def use_device(device: str) -> None:
    """Make ``device`` (``cuda:N``, ``npu:N``) the process's current accelerator (a worker's, before it loads)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    elif device.startswith("npu"):
        torch.npu.set_device(torch.device(device))


def rank_threads(fit: Fit, rank: int) -> ThreadController:
    """Size torch's threads to the cores usable here (adapted during decode on a CPU device). Tensor parallelism on
    a CPU: the N ranks share the cores, 1/N each, fixed; a worker on an accelerator keeps torch's count. Raises
    ``LiteturboError`` for a bad ``threads``."""
    tp, cpu = fit.config.tensor_parallel_size, fit.platform.kind == "cpu"
    if rank > 0 and not cpu:
        return ThreadController.inert()
    try:
        threads = apply_threads(max(1, usable_cpus() // tp) if tp > 1 and cpu else fit.config.threads)
    except ValueError as e:
        raise LiteturboError(str(e)) from None
    return ThreadController(threads.threads, threads.adaptive and cpu)


def load_rank(config: EngineConfig, model: str | Path | None, rank: int = 0) -> RankLoad:
    """The start-up of one rank, the same on every rank: resolve (``rank``'s shard with tensor parallelism), size
    the threads, refuse before loading what cannot fit, load the weights and the KV parameters, and count the KV
    blocks free memory leaves room for. Rank 0 of a tensor-parallel engine also starts the workers, once it has
    checked that its shard fits (each runs this function as its rank, see :mod:`turbo.core.tp.worker`, while rank 0
    loads its own), loads the tokenizer, and takes the fewest blocks any rank has room for. Raises
    ``LiteturboError`` for a bad model, option, or what cannot fit (a worker's, with its rank)."""
    bound_onednn_caches()  # before the first 16-bit CPU GEMM (see backends/onednn_caches.py)
    if rank > 0:
        use_device(config.device)
    fit = resolve(config, model, rank)
    thread_control = rank_threads(fit, rank)
    check_fits_before_loading(fit, rank_free(fit))
    group = WorkerGroup(config, fit.path, fit.platform, load_rank) if rank == 0 and fit.shard is not None else None
    # rank 0's tokenizer loads on a thread while the weights load: importing transformers is Python work (~3 s
    # here) that overlaps the weight reads and C++ repacking instead of following them
    pool = ThreadPoolExecutor(1, thread_name_prefix="liteturbo-tokenizer") if rank == 0 else None
    tok_future = pool.submit(load_tokenizer, fit.path) if pool is not None else None
    try:
        # a saved serving layout (the backend's prepared weights, mapped) when one matches, else the checkpoint
        llama = (None if fit.shard is not None else serving_layout.load(fit.path, fit.backend, fit.dtype, fit.lm_int8))
        if llama is None:
            llama = LlamaModel.from_pretrained(fit.path, fit.backend, fit.dtype, lm_head_int8=fit.lm_int8,
                                               shard=fit.shard)
        tokenizer = tok_future.result() if tok_future is not None else None
        kv_params = kv_transform(fit, llama.cfg)
        num_blocks, workspace_bytes = pool_blocks(fit, rank_free(fit))
        if group is not None:
            num_blocks = group.gather_blocks(num_blocks)  # every rank allocates the same pool
    except BaseException:
        if group is not None:
            group.close(graceful=False)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return RankLoad(fit, llama, kv_params, num_blocks, workspace_bytes, thread_control, tokenizer, group)


def start(config: EngineConfig, model: str | Path | None) -> EngineParts:
    """Build an engine's parts: rank 0's :func:`load_rank` (which starts and loads the other ranks with tensor
    parallelism), then the runner, block manager and scheduler. Raises ``LiteturboError`` for a bad model, option,
    or what cannot fit."""
    part = load_rank(config, model)
    fit, llama, group, num_blocks, kv_params = part.fit, part.model, part.group, part.num_blocks, part.kv_params
    bs = config.block_size
    graphs = fit.platform.kind == "cuda" and not config.enforce_eager and getattr(fit.backend, "graph_safe_decode",
                                                                                   False) and group is None
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    scheduler = Scheduler(block_manager, config.max_batch_size, config.max_num_batched_tokens)
    max_ctx = min(llama.cfg.max_position_embeddings, num_blocks * bs)
    try:
        if group is not None:
            runner = ParallelRunner(llama, kv_spec(fit, num_blocks), kv_params, group)
        else:
            runner = ModelRunner(llama, kv_spec(fit, num_blocks), kv_params, graphs=graphs,
                                 max_context=min(config.session_len or max_ctx, max_ctx),
                                 max_batch=config.max_batch_size)
    except BaseException as e:
        if group is not None:
            group.close(graceful=False)
        if not isinstance(e, (RuntimeError, MemoryError)) or isinstance(e, LiteturboError):
            raise
        raise LiteturboError(f"cannot allocate the KV cache of {num_blocks} blocks x {bs} tokens ({e}); lower "
                             f"kv_cache_gib / cache_max_entry_count / num_blocks / max_kv_tokens") from None
    session_len = min(config.session_len or max_ctx, max_ctx)
    if config.session_len and config.session_len > max_ctx:
        warnings.warn(f"session_len={config.session_len} is capped to {max_ctx} tokens (the model's "
                      f"max_position_embeddings and the KV pool of {num_blocks * bs} tokens)", stacklevel=4)
    eos = set(llama.cfg.eos_token_ids)
    tokenizer = part.tokenizer
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return EngineParts(fit.path, fit.platform, fit.backend, fit.dtype, llama, tokenizer, fit.kv_cache_dtype,
                       kv_params, block_manager, scheduler, runner, session_len, eos, part.workspace_bytes,
                       thread_control=part.thread_control)
