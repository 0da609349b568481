"""Wall time and peak memory of ``lite`` methods on a random model of a real shape, on any device.

    python bench/lite_speed.py [--shape llama3-8b] [--layers 2] [--device cuda] [--methods rtn,awq,gptq] [--json]

Builds (once, in ``--dir``) a float16 random-weight Llama checkpoint with the hidden/intermediate/head sizes of
``--shape`` but only ``--layers`` decoder layers, with a word-level tokenizer over the bundled C4 sample, then runs
each method through :func:`lite.pipeline.quantize_model` with the default calibration (128 x 512 tokens) and reports
its wall time and peak memory (CUDA: peak allocated). Two runs with different ``--layers`` give the time per layer
(their difference), which is what scales to the full model.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab
    "llama3-8b": (4096, 14336, 32, 8, 128256),
    "qwen2.5-7b": (3584, 18944, 28, 4, 152064),
    "smollm2-135m": (576, 1536, 9, 3, 49152),
}


def build(path: Path, shape: str, layers: int) -> None:
    """A float16 random Llama of ``shape`` with ``layers`` decoder layers and a word-level tokenizer."""
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import save_word_tokenizer

    h, inter, heads, kv, vocab = SHAPES[shape]
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    model.save_pretrained(path)
    save_word_tokenizer(path, vocab)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--methods", default="rtn,awq,gptq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/lt-lite-speed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    from lite.layerwise import peak_memory_gib
    from lite.pipeline import PipelineConfig, quantize_model

    src = Path(args.dir) / f"{args.shape}-{args.layers}l"
    if not (src / "config.json").is_file():
        build(src, args.shape, args.layers)
    rows = []
    for method in args.methods.split(","):
        cfg = PipelineConfig(method=method, w_group_size=args.group_size, device=args.device)
        dev = cfg.torch_device()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        out = quantize_model(str(src), cfg, str(Path(args.dir) / f"out-{method}"), overwrite=True)
        wall = time.perf_counter() - t
        info = json.loads((out / "liteturbo_quantize.json").read_text())
        rows.append({"method": method, "shape": args.shape, "layers": args.layers, "device": dev.type,
                     "wall_s": round(wall, 1), "peak_gib": round(peak_memory_gib(dev), 2),
                     "compute_dtype": info["compute_dtype"], "calibration_tokens": info["calibration_tokens"]})
        print(json.dumps(rows[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
        return
    print("| method | shape | layers | device | wall (s) | peak (GiB) |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['method']} | {r['shape']} | {r['layers']} | {r['device']} | {r['wall_s']} | {r['peak_gib']} |")


if __name__ == "__main__":
    main()
