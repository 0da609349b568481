"""Sections 1-4 of the GPU harness (bench/gpu_compass.py): environment and ceilings, the W4A16 linear against
cuBLAS / dequantize + matmul / torch's int4 kernel, paged decode attention per KV dtype, and the float64 check of
what was timed. A mixin of the harness's child process (``Child``): ``self.row`` records, ``self.left`` is the time
left, ``self.measure`` times in CUDA graphs (wall clocks in the dry run).
"""
from __future__ import annotations

import glob
import math
import os
import subprocess
import sys
import time
import traceback

from compass_common import GIB, MIB, StickyCudaError, importable, err_text


class KernelSections:
    """Sections env, w4a16, attention and check of :class:`gpu_compass.Child`."""

    # =============================================================================================================
    # 1. environment and ceilings
    # =============================================================================================================
    def sec_env(self) -> None:
        torch = self.torch
        info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                    dry_run=self.dry, device=self.dev)
        try:
            import triton

            info["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            info["triton"] = f"not importable: {err_text(e)}"
        try:
            import transformers

            info["transformers"] = transformers.__version__
        except Exception as e:  # noqa: BLE001
            info["transformers"] = f"not importable: {err_text(e)}"
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
        for mod in ("xdist", "pytest_timeout"):
            info["has_" + mod] = importable(mod)
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            info.update(device_name=p.name, sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                        total_mem_gib=round(p.total_memory / GIB, 1))
            l2 = getattr(p, "L2_cache_size", None) or getattr(p, "l2_cache_size", None)
            info["l2_bytes"] = int(l2) if l2 else 60 * MIB
            info["l2_source"] = "device properties" if l2 else "assumed (H200: 60 MB)"
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
                info["nvidia_smi"] = q.stdout.strip()[:200]
            except Exception as e:  # noqa: BLE001
                info["nvidia_smi"] = err_text(e)
        else:
            info.update(device_name="cpu", sms=os.cpu_count(), l2_bytes=None)
        self.row(kind="info", **info)
        self.ceil.update(l2_bytes=info.get("l2_bytes"), sms=info.get("sms"))
        # copy bandwidth: read + write bytes per second of one large copy
        nbytes = 2 * GIB if self.cuda else 64 * MIB
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        src.fill_(1)
        dst = torch.empty_like(src)
        reps = 10 if self.cuda else 5
        r = self._time_op(lambda: dst.copy_(src), reps)
        gbps = 2 * nbytes / (r / 1e6) / 1e9
        self.ceil["copy_gbps"] = gbps
        self.row(kind="copy", bytes=nbytes, us=r, copy_gbps=gbps, timing="cuda_events" if self.cuda else "wall",
                 note="read+write bytes / time")
        src = dst = None  # noqa: F841
        self.free()
        # dense 16-bit matmul
        n = 8192 if self.cuda else 512
        dt = torch.bfloat16 if self.cuda else torch.float32
        a = torch.randn(n, n, dtype=dt, device=self.dev)
        b = torch.randn(n, n, dtype=dt, device=self.dev)
        us = self._time_op(lambda: a @ b, 10 if self.cuda else 3)
        tf = 2 * n ** 3 / (us / 1e6) / 1e12
        self.ceil["matmul_tflops"] = tf
        self.row(kind="matmul", n=n, dtype=str(dt).replace("torch.", ""), us=us, matmul_tflops=tf)

    def _time_op(self, fn, reps: int) -> float:
        """Microseconds per call of ``fn`` (eager; warmed up; CUDA events on GPU, wall clock on CPU)."""
        fn()
        self.sync()
        if self.cuda:
            e0, e1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) * 1e3 / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e6 / reps

    # =============================================================================================================
    # 2. W4A16
    # =============================================================================================================
    def _rand_qw(self, n: int, k: int, gs: int, gen):
        """A random 4-bit weight (codes, zero points) with scales exact in both bf16 and fp16."""
        torch = self.torch
        from backends import QuantizedWeight

        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=self.dev, generator=gen)
        zeros = torch.randint(0, 16, (k // gs, n), dtype=torch.uint8, device=self.dev, generator=gen)
        scales = (torch.rand(k // gs, n, device=self.dev, generator=gen) * 2e-3 + 2e-3).to(torch.bfloat16).to(torch.float16)
        return QuantizedWeight(bits=4, group_size=gs, sym=False, qweight=codes, qzeros=zeros, scales=scales)

    def _copies(self, nbytes: int) -> int:
        c = self.cfg
        l2 = self.ceil.get("l2_bytes") or 60 * MIB
        if not self.cuda:
            return c["min_copies"]
        return int(min(c["max_copies"], max(c["min_copies"], math.ceil(4 * l2 / nbytes))))

    def sec_w4a16(self) -> None:
        torch = self.torch
        from backends import get_backend

        c = self.cfg
        gs = c["group"]
        b = get_backend("triton", self.dev)
        try:
            bdq = get_backend("triton", self.dev, dequant_min_rows=1)
            dq_why = None
        except Exception as e:  # noqa: BLE001
            bdq, dq_why = None, f"the triton backend takes no dequant_min_rows=1 ({err_text(e)})"
        int4 = self._torch_int4_ops()
        copy_gbps = self.ceil.get("copy_gbps")
        gen = torch.Generator(device=self.dev).manual_seed(0)
        blocks = [(dt, s) for dt in c["w4_dtypes"] for s in c["w4_shapes"]]
        weights: dict = {}  # shape name -> list of QuantizedWeight copies (shared by both dtypes)
        failed: dict = {}  # (impl, dtype, M) -> first error, so a broken kernel is not compiled again and again
        # the first block of each dtype compiles every M bucket: it gets a double share of the section's time
        weight = [2 if bi == 0 or blocks[bi - 1][0] != dt_ else 1 for bi, (dt_, _) in enumerate(blocks)]
        for bi, (dt_name, (sname, k, n)) in enumerate(blocks):
            dt = getattr(torch, dt_name)
            block_end = time.time() + self.left() * weight[bi] / sum(weight[bi:])
            w_bytes = n * k // 2
            ncopy = self._copies(w_bytes + (k // gs) * n * 3)
            base = dict(dtype=dt_name, shape=sname, K=k, N=n, group_size=gs)
            if self.left() < 2:
                self.row(**base, skipped="the section's time is spent")
                continue
            t = time.time()
            if sname not in weights:
                weights[sname] = [self._rand_qw(n, k, gs, gen) for _ in range(ncopy)]
                self._save_check("qw_" + sname, dict(qweight=weights[sname][0].qweight, qzeros=weights[sname][0].qzeros,
                                                     scales=weights[sname][0].scales, group_size=gs))
            qws = weights[sname]
            impls, handles, dqh, packs = {}, None, None, None
            tp = time.time()
            prep_note = None
            try:
                handles, prep_note = self._prepare(b, qws, dt)
                self.sync()
                prep_s = (time.time() - tp) / len(qws)
                impls["triton"] = [lambda h=h: b.w4a16_linear(self._x, h) for h in handles]
            except Exception as e:  # noqa: BLE001
                self.row(**base, impl="triton", error=f"prepare_w4a16: {err_text(e)}", traceback=traceback.format_exc()[-3000:])
                prep_s = None
            nd = self._copies(2 * n * k)
            dense = [q.dequantize(dt) for q in qws[:nd]]
            impls["cublas"] = [lambda w=w: torch.nn.functional.linear(self._x, w) for w in dense]
            if bdq is not None:
                try:
                    dqh = self._prepare(bdq, qws, dt)[0]
                    impls["dequant_mm"] = [lambda h=h: bdq.w4a16_linear(self._x, h) for h in dqh]
                except Exception as e:  # noqa: BLE001
                    self.row(**base, impl="dequant_mm", error=f"prepare_w4a16: {err_text(e)}")
            if int4 is not None:
                try:
                    packs = [int4["prep"](q, dt) for q in qws]
                    impls["torch_int4"] = [lambda p=p: int4["mm"](self._x, p, gs) for p in packs]
                except Exception as e:  # noqa: BLE001
                    self.row(**base, impl="torch_int4", skipped=f"torch's int4 kernel cannot take {dt_name} here: "
                                                                f"{err_text(e)}")
            self.row(**base, kind="setup", copies=ncopy, dense_copies=nd, weight_bytes=w_bytes,
                     bytes_all_copies=ncopy * w_bytes, prepare_s_per_weight=prep_s, prepare_note=prep_note,
                     setup_s=time.time() - t,
                     dequant_mm=dq_why or "backend(dequant_min_rows=1)",
                     torch_int4="aten._weight_int4pack_mm" if int4 is not None else self._int4_why)
            check = {}
            for m in c["w4_ms"]:
                self._x = torch.randn(m, k, dtype=dt, device=self.dev, generator=gen)
                outs = {}
                for impl, fns in impls.items():
                    if (m != c["w4_ms"][0] and time.time() > block_end) or self.left() < 1:
                        self.row(**base, M=m, impl=impl, skipped="this block's share of the section time is spent")
                        continue
                    if (impl, dt_name, m) in failed:
                        self.row(**base, M=m, impl=impl, skipped=f"failed at this dtype and M for another shape: "
                                                                 f"{failed[(impl, dt_name, m)]}")
                        continue
                    try:
                        r = self.measure(fns, c["graph_ops"], c["reps"])
                    except StickyCudaError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        failed[(impl, dt_name, m)] = err_text(e)[:200]
                        if impl == "torch_int4" and isinstance(e, (RuntimeError, NotImplementedError)):
                            self.row(**base, M=m, impl=impl, skipped=f"torch's int4 kernel failed: {err_text(e)}")
                        else:
                            self.row(**base, M=m, impl=impl, error=err_text(e), traceback=traceback.format_exc()[-3000:])
                        if not self.healthy():
                            raise StickyCudaError(f"{impl} {dt_name} {sname} M={m}: {err_text(e)}") from e
                        continue
                    nbytes = 2 * n * k if impl == "cublas" else w_bytes
                    gbps = nbytes / (r["us"] / 1e6) / 1e9
                    outs[impl] = r.pop("out")
                    self.row(**base, M=m, impl=impl, us=r["us"], gbps=gbps, bytes=nbytes,
                             frac_copy=gbps / copy_gbps if copy_gbps else None,
                             copies=len(fns), **{k_: v for k_, v in r.items() if k_ != "us"})
                if outs and (m == c["w4_ms"][0] or m == c["w4_ms"][-1]):
                    check[m] = dict(x=self._x, outs=outs)
            self._save_check(f"w4_{dt_name}_{sname}", dict(shape=sname, dtype=dt_name, K=k, N=n, cases=check))
            impls = dense = handles = dqh = packs = check = outs = None  # noqa: F841  (free before the next block)
            self._x = None
            if not any(s[0] == sname for _, s in blocks[bi + 1:]):  # the last block of this shape frees its copies
                weights.pop(sname, None)
            self.free()

    _int4_why = None

    def _prepare(self, backend, qws: list, dt) -> tuple[list, str | None]:
        """``backend.prepare_w4a16`` of every copy; weights on the device first, and if the backend refuses those,
        from CPU copies (what a checkpoint loader hands it)."""
        try:
            return [backend.prepare_w4a16(q, dt) for q in qws], None
        except Exception as e:  # noqa: BLE001
            if not self.cuda:
                raise
            first = err_text(e)
        from backends import QuantizedWeight

        out = []
        for q in qws:
            cq = QuantizedWeight(bits=q.bits, group_size=q.group_size, sym=q.sym, qweight=q.qweight.cpu(),
                                 qzeros=q.qzeros.cpu(), scales=q.scales.cpu())
            out.append(backend.prepare_w4a16(cq, dt))
        return out, f"prepared from CPU tensors (from device tensors: {first[:200]})"

    def _torch_int4_ops(self):
        """torch's own int4 (tinygemm) kernel: ``W = (q - 8) * s + z'`` with ``z' = (8 - zero) * s``."""
        torch = self.torch
        aten = torch.ops.aten
        if self.cuda:
            if not (hasattr(aten, "_convert_weight_to_int4pack") and hasattr(aten, "_weight_int4pack_mm")):
                self._int4_why = "this torch has no aten._weight_int4pack_mm"
                return None

            def prep(q, dt):
                codes = q.qweight
                packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()  # uint8 [N, K/2], even k high nibble
                w = aten._convert_weight_to_int4pack(packed, 8)
                s = q.scales.float()
                sz = torch.stack([s, (8.0 - q.qzeros.float()) * s], -1).to(dt).contiguous()
                return w, sz

            def mm(x, p, gs):
                return aten._weight_int4pack_mm(x, p[0], gs, p[1])
        else:
            if not (hasattr(aten, "_convert_weight_to_int4pack_for_cpu") and hasattr(aten, "_weight_int4pack_mm_for_cpu")):
                self._int4_why = "this torch has no aten._weight_int4pack_mm_for_cpu"
                return None

            def prep(q, dt):
                w = aten._convert_weight_to_int4pack_for_cpu(q.qweight.to(torch.int32).contiguous(), 8)
                s = q.scales.float()
                sz = torch.stack([s, (8.0 - q.qzeros.float()) * s], -1).to(dt).contiguous()
                return w, sz

            def mm(x, p, gs):
                return aten._weight_int4pack_mm_for_cpu(x, p[0], gs, p[1])
        return dict(prep=prep, mm=mm)

    def _save_check(self, name: str, obj: dict) -> None:
        """Material for the float64 check, kept on disk so that a fresh process can check it."""
        torch = self.torch

        def cpu(v):
            if isinstance(v, torch.Tensor):
                return v.detach().cpu()
            if isinstance(v, dict):
                return {k: cpu(x) for k, x in v.items()}
            return v

        torch.save(cpu(obj), self.work / f"check_{name}.pt")

    # =============================================================================================================
    # 3. attention
    # =============================================================================================================
    def sec_attention(self) -> None:
        torch = self.torch
        from backends import AttentionMetadata, KVCacheSpec, get_backend

        a = self.cfg["att"]
        b = get_backend("triton", self.dev)
        ctx, L, H, KVH, D, bs = a["ctx"], a["layers"], a["heads"], a["kv_heads"], a["head_dim"], a["block"]
        bmax = max(a["batches"])
        nb_seq = -(-ctx // bs)
        dt = torch.bfloat16
        scale = D ** -0.5
        copy_gbps = self.ceil.get("copy_gbps")
        gen = torch.Generator(device=self.dev).manual_seed(1)
        kvs = self.cfg["kv_dtypes"]
        for ki, kv in enumerate(kvs):
            base = dict(kv=kv, ctx=ctx, layers=L, heads=H, kv_heads=KVH, head_dim=D, block_size=bs)
            kv_end = time.time() + self.left() / (len(kvs) - ki)
            if self.left() < 2:
                self.row(**base, skipped="the section's time is spent")
                continue
            t = time.time()
            try:
                spec = KVCacheSpec(kv, bmax * nb_seq, bs, L, KVH, D)
                cache = b.allocate_kv_cache(spec, dt)
                perm = torch.randperm(bmax * nb_seq, generator=torch.Generator().manual_seed(2))
                tables = [perm[i * nb_seq:(i + 1) * nb_seq].tolist() for i in range(bmax)]
                slots = torch.cat([(torch.tensor(tb) * bs).unsqueeze(1).add(torch.arange(bs)).reshape(-1)[:ctx]
                                   for tb in tables]).to(self.dev)
                kk = torch.randn(slots.numel(), KVH, D, dtype=dt, device=self.dev, generator=gen)
                vv = torch.randn(slots.numel(), KVH, D, dtype=dt, device=self.dev, generator=gen)
                for layer in range(L):
                    cache.write(layer, kk, vv, slots)
                del kk, vv
                self.sync()
            except StickyCudaError:
                raise
            except Exception as e:  # noqa: BLE001
                self.row(**base, error=f"allocating / writing the cache: {err_text(e)}",
                         traceback=traceback.format_exc()[-3000:])
                if not self.healthy():
                    raise StickyCudaError(f"KV {kv} write: {err_text(e)}") from e
                continue
            self.row(**base, kind="setup", cache_gib=spec.total_bytes() / GIB, setup_s=time.time() - t,
                     bytes_per_token_head=spec.bytes_per_token_head())
            check = None
            for bi, bsz in enumerate(a["batches"]):
                if (bi and time.time() > kv_end) or self.left() < 1:  # the first batch size always, if time is left
                    self.row(**base, batch=bsz, skipped="this KV dtype's share of the section time is spent")
                    continue
                q = torch.randn(bsz, H, D, dtype=dt, device=self.dev, generator=gen)
                last = torch.tensor([tables[i][(ctx - 1) // bs] * bs + (ctx - 1) % bs for i in range(bsz)],
                                    dtype=torch.long, device=self.dev)
                meta = AttentionMetadata(slot_mapping=last, query_start=list(range(bsz + 1)), context_lens=[ctx] * bsz,
                                         block_tables=[tables[i] for i in range(bsz)], block_size=bs)
                fns = [lambda layer=layer: b.attention(q, cache, layer, meta, scale) for layer in range(L)]
                try:
                    r = self.measure(fns, max(self.cfg["graph_ops"], L), self.cfg["reps"])
                except StickyCudaError:
                    raise
                except Exception as e:  # noqa: BLE001
                    self.row(**base, batch=bsz, error=err_text(e), traceback=traceback.format_exc()[-3000:])
                    if not self.healthy():
                        raise StickyCudaError(f"attention KV {kv} batch {bsz}: {err_text(e)}") from e
                    break  # the other batch sizes would fail the same way
                nbytes = bsz * ctx * KVH * 2 * spec.bytes_per_token_head()
                out = r.pop("out")
                us = r.pop("us")
                gbps = nbytes / (us / 1e6) / 1e9
                self.row(**base, batch=bsz, us_per_layer=us, kv_bytes=nbytes, gbps=gbps,
                         token_heads_per_s=bsz * ctx * KVH / (us / 1e6),
                         frac_copy=gbps / copy_gbps if copy_gbps else None, **r)
                if check is None or bsz <= 2:
                    nchk = min(bsz, 2)
                    seqs = []
                    for i in range(nchk):
                        s_i = slots[i * ctx:(i + 1) * ctx]
                        k_i, v_i = cache.read(0, s_i)  # [ctx, KVH, D] float32: the stored values
                        seqs.append(dict(k=k_i, v=v_i))
                    check = dict(kv=kv, batch=bsz, q=q[:nchk], out=out[:nchk], seqs=seqs, scale=scale)
            if check is not None:
                self._save_check(f"att_{kv}", check)
            cache = None  # noqa: F841
            self.free()

    # =============================================================================================================
    # 4. float64 check
    # =============================================================================================================
    def sec_check(self) -> None:
        torch = self.torch
        from backends import QuantizedWeight

        tol = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}
        files = sorted(glob.glob(str(self.work / "check_w4_*.pt")))
        att_files = sorted(glob.glob(str(self.work / "check_att_*.pt")))
        if not files and not att_files:
            self.row(skipped="nothing was timed (the w4a16 and attention sections left no outputs)")
            return
        for f in files:
            if self.left() < 0.5:
                self.row(file=os.path.basename(f), skipped="the section's time is spent")
                continue
            blk = torch.load(f, weights_only=False)
            qd = torch.load(self.work / f"check_qw_{blk['shape']}.pt", weights_only=False)
            qw = QuantizedWeight(bits=4, group_size=qd["group_size"], sym=False, qweight=qd["qweight"].to(self.dev),
                                 qzeros=qd["qzeros"].to(self.dev), scales=qd["scales"].to(self.dev))
            w64 = qw.dequantize(torch.float64)
            for m, case in blk["cases"].items():
                ref = case["x"].to(self.dev).double() @ w64.t()
                den = ref.abs().max().item() or 1.0
                for impl, y in case["outs"].items():
                    y = y.to(self.dev).double()
                    e = (y - ref).abs().max().item() / den
                    finite = bool(torch.isfinite(y).all())
                    self.row(kind="w4a16", impl=impl, dtype=blk["dtype"], shape=blk["shape"], M=int(m),
                             max_rel_err=e if finite else None, finite=finite,
                             ok=finite and e < tol[blk["dtype"]], tol=tol[blk["dtype"]])
            del w64, qw
        for f in att_files:
            c = torch.load(f, weights_only=False)
            q = c["q"].to(self.dev).double()  # [B, H, D]
            out = c["out"].to(self.dev).double()
            nb, H, D = q.shape
            worst, finite = 0.0, bool(torch.isfinite(out).all())
            for i, s in enumerate(c["seqs"]):
                k, v = s["k"].to(self.dev).double(), s["v"].to(self.dev).double()  # [ctx, KVH, D]
                g = H // k.shape[1]
                kh = k.repeat_interleave(g, 1).transpose(0, 1)  # [H, ctx, D]
                vh = v.repeat_interleave(g, 1).transpose(0, 1)
                p = torch.softmax((kh @ q[i].unsqueeze(-1)).squeeze(-1) * c["scale"], -1)  # [H, ctx]
                ref = (p.unsqueeze(1) @ vh).squeeze(1)  # [H, D]
                worst = max(worst, (out[i] - ref).abs().max().item() / (ref.abs().max().item() or 1.0))
            self.row(kind="attention", impl="triton", kv=c["kv"], batch=c["batch"], seqs_checked=nb,
                     max_rel_err=worst if finite else None, finite=finite, ok=finite and worst < tol["bfloat16"],
                     tol=tol["bfloat16"])
