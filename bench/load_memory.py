"""Peak memory of loading a checkpoint (``LlamaModel.from_pretrained``) against the model's final footprint.

Each (checkpoint, mode) runs in a fresh Python process so peaks do not mix. In it: import everything, build the
backend, read the baseline RSS, reset the kernel's peak-RSS mark (``/proc/self/clear_refs``), load, then report

- ``peak``: the process's peak RSS during the load (``VmHWM``, exact), and the peak anonymous / file-backed RSS
  seen by a 5 ms sampler thread (file-backed pages are a memory-mapped checkpoint);
- ``final``: baseline RSS + the bytes of every distinct tensor storage the loaded model holds on the host
  (prepared weight handles, norms, embeddings, rotary tables); the RSS after the load is reported too, before and
  after ``malloc_trim`` (glibc keeps freed heap memory for reuse, so RSS can stay above the live bytes);
- ``layer``: the largest decoder layer, on disk and as prepared by the backend (the "+ one layer" budget);
- with ``--device cuda``: ``torch.cuda.max_memory_allocated`` during the load vs the allocated bytes after it.

Modes: ``stream`` (today's loader: one tensor read at a time, layer by layer) and ``whole`` (the loader before
streaming, replicated here: ``load_state_dict`` maps the whole checkpoint, every quantized linear is unpacked
before the first is prepared, then the layers are prepared).

    python bench/load_memory.py                                  # embedded SmolLM2 (bf16), torch backend, CPU
    python bench/load_memory.py work_dirs/awq-g64 --modes stream,whole --json
    python bench/load_memory.py --make-llama3-8b work_dirs/llama3-8b-shaped-awq   # ~5.7 GB, random W4A16
    python bench/load_memory.py work_dirs/llama3-8b-shaped-awq --dtype bfloat16 [--device cuda]

``--make-llama3-8b DIR`` writes a Llama-3-8B-shaped random-weight checkpoint in liteturbo's AWQ GEMM g128 format
(hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, vocab 128256, untied bf16 embeddings and
lm_head, random codes), one safetensors shard per layer, into ``DIR.partial`` renamed to ``DIR`` at the end; it
never holds more than one layer (or the embedding table) in memory. It has no tokenizer: it loads with
``LlamaModel.from_pretrained``, not with the engine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2 ** 20
GIB = 2 ** 30

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, head_dim=128)


# ------------------------------------------------------------------------------------------------
# the Llama-3-8B-shaped random W4A16 checkpoint
# ------------------------------------------------------------------------------------------------
def make_llama3_8b(target: Path, group_size: int = 128, layers: int | None = None, seed: int = 0) -> Path:
    """Write the random AWQ GEMM checkpoint described in the module docstring at ``target`` (atomically).

    ``layers`` overrides the layer count (a quicker, smaller file for trying the script). Raises ``SystemExit`` if
    ``target`` exists.
    """
    import torch
    from safetensors.torch import save_file

    from lite.formats import awq_quantization_config, write_json

    target = Path(target).absolute()
    if target.exists():
        raise SystemExit(f"{target} exists; remove it or choose another folder")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    s = dict(LLAMA3_8B)
    n_layers = layers or s["num_hidden_layers"]
    h, inter, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q_out, kv_out = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (q_out, h), "self_attn.k_proj": (kv_out, h), "self_attn.v_proj": (kv_out, h),
              "self_attn.o_proj": (h, q_out),
              "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)

    def rand_int32(rows: int, cols: int) -> torch.Tensor:
        """Random bits: 8 uniform 4-bit codes per int32 (the AWQ GEMM words of random codes)."""
        return torch.randint(0, 256, (rows, cols * 4), dtype=torch.uint8, generator=g).view(torch.int32)

    n_files = n_layers + 2
    name = lambda k: f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"  # noqa: E731
    weight_map, total = {}, 0

    def write(k: int, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(partial / name(k)), metadata={"format": "pt"})
        for t_name, t in tensors.items():
            weight_map[t_name] = name(k)
            total += t.nbytes

    t0 = time.perf_counter()
    # embedding rows ~ N(0, 0.02) like an initialised Llama; (q - z) * s with s ~ 3e-3 gives weights of std ~0.02
    write(0, {"model.embed_tokens.weight": (torch.randn(s["vocab_size"], h, generator=g) * 0.02).to(torch.bfloat16)})
    for i in range(n_layers):
        p = f"model.layers.{i}"
        tensors = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        for lin, (n_out, k_in) in shapes.items():
            tensors[f"{p}.{lin}.qweight"] = rand_int32(k_in, n_out // 8)  # [K, N/8]
            tensors[f"{p}.{lin}.qzeros"] = rand_int32(k_in // group_size, n_out // 8)  # [K/g, N/8]
            tensors[f"{p}.{lin}.scales"] = (torch.rand(k_in // group_size, n_out, generator=g) * 2e-3 + 2e-3).half()
        write(1 + i, tensors)
        del tensors
        print(f"\r[make-llama3-8b] layer {i + 1}/{n_layers} ({time.perf_counter() - t0:.0f} s)", end="",
              file=sys.stderr, flush=True)
    write(n_layers + 1, {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                         "lm_head.weight": (torch.randn(s["vocab_size"], h, generator=g) * 0.02).to(torch.bfloat16)})
    write_json(partial / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(partial / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": n_layers,
        "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": hd, "vocab_size": s["vocab_size"], "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
        "quantization_config": awq_quantization_config(4, group_size, True),
        "_liteturbo_note": "random weights (bench/load_memory.py --make-llama3-8b): for memory/speed measurements only",
    })
    os.replace(partial, target)
    print(f"\n[make-llama3-8b] wrote {target}: {total / GIB:.2f} GiB in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return target


# ------------------------------------------------------------------------------------------------
# measuring one load (child process)
# ------------------------------------------------------------------------------------------------
def _status_kib(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in fields:
                out[k] = int(v.split()[0])
    return out


class _Sampler(threading.Thread):
    """Peak RssAnon / RssFile sampled every ``interval`` seconds (short spikes between samples are missed)."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.interval, self.stop, self.peak = interval, threading.Event(), {"RssAnon": 0, "RssFile": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            for k, v in _status_kib("RssAnon", "RssFile").items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(self.interval)


def _storages(obj, seen: set, out: dict, depth: int = 0) -> None:
    """Collect ``(device, data_ptr) -> bytes`` of every tensor storage reachable from ``obj``."""
    import torch

    if depth > 8 or id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, torch.dtype)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        out[(str(obj.device), st.data_ptr())] = st.nbytes()
        return
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)]
    for x in items:
        if hasattr(x, "w4a16_linear"):  # a backend reference, not model memory
            continue
        _storages(x, seen, out, depth + 1)


def _bytes_by_device(*objs) -> dict[str, int]:
    out: dict = {}
    seen: set = set()
    for o in objs:
        _storages(o, seen, out)
    by_dev: dict[str, int] = {}
    for (dev, _), n in out.items():
        by_dev[dev] = by_dev.get(dev, 0) + n
    return by_dev


class _WholeLoad:
    """The loader before streaming, for comparison: the whole checkpoint through ``load_state_dict`` (memory
    mapped, touched as it is used) and every quantized linear unpacked before the first layer is prepared."""

    def __enter__(self):
        import lite.formats
        import turbo.core.model
        from lite.formats import load_state_dict

        self.saved = (lite.formats.LazyStateDict, turbo.core.model.load_quantized_linears)
        real_unpack = self.saved[1]
        unpacked: dict = {}

        class WholeStateDict(dict):
            def __init__(self, path) -> None:
                super().__init__(load_state_dict(path))
                unpacked.clear()

            def shape(self, name: str) -> tuple:
                return tuple(self[name].shape)

        def unpack_all_first(sd, spec, prefix: str = ""):
            if "all" not in unpacked:
                unpacked["all"] = real_unpack(sd, spec)  # every layer at once, as before
            qws = unpacked["all"]
            return {k: qws.pop(k) for k in [k for k in qws if k.startswith(prefix)]}

        lite.formats.LazyStateDict = WholeStateDict
        turbo.core.model.load_quantized_linears = unpack_all_first
        return self

    def __exit__(self, *exc) -> None:
        import lite.formats
        import turbo.core.model

        lite.formats.LazyStateDict, turbo.core.model.load_quantized_linears = self.saved


def measure(path: str, mode: str, device: str, dtype_name: str, backend_name: str) -> dict:
    """Load ``path`` once in this process and return the measurements (see the module docstring)."""
    import torch

    from backends import get_backend
    from lite.formats import LazyStateDict, load_config, resolve_model
    from turbo.core.model import LlamaModel

    ckpt = resolve_model(path)
    dtype = getattr(torch, dtype_name)
    backend = get_backend(backend_name, device)
    cuda = backend.device.type == "cuda"
    header = LazyStateDict(ckpt)
    n_layers = int(load_config(ckpt)["num_hidden_layers"])
    layer_disk = [sum(header.nbytes(k) for k in header if k.startswith(f"model.layers.{i}.")) for i in range(n_layers)]
    disk_total = sum(header.nbytes(k) for k in header)
    del header
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        dev_base = torch.cuda.memory_allocated()
    base = _status_kib("VmRSS")["VmRSS"] * 1024
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    if mode == "whole":
        with _WholeLoad():
            model = LlamaModel.from_pretrained(ckpt, backend, dtype)
    else:
        model = LlamaModel.from_pretrained(ckpt, backend, dtype)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    peak = _status_kib("VmHWM")["VmHWM"] * 1024
    gc.collect()
    after = _status_kib("VmRSS", "RssAnon", "RssFile")
    try:  # freed heap memory glibc keeps for reuse (not part of the model) goes back to the OS
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    trimmed = _status_kib("VmRSS")["VmRSS"] * 1024
    held = _bytes_by_device(model.layers, model.embed, model.norm, model.lm_head, model.cos_sin)
    host_model = held.get("cpu", 0)
    layer_prepared = [sum(_bytes_by_device(layer).values()) for layer in model.layers]
    out = {
        "checkpoint": str(ckpt), "mode": mode, "device": str(backend.device), "backend": backend_name,
        "dtype": dtype_name, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "quant_method": model.quant_method, "layers": n_layers, "load_s": round(wall, 2),
        "disk_bytes": disk_total, "baseline_rss": base, "model_host_bytes": host_model,
        "final_host": base + host_model, "peak_rss": peak,
        "peak_rss_anon_sampled": sampler.peak["RssAnon"] * 1024,
        "peak_rss_file_sampled": sampler.peak["RssFile"] * 1024,
        "rss_after": after["VmRSS"] * 1024, "rss_after_anon": after["RssAnon"] * 1024,
        "rss_after_file": after["RssFile"] * 1024, "rss_after_trim": trimmed,
        "largest_layer_disk": max(layer_disk), "largest_layer_prepared": max(layer_prepared),
    }
    out["peak_over_final"] = out["peak_rss"] - out["final_host"]
    out["peak_over_final_layers"] = round(out["peak_over_final"] / max(out["largest_layer_prepared"], 1), 2)
    if cuda:
        dev_model = sum(v for k, v in held.items() if k.startswith("cuda"))
        out.update(device_model_bytes=dev_model, device_final=torch.cuda.memory_allocated() - dev_base,
                   device_peak=torch.cuda.max_memory_allocated() - dev_base)
        out["device_peak_over_final"] = out["device_peak"] - out["device_final"]
        out["device_peak_over_final_layers"] = round(out["device_peak_over_final"] / max(max(layer_prepared), 1), 2)
    return out


# ------------------------------------------------------------------------------------------------
def _fmt(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def print_table(rows: list[dict]) -> None:
    """A markdown table: one row per (checkpoint, mode)."""
    cuda = any("device_peak" in r for r in rows)
    cols = ["checkpoint", "mode", "load s", "on disk", "baseline RSS", "model (host)", "final = base + model",
            "peak RSS", "peak - final", "largest layer disk / prepared", "peak - final in layers",
            "RSS after / after malloc_trim"]
    if cuda:
        cols += ["device final", "device peak", "device peak - final"]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        mode = r["mode"] + (f", mmap threshold {r['malloc_mmap_threshold']}" if r["malloc_mmap_threshold"] else "")
        cells = [Path(r["checkpoint"]).name + f" ({r['quant_method'] or r['dtype']})", mode, f"{r['load_s']:.1f}",
                 _fmt(r["disk_bytes"]), _fmt(r["baseline_rss"]), _fmt(r["model_host_bytes"]), _fmt(r["final_host"]),
                 _fmt(r["peak_rss"]), _fmt(r["peak_over_final"]),
                 f"{_fmt(r['largest_layer_disk'])} / {_fmt(r['largest_layer_prepared'])}",
                 f"{r['peak_over_final_layers']:.2f}", f"{_fmt(r['rss_after'])} / {_fmt(r['rss_after_trim'])}"]
        if cuda:
            cells += [_fmt(r.get("device_final", 0)), _fmt(r.get("device_peak", 0)),
                      _fmt(r.get("device_peak_over_final", 0))]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="*", help="checkpoint folders or embedded model names (default: the embedded "
                                                    "SmolLM2)")
    ap.add_argument("--modes", default="stream,whole", help="comma-separated: stream, whole (default: both)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (device peak via torch.cuda.max_memory_allocated)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads in the child (0: torch's default)")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                    help="run the loads with MALLOC_MMAP_THRESHOLD_=BYTES: glibc then maps every allocation of that "
                         "size or more on its own and unmaps it on free, so RSS follows the live bytes (default: "
                         "glibc's dynamic threshold, which keeps freed blocks below 32 MiB in its heap)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--make-llama3-8b", metavar="DIR",
                    help="write the Llama-3-8B-shaped random AWQ checkpoint and exit")
    ap.add_argument("--make-layers", type=int, default=None, help="with --make-llama3-8b: fewer layers (quick tries)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.make_llama3_8b:
        make_llama3_8b(Path(args.make_llama3_8b), layers=args.make_layers)
        return
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.checkpoints[0], args.modes, args.device, args.dtype, args.backend)))
        return
    rows = []
    for ckpt in args.checkpoints or ["smollm2-135m-instruct"]:
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, ckpt, "--child", "--modes", mode, "--device", args.device, "--dtype",
                   args.dtype, "--backend", args.backend, "--threads", str(args.threads)]
            env = dict(os.environ)
            if args.malloc_mmap_threshold is not None:
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                sys.stderr.write(r.stderr)
                raise SystemExit(f"measuring {ckpt} ({mode}) failed with exit status {r.returncode}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            if not args.json:
                print(f"[load_memory] {ckpt} {mode}: peak {_fmt(rows[-1]['peak_rss'])}, "
                      f"final {_fmt(rows[-1]['final_host'])}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
