"""Which calibrated KV transform: per-layer attention error of int4 keys / values under each candidate.

    python bench/kv_methods.py [--layers 12] [--windows 8] [--seqlen 512] [--json]

SmolLM2-135M-Instruct (16-bit), C4 calibration windows (seed 42), run layer by layer with ``lite``'s pipeline.
For each of the first ``--layers`` layers: the relative error of the attention output
``Σ||attn(Q, K̂, V) − attn(Q, K, V)||² / Σ||attn(Q, K, V)||²`` with keys stored as each candidate (values exact),
and with values stored plain or rotated (keys exact); then the mean over layers and the mean of per-layer ratios
to the online mode. This is the table behind the choice in docs/kv-cache.md; ``calibrate-kv`` searches the same
quantities per layer.
"""
from __future__ import annotations

import argparse
import json

import torch

import common  # noqa: F401  (puts the repository root on sys.path)


def main() -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from lite.calibration import calibration_samples
    from lite.formats import resolve_model
    from lite.kv_calibration import (_attend, fake_quantize_keys, fake_quantize_values, layer_qkv, pair_absmax,
                                     search_key_transform)
    from lite.layerwise import LazyCheckpoint, run_layer as _run_layer

    src = resolve_model(None)
    lazy = LazyCheckpoint(src, torch.device("cpu"))
    samples = calibration_samples(AutoTokenizer.from_pretrained(str(src)), "c4", args.windows, args.seqlen, 42)
    inps, kws = lazy.capture_inputs(samples)
    rows = []
    for i in range(args.layers):
        layer = lazy.layers[i]
        lazy.materialize(layer, f"model.layers.{i}")
        with torch.no_grad():
            win = [layer_qkv(layer, h, kw, False) for h, kw in zip(inps, kws)]
            refs = [_attend(q, k, v) for q, k, v in win]
            den = sum(float(r.square().sum()) for r in refs)

            def err(fk=lambda k: k, fv=lambda v: v):
                return sum(float((_attend(q, fk(k), fv(v)) - r).square().sum()) for (q, k, v), r in zip(win, refs)) / den

            keys = torch.cat([k for _, k, _ in win])
            mean, zero, ones = keys.mean(0), torch.zeros_like(keys[0]), torch.ones_like(keys[0])
            scaled = search_key_transform(keys, win, 4, 6, rotation=False)
            m = pair_absmax(keys - mean)
            s25 = m.pow(0.25) / m.pow(0.25).amax(-1, keepdim=True)
            rows.append({
                "online": err(lambda k: fake_quantize_keys(k, zero, ones, 4)),
                "shift+scales (alpha searched)": err(lambda k: fake_quantize_keys(k, scaled.shift, scaled.scale, 4)),
                "hadamard only": err(lambda k: fake_quantize_keys(k, zero, ones, 4, True)),
                "shift+hadamard": err(lambda k: fake_quantize_keys(k, mean, ones, 4, True)),
                "shift+scales(alpha 0.25)+hadamard": err(lambda k: fake_quantize_keys(k, mean, s25, 4, True)),
                "values online": err(fv=lambda v: fake_quantize_values(v, 4)),
                "values hadamard": err(fv=lambda v: fake_quantize_values(v, 4, True)),
            })
            inps = _run_layer(layer, inps, kws)
        lazy.release(layer)
    names = list(rows[0])
    summary = {n: {"mean_error": sum(r[n] for r in rows) / len(rows),
                   "mean_ratio_to_online": sum(r["values online" if n.startswith("values") else "online"] / r[n]
                                               for r in rows) / len(rows)} for n in names}
    if args.json:
        print(json.dumps({"layers": rows, "summary": summary}))
        return
    print(f"int4 attention error, SmolLM2 layers 0-{args.layers - 1}, {args.windows} C4 windows of {args.seqlen}")
    for n in names:
        print(f"{n:36s} {summary[n]['mean_error']:.2e}  {summary[n]['mean_ratio_to_online']:.1f}x lower than online")


if __name__ == "__main__":
    main()
