"""Sections 5-8 of the GPU harness (bench/gpu_compass.py): a random Llama-3-8B-shaped AWQ checkpoint built and
loaded, engine decode (batch 1 with CUDA graphs and eager, 32 x (128 + 128)) against the roofline, GPU vs CPU
float32 logits, and the GPU-relevant tests. A mixin of the harness's child process (``Child``).
"""
from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from compass_common import (GIB, MIB, REPO, StickyCudaError, TEST_FILES, gpu_busy, importable, kill_group,
                            pytest_summary, step_count, err_text, read_status, write_status)


class ModelSections:
    """Sections checkpoint, decode, logits and tests of :class:`gpu_compass.Child`."""

    # =============================================================================================================
    # 5. checkpoint
    # =============================================================================================================
    def _build(self, path: Path, shape: dict, layers: int, vocab: int, seed: int = 0) -> dict:
        """Write a random AWQ GEMM checkpoint (random int32 qweight/qzeros, fp16 scales) with a word-level
        tokenizer; returns sizes. Random bytes are drawn on the GPU when there is one."""
        torch = self.torch
        from safetensors.torch import save_file

        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import save_word_tokenizer

        t = time.time()
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        h, inter, hd, gs = shape["hidden"], shape["inter"], shape["head_dim"], shape["group"]
        qo, kvo = shape["heads"] * hd, shape["kv_heads"] * hd
        lin = {"self_attn.q_proj": (qo, h), "self_attn.k_proj": (kvo, h), "self_attn.v_proj": (kvo, h),
               "self_attn.o_proj": (h, qo), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
               "mlp.down_proj": (h, inter)}
        gen = torch.Generator(device=self.dev).manual_seed(seed)

        def bits32(rows, cols):  # 8 random 4-bit codes per int32
            return torch.randint(0, 256, (rows, cols * 4), dtype=torch.uint8, device=self.dev,
                                 generator=gen).view(torch.int32).cpu()

        def normal(rows, cols):
            return (torch.randn(rows, cols, device=self.dev, generator=gen) * 0.02).to(torch.bfloat16).cpu()

        files, wmap, lin_bytes = [], {}, 0
        nfiles = layers + 2

        def put(i, tensors):
            name = f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors"
            save_file(tensors, str(path / name), metadata={"format": "pt"})
            for k in tensors:
                wmap[k] = name
            files.append(name)

        put(0, {"model.embed_tokens.weight": normal(vocab, h)})
        for i in range(layers):
            p = f"model.layers.{i}"
            ts = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
            for name, (n_out, k_in) in lin.items():
                ts[f"{p}.{name}.qweight"] = bits32(k_in, n_out // 8)
                ts[f"{p}.{name}.qzeros"] = bits32(k_in // gs, n_out // 8)
                ts[f"{p}.{name}.scales"] = (torch.rand(k_in // gs, n_out, device=self.dev, generator=gen) * 2e-3
                                            + 2e-3).half().cpu()
                lin_bytes += sum(ts[f"{p}.{name}.{x}"].nbytes for x in ("qweight", "qzeros", "scales"))
            put(1 + i, ts)
        put(layers + 1, {"model.norm.weight": torch.ones(h, dtype=torch.bfloat16), "lm_head.weight": normal(vocab, h)})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
               "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"], "head_dim": hd,
               "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 0,
               "eos_token_id": 1, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": gs,
                                       "zero_point": True}}
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        save_word_tokenizer(path, vocab)
        tok = json.loads((path / "tokenizer.json").read_text())
        tok_vocab = len(tok["model"]["vocab"])
        return dict(path=str(path), layers=layers, vocab=vocab, tokenizer_vocab=tok_vocab, linear_bytes=lin_bytes,
                    lm_head_bytes=vocab * h * 2, build_s=time.time() - t,
                    disk_bytes=sum(f.stat().st_size for f in path.iterdir()))

    def _engine(self, path: str, kv: str = "auto", dtype: str | None = None, max_tokens: int | None = None,
                device: str | None = None, backend: str = "triton"):
        import turbo

        d = self.cfg["decode"]
        dtype = dtype or self.cfg["model_dtype"]
        tokens = max_tokens or d["requests"] * (d["prompt"] + d["new"]) + 4 * 64
        cfg = turbo.EngineConfig(backend=backend, device=device or self.dev, dtype=dtype, kv_cache_dtype=kv,
                                 max_kv_tokens=tokens, max_batch_size=max(d["requests"], 1),
                                 max_num_batched_tokens=max(d["requests"] * d["prompt"], 256))
        return turbo.Engine(path, cfg)

    def _model_root(self) -> Path:
        """Where the checkpoint goes: /dev/shm when it has room (no disk writes), else the work folder."""
        need = 8 * GIB if not self.dry else 64 * MIB
        try:
            if shutil.disk_usage("/dev/shm").free > 2 * need and os.access("/dev/shm", os.W_OK):
                d = Path(tempfile.mkdtemp(prefix="compass-model-", dir="/dev/shm"))
                with open(self.work / "shm_dirs.txt", "a") as f:  # the parent removes it at the end
                    f.write(str(d) + "\n")
                return d
        except OSError:
            pass
        return self.work

    def sec_checkpoint(self) -> None:
        shape, c = self.cfg["model"], self.cfg
        root = self._model_root()
        # probes: 1 and 2 layers with a small vocabulary, each built and loaded once (after a first 1-layer load that
        # pays the imports and first-use costs): the difference is one layer's cost, the rest the engine's fixed
        # start-up (tokenizer, KV pool, graph captures); they predict the full load
        t = time.time()
        probes = []
        for n_layers in (1, 1, 2):
            pr = self._build(root / "probe", shape, n_layers, c["probe_vocab"], seed=1)
            tl = time.time()
            eng = self._engine(pr["path"])
            probes.append(pr["build_s"] + time.time() - tl)
            eng = None
            gc.collect()
            self.free()
            shutil.rmtree(pr["path"], ignore_errors=True)
        per_layer = max(probes[2] - probes[1], 0.1 * probes[2] / 2, 0.01)
        fixed = max(probes[1] - per_layer, 0.0)
        full = shape["layers"]
        budget = self.left() - 2.0 - c["vocab_extra_s"] - 1.25 * fixed
        layers = max(1, min(full, int(budget / (per_layer * 1.25))))
        est = fixed + per_layer * full
        self.row(kind="probe", probe_s=probes, est_s_per_layer=per_layer, est_fixed_s=fixed, est_full_s=est,
                 layers_chosen=layers, probe_total_s=time.time() - t,
                 note=None if layers == full else f"{full} layers would take ~{est:.0f} s to build and load, "
                                                  f"{self.left():.0f} s are left: {layers} layers")
        ck = self._build(root / "model", shape, layers, shape["vocab"])
        self.row(kind="build", **{k: v for k, v in ck.items() if k != "path"}, full_layers=full,
                 gbytes=ck["disk_bytes"] / 1e9)
        tl = time.time()
        eng = self._engine(ck["path"])
        ck["load_s"] = time.time() - tl
        st = eng.stats()
        self.row(kind="load", layers=layers, load_s=ck["load_s"], kv_cache_dtype=st.get("kv_cache_dtype"),
                 kv_bytes_per_token=st.get("kv_bytes_per_token"), kv_pool_tokens=st.get("kv_pool_tokens"),
                 gpu_alloc_gib=self.torch.cuda.memory_allocated() / GIB if self.cuda else None)
        (self.work / "ckpt.json").write_text(json.dumps(ck))
        self.state["engine"] = ("auto", eng)

    # =============================================================================================================
    # 6. decode
    # =============================================================================================================
    def sec_decode(self) -> None:

        torch = self.torch
        ckf = self.work / "ckpt.json"
        if not ckf.exists():
            self.row(skipped="no checkpoint (the checkpoint section did not finish)")
            return
        ck = json.loads(ckf.read_text())
        g = torch.Generator().manual_seed(0)
        hi = max(11, min(ck["vocab"], ck["tokenizer_vocab"]))

        def prompts(n, length):
            return [torch.randint(10, hi, (length,), generator=g).tolist() for _ in range(n)]

        kvs = self.cfg["decode_kv"]
        for ki, kv in enumerate(kvs):
            base = dict(kv=kv, layers=ck["layers"])
            try:
                self._decode_kv(ck, kv, ki, len(kvs), base, prompts)
            except StickyCudaError:
                raise
            except Exception as e:  # noqa: BLE001  (one KV dtype failing leaves the others to run)
                self.row(**base, error=err_text(e), traceback=traceback.format_exc()[-4000:])
                if not self.healthy():
                    raise StickyCudaError(f"decode with KV {kv}: {err_text(e)}") from e
            finally:
                self.state.pop("engine", None)
                gc.collect()
                self.free()

    def _decode_kv(self, ck: dict, kv: str, ki: int, n_kv: int, base: dict, prompts) -> None:
        d = self.cfg["decode"]
        copy_gbps = self.ceil.get("copy_gbps")
        est = (ck.get("load_s") or 0) + 2.0
        have = self.state.pop("engine", None)
        eng = have[1] if have and have[0] == kv else None
        have = None
        if eng is None:

            gc.collect()
            self.free()
            if self.left() < est + 5:
                self.row(**base, skipped=f"{self.left():.0f} s left, a load takes ~{est:.0f} s")
                return
            t = time.time()
            eng = self._engine(ck["path"], kv=kv)
            self.row(**base, kind="load", load_s=time.time() - t)
        kv_end = time.time() + self.left() / (n_kv - ki)
        st = eng.stats()
        kv_tok = st.get("kv_bytes_per_token") or 0
        kv_name = st.get("kv_cache_dtype", kv)
        w_bytes = ck["linear_bytes"] + ck["lm_head_bytes"]
        # warm-up: compiles (and graph captures) for both batch shapes, on prompts never measured
        t = time.time()
        eng.generate(prompts(1, d["prompt"])[0], max_new_tokens=d["warm_new"], ignore_eos=True)
        eng.generate(prompts(d["requests"], d["prompt"]), max_new_tokens=d["warm_new"], ignore_eos=True)
        self.sync()
        self.row(**base, kind="warmup", kv_cache_dtype=kv_name, warmup_s=time.time() - t)
        graphs = getattr(getattr(eng, "runner", None), "graphs", None)  # CUDA-graph decode (turbo/core/cuda_graphs.py)
        runs = [("batch1", 1, True), (f"batch{d['requests']}", d["requests"], True)]
        if ki == 0:  # the same batch-1 decode with graphs off: what the graphs save at batch 1
            runs.insert(1, ("batch1-eager", 1, False))
        for label, n_req, use_graphs in runs:
            if (n_req > 1 and time.time() > kv_end) or self.left() < 1:
                self.row(**base, run=label, skipped="this KV dtype's share of the section time is spent")
                continue
            if not use_graphs and (graphs is None or not graphs.enabled):
                self.row(**base, run=label, skipped="no CUDA graphs here (CPU, enforce_eager, a backend that is not "
                                                    "graph-safe, or a failed capture): batch1 is already eager")
                continue
            was = graphs.enabled if graphs is not None else None
            if graphs is not None:
                graphs.enabled = use_graphs and was
            ps = prompts(n_req, d["prompt"])
            s0 = step_count(eng)
            self.sync()
            t = time.perf_counter()
            outs = eng.generate(ps, max_new_tokens=d["new"], ignore_eos=True)
            self.sync()
            wall = time.perf_counter() - t
            s1 = step_count(eng)
            steps = s1 - s0 if s0 is not None and s1 is not None else None
            gen_tokens = sum(len(o.token_ids) for o in outs)
            per_req = sorted(o.decode_seconds / max(1, len(o.token_ids) - 1) for o in outs)
            step_ms = 1e3 * per_req[len(per_req) // 2]
            mean_ctx = d["prompt"] + d["new"] / 2
            roof_bytes = w_bytes + n_req * mean_ctx * kv_tok
            roof_ms = roof_bytes / (copy_gbps * 1e9) * 1e3 if copy_gbps else None
            row = dict(**base, run=label, kv_cache_dtype=kv_name, requests=n_req, prompt=d["prompt"], new=d["new"],
                       wall_s=wall, steps=steps, tokens_per_s=gen_tokens / wall,
                       decode_tokens_per_s=1e3 * n_req / step_ms if step_ms else None,
                       decode_ms_per_step=step_ms, wall_ms_per_step=1e3 * wall / steps if steps else None,
                       ttft_ms=1e3 * max(o.ttft for o in outs), roofline_bytes=roof_bytes, roofline_ms=roof_ms,
                       frac_roofline=roof_ms / step_ms if roof_ms and step_ms else None)
            if time.time() < kv_end:
                row.update(self._gpu_per_step(eng, n_req, prompts, d))
            row["cuda_graphs"] = bool(graphs is not None and graphs.enabled)
            row["graph_replays"] = getattr(graphs, "replays", None)
            if graphs is not None:
                graphs.enabled = was
            self.row(**row)

    def _gpu_per_step(self, eng, n_req: int, prompts, d: dict) -> dict:
        """GPU-busy and wall ms per decode step: two profiled runs of different lengths, differenced (the prefill
        and fixed costs cancel)."""
        try:
            from torch.profiler import ProfilerActivity, profile
        except Exception as e:  # noqa: BLE001
            return dict(gpu_ms_per_step=None, gpu_why=err_text(e))
        res = []
        for n_new in (d["prof_short"], d["prof_long"]):
            ps = prompts(n_req, d["prompt"])
            acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
            trace = self.work / "trace.json"
            try:
                with profile(activities=acts) as prof:
                    self.sync()
                    t = time.perf_counter()
                    eng.generate(ps, max_new_tokens=n_new, ignore_eos=True)
                    self.sync()
                    wall = time.perf_counter() - t
                prof.export_chrome_trace(str(trace))
                busy, kernels = gpu_busy(trace)
            except Exception as e:  # noqa: BLE001
                return dict(gpu_ms_per_step=None, gpu_why=f"profiler: {err_text(e)}")
            finally:
                try:
                    trace.unlink()
                except OSError:
                    pass
            res.append((wall, busy, kernels))
        (w1, b1, k1), (w2, b2, k2) = res
        ds = d["prof_long"] - d["prof_short"]  # decode steps between the two runs (same prompts' shape)
        out = dict(prof_wall_ms_per_step=1e3 * (w2 - w1) / ds, prof_new_tokens=[d["prof_short"], d["prof_long"]])
        if self.cuda:
            out.update(gpu_ms_per_step=1e3 * (b2 - b1) / ds, kernels_per_step=(k2 - k1) / ds,
                       gpu_busy_frac=(b2 - b1) / (w2 - w1) if w2 > w1 else None)
        else:
            out.update(gpu_ms_per_step=None, gpu_why="no CUDA (dry run): wall clock only")
        return out

    # =============================================================================================================
    # 7. GPU vs CPU float32 logits
    # =============================================================================================================
    def sec_logits(self) -> None:

        torch = self.torch
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import build_key_outlier_model

        root = self.work / "tiny"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        models = {}
        try:
            models["dense_f32_keyoutlier"] = (str(build_key_outlier_model(root / "dense")), 128)
        except Exception as e:  # noqa: BLE001
            self.row(model="dense_f32_keyoutlier", error=f"building: {err_text(e)}", traceback=traceback.format_exc()[-3000:])
        ck = self._build(root / "w4a16", self.cfg["tiny"], self.cfg["tiny"]["layers"], self.cfg["tiny"]["vocab"], seed=3)
        models["w4a16_random_awq"] = (ck["path"], min(ck["vocab"], ck["tokenizer_vocab"]))
        g = torch.Generator().manual_seed(5)
        for name, (path, vocab) in models.items():
            if self.left() < 1:
                self.row(model=name, skipped="the section's time is spent")
                continue
            n_prompt, n_new = self.cfg["logits_tokens"]
            ids = torch.randint(10, vocab, (n_prompt,), generator=g).tolist()
            res = {}
            try:
                for side, dev, backend in (("gpu", self.dev, "triton"), ("cpu", "cpu", "torch")):
                    eng = self._engine(path, dtype="float32", max_tokens=256, device=dev, backend=backend)
                    res[side] = eng.generate(ids, max_new_tokens=n_new, ignore_eos=True, logprobs=5)
                    del eng
                    gc.collect()
            except Exception as e:  # noqa: BLE001  (one model failing leaves the other to run)
                self.row(model=name, error=err_text(e), traceback=traceback.format_exc()[-4000:])
                if not self.healthy():
                    raise StickyCudaError(f"logits of {name}: {err_text(e)}") from e
                continue
            a, c = res["gpu"], res["cpu"]
            same = a.token_ids == c.token_ids
            diffs = []
            for la, lc in zip(a.logprobs, c.logprobs):
                dc = dict(lc)
                diffs += [abs(v - dc[t]) for t, v in la if t in dc]
            self.row(model=name, gpu=f"triton on {self.dev}", cpu="torch on cpu", dtype="float32",
                     tokens_equal=same, compared=len(diffs), max_abs_diff_logprob=max(diffs) if diffs else None,
                     note=f"top-5 log-probabilities of {n_new} greedy tokens after a {n_prompt}-token prompt "
                          f"(public API: generate)")

    # =============================================================================================================
    # 8. tests
    # =============================================================================================================
    def sec_tests(self) -> None:
        files = [f for f in TEST_FILES if (REPO / f).exists()]
        missing = [f for f in TEST_FILES if f not in files]
        has_xdist, has_to = importable("xdist"), importable("pytest_timeout")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
        notes = []
        if self.dry:
            cmd += ["--collect-only"]
            notes.append("dry run: collection only (the GPU run executes them)")
        if has_xdist:
            cmd += ["-n", str(self.cfg["xdist_workers"])]
        else:
            notes.append("pytest-xdist is not installed here: one process")
        if has_to:
            cmd += ["--timeout", str(self.cfg["test_timeout"])]
        else:
            notes.append("pytest-timeout is not installed here: no per-test timeout")
        cmd += files
        limit = max(5.0, self.left())
        log_path = self.out / "tests.log"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        if self.dry:
            env["TRITON_INTERPRET"] = "1"
        t = time.time()
        with open(log_path, "w") as logf:
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            p = subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            write_status(self.work, dict(read_status(self.work), tests_pgid=p.pid))
            timed_out = False
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(p.pid)
                rc = p.wait()
                logf.write(f"\n[gpu_compass] stopped after {limit:.0f} s (the section's time)\n")
        text = log_path.read_text(errors="replace")
        summary = pytest_summary(text)
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|tests? collected)",
                                                   summary)}
        self.row(cmd=" ".join(cmd[2:]), files=files, missing=missing, rc=rc, timed_out=timed_out, seconds=time.time() - t,
                 summary=summary, **{k.replace(" ", "_"): v for k, v in counts.items()},
                 note="; ".join(notes) or None, log="tests.log")
