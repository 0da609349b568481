"""KV cache accuracy on a tiny model whose keys carry strong outlier channels (built by the tests).

    python bench/kv_outlier.py [--windows 8] [--seqlen 256] [--json]

The model is ``tests/tiny_models.build_key_outlier_model`` (2 layers, head_dim 16, key channels with a +-30
offset and a 20x weight row in every KV head); ``liteturbo lite calibrate-kv`` runs on it (C4, 32 x 128 tokens).
The caches: float32, int8 and int4 plain per-token ("online"), int4 Hadamard-rotated without calibration (int4's
default, ``kv_rotation``), int4 calibrated. Each cache scores the same WikiText-2 test windows through the engine's paged path (float32 compute); reported:
mean KL divergence of the next-token distribution from the float32 cache's, top-1 agreement with it, and the
perplexity of the text. A random-weight model's perplexity means little by itself; the distance to the float32
cache is the point.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

import common  # noqa: F401  (puts the repository root on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from tiny_models import build_key_outlier_model

    import calib_data
    from lite.kv_calibration import KVCalibConfig, calibrate_kv
    from turbo import Engine
    from turbo.core.request import StepInput

    tmp = tempfile.TemporaryDirectory()
    src = build_key_outlier_model(Path(tmp.name) / "outlier")
    cal = calibrate_kv(str(src), KVCalibConfig(calib_samples=32, calib_seqlen=128, device="cpu"),
                       str(Path(tmp.name) / "outlier-kvcal"))
    variants = {"float32": ("float32", False, False), "int8": ("int8", False, False),
                "int4 online": ("int4", False, False), "int4 rotated": ("int4", False, True),
                "int4 calibrated": ("int4", True, False)}
    engines = {n: Engine(cal, dtype="float32", kv_cache_dtype=kv, kv_calibration=c, kv_rotation=r,
                         max_kv_tokens=args.seqlen)
               for n, (kv, c, r) in variants.items()}
    tok = engines["float32"].tokenizer
    ids = tok(calib_data.wikitext2_test_text(), add_special_tokens=False)["input_ids"]
    windows = [ids[i * args.seqlen:(i + 1) * args.seqlen] for i in range(args.windows)]

    def logprobs(e, w):
        """float32 log-probabilities ``[len(w), vocab]`` of window ``w`` through engine ``e``'s paged cache."""
        bm, table = e.block_manager, []
        bm.ensure_capacity(table, len(w))
        try:
            step = StepInput(w, list(range(len(w))), bm.slots(table, 0, len(w)), [0, len(w)], [len(w)], [table],
                             list(range(len(w))))
            return torch.log_softmax(e.runner.run(step), -1)
        finally:
            bm.free(table)

    rows = {n: {"kl": 0.0, "top1": 0.0, "nll": 0.0} for n in variants}
    for w in windows:
        ref = logprobs(engines["float32"], w)
        targets = torch.tensor(w[1:])
        for n, e in engines.items():
            lp = logprobs(e, w)
            rows[n]["kl"] += float((ref.exp() * (ref - lp)).sum(-1).mean()) / len(windows)
            rows[n]["top1"] += float((ref.argmax(-1) == lp.argmax(-1)).float().mean()) / len(windows)
            rows[n]["nll"] += float(-lp[:-1].gather(1, targets[:, None]).mean()) / len(windows)
    for r in rows.values():
        r["ppl"] = float(torch.tensor(r.pop("nll")).exp())
    if args.json:
        print(json.dumps({"windows": args.windows, "seqlen": args.seqlen, "caches": rows}))
        return
    print(f"tiny key-outlier model, {args.windows} WikiText-2 windows of {args.seqlen} tokens")
    print(f"{'KV cache':16s} {'KL to float32':>14s} {'top-1 agree':>12s} {'PPL':>9s}")
    for n, r in rows.items():
        print(f"{n:16s} {r['kl']:14.2e} {r['top1']:12.3f} {r['ppl']:9.2f}")


if __name__ == "__main__":
    main()
