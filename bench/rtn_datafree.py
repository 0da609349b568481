"""Calibration-free W4 rounding candidates for `lite rtn` on SmolLM2-135M, by perplexity (issue 38's search).

    python bench/rtn_datafree.py 16bit,plain,mse2.4,mse2,wmse2,eq-0.5-up [WINDOWS]

Each candidate fake-quantizes every decoder linear (4 bits, groups of 64, asymmetric, fp16 scales as stored) of the
float32 transformers model and scores WikiText-2 and Chinese perplexity on the first WINDOWS (default 4) windows of
2048 tokens (same text as bench/quality.py). Candidates:

- ``plain``: min/max per group (today's `lite rtn`);
- ``mse2.4`` / ``mse2``: per group, the range shrunk by 0..20 % (21 steps) with the smallest ``sum |err|^p``;
- ``wmse2``: the same, each input channel's error weighted by a data-free importance proxy (the squared RMSNorm
  weight before q/k/v and gate/up; for o_proj the norm of the v row it reads, for down_proj the product of the
  gate and up row norms);
- ``hqq0.7`` / ``hqq0.5`` / ``hqq1``: an HQQ-style half-quadratic fit (Badri & Shaji 2023) in the stored format:
  integer zero points, the fp16 scale refit by least squares against the weights less an l_p-shrunk error (p < 1:
  outliers may keep a large error), 20 iterations;
- ``plain32``: min/max with groups of 32 (the blocks of the Q4_1 file the embedded model was dequantized from; a
  different format size, for scale: see docs/quantization.md);
- ``eq-ALPHA[-PAIRS]``: data-free equalization (AWQ's fold with the proxy instead of activations): input channel j
  scaled by ``proxy_j^ALPHA`` before rounding and the inverse folded into the previous norm or linear; PAIRS picks
  ``qkv``, ``gate`` (norms into q/k/v, gate/up), ``v`` (v rows into o_proj), ``up`` (up rows into down_proj).
"""
import math
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import calib_data  # noqa: E402
from lite.formats.checkpoint import resolve_model  # noqa: E402
from lite.rtn import group_params  # noqa: E402

P = str(resolve_model("smollm2-135m-instruct"))
tok = transformers.AutoTokenizer.from_pretrained(P)
base = transformers.AutoModelForCausalLM.from_pretrained(P, dtype=torch.float32).eval()
W0 = {n: p.detach().clone() for n, p in base.named_parameters()}
NW = int(sys.argv[2]) if len(sys.argv) > 2 else 4
wins = {}
for name in ("wikitext2", "zh"):
    ids = tok(calib_data.eval_text(name), return_tensors="pt").input_ids[0]
    wins[name] = [ids[i*2048:(i+1)*2048] for i in range(NW)]

def ppl(model):
    """{text: perplexity} of ``model`` over the loaded windows."""
    out = {}
    with torch.no_grad():
        for name, ws in wins.items():
            nll, n = 0.0, 0
            for w in ws:
                lg = model(w[None]).logits[0, :-1].float()
                nll += float(torch.nn.functional.cross_entropy(lg, w[1:], reduction="sum")); n += len(w) - 1
            out[name] = math.exp(nll / n)
    return out

def fq(w, scale, zero, gs=64, bits=4):
    """``w [out, in]`` quantized with per-group ``scale``/``zero`` ``[out, in/gs]`` and dequantized (float32)."""
    o, i = w.shape
    g = w.reshape(o, i // gs, gs)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return ((q - zero[..., None]) * scale[..., None]).reshape(o, i)

def plain(w, d):
    """Min/max rounding of ``w`` (``d``, the importance, unused)."""
    s, z = group_params(w.reshape(w.shape[0], -1, 64), 4, False); return fq(w, s, z)

def grid(w, d, shrink=0.2, steps=21, norm=2.0, lo_hi=False):
    """per-group search over (shrink of max, shrink of min) minimizing sum_j d_j |err|^norm"""
    o, i = w.shape
    g = w.reshape(o, i // 64, 64).float()
    dd = d.reshape(1, i // 64, 64)
    wmin0, wmax0 = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    best = None
    cands = [(1 - a * shrink / (steps - 1), 1 - b * shrink / (steps - 1)) for a in range(steps) for b in (range(steps) if lo_hi else [a])]
    for pa, pb in cands:
        lo, hi = wmin0 * pa, wmax0 * pb
        s = ((hi - lo).clamp(min=1e-8) / 15).half().float()
        z = torch.clamp(torch.round(-lo / s), 0, 15)
        q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)
        err = (((q - z[..., None]) * s[..., None] - g).abs().pow(norm) * dd).sum(-1)
        if best is None: best, S, Z = err, s, z
        else:
            b = err < best; best = torch.where(b, err, best); S = torch.where(b, s, S); Z = torch.where(b, z, Z)
    return fq(w, S, Z)

def importance(model, kind):
    """per-linear input-channel weights d [in] (data-free proxy)"""
    out = {}
    for li, layer in enumerate(model.model.layers):
        p = f"model.layers.{li}."
        g1 = W0[p + "input_layernorm.weight"].float(); g2 = W0[p + "post_attention_layernorm.weight"].float()
        one = lambda n: torch.ones(n)
        if kind == "none":
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                out[p + n] = one(W0[p + n + ".weight"].shape[1])
            continue
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"): out[p + n] = g1 ** 2
        for n in ("mlp.gate_proj", "mlp.up_proj"): out[p + n] = g2 ** 2
        wv = W0[p + "self_attn.v_proj.weight"].float() * g1
        rv = wv.pow(2).sum(1)  # per v output channel
        nq, nkv = model.config.num_attention_heads, model.config.num_key_value_heads
        hd = wv.shape[0] // nkv
        out[p + "self_attn.o_proj"] = rv.view(nkv, 1, hd).expand(nkv, nq // nkv, hd).reshape(-1)
        wg = (W0[p + "mlp.gate_proj.weight"].float() * g2).pow(2).sum(1); wu = (W0[p + "mlp.up_proj.weight"].float() * g2).pow(2).sum(1)
        out[p + "mlp.down_proj"] = wg * wu
    return out

def apply(model, fn, imp):
    """Replace every linear named in ``imp`` by ``fn(original weight, normalized importance)``."""
    with torch.no_grad():
        for n, d in imp.items():
            model.get_submodule(n).weight.copy_(fn(W0[n + ".weight"].float(), d / d.mean()))

def reset(model):
    """Restore the float weights."""
    with torch.no_grad():
        for n, p in model.named_parameters(): p.copy_(W0[n])

def eq_apply(model, alpha, pairs=("qkv", "up", "v", "gate")):
    """data-free AWQ-like scaling: input channel j of a linear scaled by s_j = a_j^alpha (proxy a), fold undone"""
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            p = f"model.layers.{li}."
            g1 = W0[p + "input_layernorm.weight"].float(); g2 = W0[p + "post_attention_layernorm.weight"].float()
            def q(w):
                """Plain rounding of ``w``."""
                return plain(w, None)

            def sc(a):
                """Per-channel scales ``a^alpha`` from a proxy ``a``, centred so max * min = 1."""
                s = a.clamp(min=1e-6).pow(alpha); return s / (s.max() * s.min()).sqrt()
            # q/k/v: input scaled by s (multiply columns), the norm weight divided (folded, exact in float)
            s1 = sc(g1.abs()) if "qkv" in pairs else torch.ones_like(g1)
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                w = W0[p + n + ".weight"].float(); model.get_submodule(p + n).weight.copy_(q(w * s1) / s1)
            s2 = sc(g2.abs()) if "gate" in pairs else torch.ones_like(g2)
            for n in ("mlp.gate_proj", "mlp.up_proj"):
                w = W0[p + n + ".weight"].float(); model.get_submodule(p + n).weight.copy_(q(w * s2) / s2)
            wv = W0[p + "self_attn.v_proj.weight"].float(); wo = W0[p + "self_attn.o_proj.weight"].float()
            nq, nkv = model.config.num_attention_heads, model.config.num_key_value_heads
            hd = wv.shape[0] // nkv
            if "v" in pairs:
                a = (wv * g1).pow(2).sum(1).sqrt(); sv = sc(a)  # per v output channel
                so = sv.view(nkv, 1, hd).expand(nkv, nq // nkv, hd).reshape(-1)
                # o columns *= so ; v rows /= sv  (exact: o input = attn-weighted v)
                wvq = q(wv * s1 / sv[:, None]) * sv[:, None] / s1
                model.get_submodule(p + "self_attn.v_proj").weight.copy_(wvq)
                model.get_submodule(p + "self_attn.o_proj").weight.copy_(q(wo * so) / so)
            else:
                model.get_submodule(p + "self_attn.o_proj").weight.copy_(q(wo))
            wu = W0[p + "mlp.up_proj.weight"].float(); wd = W0[p + "mlp.down_proj.weight"].float()
            wg = W0[p + "mlp.gate_proj.weight"].float()
            if "up" in pairs:
                a = (wg * g2).pow(2).sum(1).sqrt() * (wu * g2).pow(2).sum(1).sqrt(); su = sc(a)
                model.get_submodule(p + "mlp.up_proj").weight.copy_(q(wu * s2 / su[:, None]) * su[:, None] / s2)
                model.get_submodule(p + "mlp.down_proj").weight.copy_(q(wd * su) / su)
            else:
                model.get_submodule(p + "mlp.down_proj").weight.copy_(q(wd))


def hqq(w, d, p=0.7, iters=20, beta=10.0, kappa=1.01, gs=64):
    """HQQ-style half-quadratic fit (Badri & Shaji 2023) in the stored format: integer zero points, a free fp16
    scale per group, minimizing sum |err|^p (p < 1, outlier-robust) by alternating an l_p shrinkage of the error
    with a closed-form least-squares scale; starts from min/max."""
    o, i = w.shape
    g = w.reshape(o, i // gs, gs).float()
    s, z = group_params(g, 4, False)
    for _ in range(iters):
        q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)
        r = g - (q - z[..., None]) * s[..., None]
        e = torch.sign(r) * torch.relu(r.abs() - r.abs().clamp(min=1e-12).pow(p - 1) / beta)
        t = g - e  # what the grid should represent
        qz = q - z[..., None]
        s = ((qz * t).sum(-1) / (qz * qz).sum(-1).clamp(min=1e-12)).clamp(min=1e-8).half().float()
        beta *= kappa
    return fq(w, s, z, gs)

def plain_gs(w, d, gs):
    """Min/max rounding with group size ``gs``."""
    s, z = group_params(w.reshape(w.shape[0], -1, gs), 4, False); return fq(w, s, z, gs)

exps = {
 "16bit": None,
 "plain": (plain, "none"),
 "mse2.4": (lambda w, d: grid(w, d, norm=2.4), "none"),
 "mse2": (lambda w, d: grid(w, d, norm=2.0), "none"),
 "wmse2": (lambda w, d: grid(w, d, norm=2.0), "proxy"),
 "hqq0.7": (hqq, "none"),
 "hqq0.5": (lambda w, d: hqq(w, d, p=0.5), "none"),
 "hqq1": (lambda w, d: hqq(w, d, p=1.0, beta=1e4), "none"),
 "plain32": (lambda w, d: plain_gs(w, d, 32), "none"),
 "wmse2-lohi": (lambda w, d: grid(w, d, shrink=0.15, steps=7, norm=2.0, lo_hi=True), "proxy"),
}
for name in sys.argv[1].split(","):
    reset(base)
    t = time.time()
    if name.startswith("eq"):
        parts = name.split("-"); eq_apply(base, float(parts[1]), tuple(parts[2:]) or ("qkv", "up", "v", "gate"))
    elif exps[name]:
        fn, kind = exps[name]; apply(base, fn, importance(base, kind))
    tq = time.time() - t
    r = ppl(base)
    print(name, {k: round(v, 3) for k, v in r.items()}, f"quant {tq:.1f}s", flush=True)
