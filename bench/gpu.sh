#!/usr/bin/env bash
# One prepared run on a lent GPU: environment, GPU tests, kernel bench, decode on a Llama-3-8B-shaped W4A16 model.
#
#   bash bench/gpu.sh [RESULTS_DIR]        (default: ./gpu_results; the device tool passes $OUT)
#
# Uses the machine's python3 with its own torch, triton, transformers, safetensors, accelerate, click, tqdm and
# psutil (nothing is downloaded: the repository is put on PYTHONPATH). Each step writes its output to RESULTS_DIR
# and a failed step does not stop the later ones; the exit status is the number of failed steps.
# Steps and their rough time on an H200: tests ~1 min, kernel bench ~1 min, model build ~2 min, decode ~3 min,
# lite on 1- and 2-layer Llama-3-8B-shaped models (rtn, awq, gptq; the difference = one layer) a few minutes.
set -u
cd "$(dirname "$0")/.."
RES="${1:-${OUT:-./gpu_results}}"
mkdir -p "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
MODEL="${LLAMA3_DIR:-/tmp/llama3-8b-w4a16-random}"
# overrides for a smoke test elsewhere, e.g. on a CPU:
#   DEVICE=cpu BACKENDS=torch MAKE_LAYERS=1 REQUESTS=2 NEW_TOKENS=4 SKIP_TESTS=1 QUICK=1 bash bench/gpu.sh /tmp/r
DEVICE="${DEVICE:-cuda}"
BACKENDS="${BACKENDS:-triton,torch}"
REQUESTS="${REQUESTS:-32}"
NEW_TOKENS="${NEW_TOKENS:-128}"
fails=0
step() {  # step NAME CMD...: run, tee to RES/NAME.log, count failures
  local name="$1"; shift
  echo "=== $name: $*" | tee "$RES/$name.log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$RES/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$RES/$name.log"
  [ "$rc" -eq 0 ] || fails=$((fails + 1))
}

step env bash -c "nvidia-smi; $PY -m turbo.cli env"
[ -n "${SKIP_TESTS:-}" ] || step tests $PY -m pytest -q -rfEs -p no:cacheprovider tests/test_triton_kernels.py \
  tests/test_triton_engine.py tests/test_platform.py tests/test_kernels.py tests/test_sampler_batched.py \
  tests/test_planner.py tests/test_lite_pipeline.py -m "not slow"
step lite_speed bash -c "$PY bench/lite_speed.py --shape llama3-8b --layers 1 --device $DEVICE --json > '$RES/lite_speed_1l.json' && \
  $PY bench/lite_speed.py --shape llama3-8b --layers 2 --device $DEVICE --json > '$RES/lite_speed_2l.json'"
step kernels bash -c "$PY bench/kernels.py --suite llama3 --device $DEVICE ${QUICK:+--quick} --json > '$RES/kernels.json' && \
  $PY -c 'import json,sys; sys.path.insert(0,\"bench\"); import kernels; r = json.load(open(\"$RES/kernels.json\"))[\"llama3\"]; kernels.print_llama3(r); kernels.print_elementwise(r)'"
step model bash -c "[ -f '$MODEL/tokenizer.json' ] || { $PY bench/load_memory.py --make-llama3-8b '$MODEL' \
  ${MAKE_LAYERS:+--make-layers $MAKE_LAYERS} && \
  $PY -c 'import sys; sys.path.insert(0, \"tests\"); from tiny_models import save_word_tokenizer; save_word_tokenizer(\"$MODEL\", 128256)'; }"
step load_memory $PY bench/load_memory.py "$MODEL" --device "$DEVICE" --modes stream --json
step decode $PY bench/gpu_decode.py "$MODEL" --device "$DEVICE" --backends "$BACKENDS" --kv auto,int8,int4 \
  --requests "$REQUESTS" --prompt-len 128 --new-tokens "$NEW_TOKENS"
echo "failed steps: $fails" | tee "$RES/summary.txt"
exit "$fails"
