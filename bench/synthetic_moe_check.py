"""Sanity checks of the Mixture-of-Experts synthetic sizes (bench/synthetic.py) across its three writers.

For each size: the bf16 checkpoint (``--bf16``, default for the tiny sizes), the W4A16 checkpoint and the Q4_0 GGUF
written directly from the seeds (each made once in the cache and reused; the time each took and its size on disk are
printed), then

- the Q4_0 GGUF in llama.cpp (llama-cpp-python, ``n_threads=2``): load time, finite logits for every position of a
  short prompt, a few greedy tokens and their decode rate;
- with the bf16 checkpoint of a tiny size (transformers, float32): the logits of llama.cpp against transformers on the very weights
  llama.cpp runs (the GGUF's tensors dequantized and unstacked back into a Hugging Face checkpoint): correlation, the
  largest difference, greedy agreement; and against the bf16 model (the Q4_0 noise);
- the W4A16 checkpoint: every quantized linear dequantized (``lite.formats.awq.unpack_awq``) lies within half a step
  of the seeded bf16 weight (the RTN bound; a little more where the rounded zero point clips) and equals
  ``lite.rtn.fake_quantize`` of it, and with the bf16 checkpoint the dequantized model's logits against the
  bf16 model's;
- with the bf16 checkpoint of a full size (``--bf16``): llama.cpp's logits against the bf16 model's in transformers
  (bfloat16: a float32 copy of olmoe would not fit in 24 GiB).

    python bench/synthetic_moe_check.py [--sizes tiny-moe,tiny-olmoe] [--cache-dir DIR] [--bf16] [--tokens 8]

One JSON line per size on stdout.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
PROMPT = [1, 504, 3458, 282, 4649, 314, 260, 1345, 28, 2530, 30, 216, 4178, 1060, 2]


def _synthetic():
    """bench/synthetic.py as a module (without putting bench/ on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_synthetic", HERE / "synthetic.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)
    spec.loader.exec_module(mod)
    return sys.modules[spec.name]


def _disk(path: Path) -> float:
    path = Path(path)
    n = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return round(n / 2**30, 3)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 1)


def llama_cpp_run(gguf_path: Path, ids: list[int], new_tokens: int, threads: int = 2) -> dict:
    """Load the GGUF in llama.cpp, the logits of every prompt position, then ``new_tokens`` greedy tokens."""
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf_path), n_ctx=256, n_threads=threads, n_threads_batch=threads, n_batch=256,
                logits_all=True, verbose=False)
    load = time.perf_counter() - t0
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    out, t1 = [], time.perf_counter()
    nxt = int(logits[-1].argmax())
    for _ in range(new_tokens):
        out.append(nxt)
        llm.eval([nxt])
        nxt = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
    rate = new_tokens / max(time.perf_counter() - t1, 1e-9)
    del llm
    return {"logits": logits, "load_seconds": round(load, 2), "greedy": out, "decode_tok_s": round(rate, 1)}


def gguf_as_checkpoint(gguf_path: Path, ckpt: Path, dst: Path, synthetic) -> Path:
    """The GGUF's tensors dequantized to float32 and unstacked into a Hugging Face checkpoint folder at ``dst`` (the
    config and tokenizer of ``ckpt``): the weights llama.cpp runs, for transformers. No q/k un-permutation: MoE
    architectures only."""
    import gguf
    import torch
    from safetensors.torch import save_file

    config = json.loads((ckpt / "config.json").read_text())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open

    shapes = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(ckpt / shard), "pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    plan = {g: (hf, s) for g, hf, s in synthetic.gguf_plan(shapes, config["model_type"], config["num_hidden_layers"])}
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {}
    for t in reader.tensors:
        hf, shape = plan[t.name]
        x = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")).reshape(shape)
        if len(hf) == 1:
            tensors[hf[0]] = x.contiguous()
        else:
            tensors.update({n: x[e].contiguous() for e, n in enumerate(hf)})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ckpt / f).is_file():
            shutil.copy2(ckpt / f, dst / f)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(torch_dtype="float32", dtype="float32")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_logits(folder: Path, ids: list[int], dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def compare(a, b) -> dict:
    """Correlation, largest absolute difference and greedy agreement of two logits arrays ``[positions, vocab]``."""
    import numpy as np

    corr = float(np.corrcoef(a.ravel(), b.ravel())[0, 1])
    return {"corr": round(corr, 5), "max_abs_diff": round(float(np.abs(a - b).max()), 4),
            "logit_std": round(float(b.std()), 4),
            "greedy_agree": round(float((a.argmax(-1) == b.argmax(-1)).mean()), 3)}


def w4a16_check(w4: Path, size: str, vocab: str, seed: int, synthetic, layers: int | None, max_linears: int) -> dict:
    """Dequantize up to ``max_linears`` quantized linears of the W4A16 checkpoint: equal to ``lite.rtn``'s
    quantize-dequantize of the seeded bf16 weight, and their largest error in quantization steps (half a step, a
    little more where the rounded zero point clips the range's end)."""
    import torch
    from safetensors import safe_open

    from lite.formats import unpack_awq
    from lite.rtn import fake_quantize

    cfg = synthetic.size_config(size, layers)
    lins = [m for i in range(cfg.num_hidden_layers) for m in cfg.quantized_linears(i)]
    step = max(1, len(lins) // max_linears)
    worst, checked, exact = 0.0, 0, True
    qc = json.loads((w4 / "config.json").read_text())["quantization_config"]
    with safe_open(str(w4 / "model.safetensors"), "pt") as f:
        for mod in lins[::step]:
            qw = unpack_awq(f.get_tensor(f"{mod}.qweight"), f.get_tensor(f"{mod}.qzeros"), f.get_tensor(f"{mod}.scales"),
                            4, qc["group_size"], True)
            deq = qw.dequantize(torch.float32)
            w = synthetic._random(f"{mod}.weight", tuple(deq.shape), seed).float()
            gs = qc["group_size"]
            s = qw.scales.float().t().repeat_interleave(gs, 1)  # [out, in]
            ratio = ((deq - w).abs() / s).max().item()
            worst, checked = max(worst, ratio), checked + 1
            exact = exact and torch.equal(deq, fake_quantize(w, 4, gs))
        keep = [k for k in f.keys() if k.endswith("mlp.gate.weight")][:1]
        router_dtype = str(f.get_tensor(keep[0]).dtype) if keep else None
    return {"linears_checked": checked, "linears": len(lins), "max_err_in_steps": round(worst, 4),
            "equals_lite_rtn_of_seeded_bf16": exact, "router_dtype": router_dtype}


def w4a16_as_checkpoint(w4: Path, dst: Path) -> Path:
    """The W4A16 checkpoint's linears dequantized into a float32 Hugging Face checkpoint (for transformers)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lite.formats import unpack_awq

    config = json.loads((w4 / "config.json").read_text())
    gs = config.pop("quantization_config")["group_size"]
    out = {}
    with safe_open(str(w4 / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for k in keys:
            if k.endswith(".qweight"):
                m = k[: -len(".qweight")]
                qw = unpack_awq(f.get_tensor(k), f.get_tensor(f"{m}.qzeros"), f.get_tensor(f"{m}.scales"), 4, gs, True)
                out[f"{m}.weight"] = qw.dequantize(torch.float32).contiguous()
            elif not k.endswith((".qzeros", ".scales")):
                out[k] = f.get_tensor(k).float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config.update(torch_dtype="float32", dtype="float32")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def check_size(size: str, args, synthetic) -> dict:
    row = {"size": size, "vocab": args.vocab, "layers": args.layers}
    cfg = synthetic.size_config(size, args.layers)
    row.update(parameters=cfg.num_parameters(args.vocab), active_parameters=cfg.active_parameters(args.vocab))
    want_bf16 = args.bf16 or size.startswith("tiny")
    ckpt = None
    if want_bf16:
        ckpt, row["bf16_seconds"] = _timed(lambda: synthetic.ensure_checkpoint(size, args.vocab, args.seed,
                                                                                args.cache_dir, quiet=True,
                                                                                layers=args.layers))
        row["bf16_gib"] = _disk(ckpt)
    w4, row["w4a16_seconds"] = _timed(lambda: synthetic.ensure_w4a16(size, args.vocab, args.seed, args.cache_dir,
                                                                      128, args.layers, quiet=True))
    row["w4a16_gib"] = _disk(w4)
    q4, row["q4_0_seconds"] = _timed(lambda: synthetic.ensure_q4_0_direct(size, args.vocab, args.seed, args.cache_dir,
                                                                          args.layers, quiet=True))
    row["q4_0_gib"] = _disk(q4)
    row["paths"] = {"bf16": str(ckpt) if ckpt else None, "w4a16": str(w4), "q4_0": str(q4)}
    row["w4a16_check"] = w4a16_check(w4, size, args.vocab, args.seed, synthetic, args.layers, args.max_linears)
    reason = synthetic.llama_cpp_missing()
    if reason:
        row["llama_cpp"] = reason
        return row
    lc = llama_cpp_run(q4, PROMPT, args.tokens)
    import numpy as np

    row["llama_cpp"] = {"load_seconds": lc["load_seconds"], "finite": bool(np.isfinite(lc["logits"]).all()),
                        "greedy": lc["greedy"], "decode_tok_s": lc["decode_tok_s"]}
    if ckpt is not None and not size.startswith("tiny"):  # float32 copies would not fit: the bf16 model itself
        row["llama_cpp_vs_bf16_transformers"] = compare(lc["logits"], hf_logits(ckpt, PROMPT, "bfloat16"))
    elif ckpt is not None:
        with tempfile.TemporaryDirectory(dir=str(synthetic.cache_root(args.cache_dir))) as tmp:
            ref = hf_logits(gguf_as_checkpoint(q4, ckpt, Path(tmp) / "q4", synthetic), PROMPT)
            bf16 = hf_logits(ckpt, PROMPT)
            w4l = hf_logits(w4a16_as_checkpoint(w4, Path(tmp) / "w4"), PROMPT)
        row["llama_cpp_vs_transformers_same_weights"] = compare(lc["logits"], ref)
        row["q4_0_vs_bf16_transformers"] = compare(ref, bf16)
        row["w4a16_vs_bf16_transformers"] = compare(w4l, bf16)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny-moe,tiny-olmoe")
    ap.add_argument("--vocab", default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--bf16", action="store_true", help="also write/use the bf16 checkpoint (always for tiny sizes)")
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens decoded by llama.cpp")
    ap.add_argument("--max-linears", type=int, default=64, help="W4A16 linears checked against the seeds")
    args = ap.parse_args()
    synthetic = _synthetic()
    for size in args.sizes.split(","):
        row = check_size(size, args, synthetic)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
