#!/usr/bin/env bash
# One prepared run on a lent GPU: environment, GPU tests, kernel bench, decode on a Llama-3-8B-shaped W4A16 model.
#
#   bash bench/gpu.sh [RESULTS_DIR]        (default: ./gpu_results; the device tool passes $OUT)
#
# Uses the machine's python3 with its own torch, triton, transformers, safetensors, accelerate, click, tqdm and
# psutil (nothing is downloaded: the repository is put on PYTHONPATH). Each step writes its output to RESULTS_DIR
# and a failed step does not stop the later ones; the exit status is the number of failed steps.
# Steps and their rough time on an H200: tests ~1 min, kernel bench ~1 min, model build ~2 min, decode ~3 min.
set -u
cd "$(dirname "$0")/.."
RES="${1:-${OUT:-./gpu_results}}"
mkdir -p "$RES"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
MODEL="${LLAMA3_DIR:-/tmp/llama3-8b-w4a16-random}"
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
step tests $PY -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_engine.py \
  tests/test_platform.py -m "not slow"
step kernels bash -c "$PY bench/kernels.py --suite llama3 --device cuda --json > '$RES/kernels.json' && \
  $PY -c 'import json,sys; sys.path.insert(0,\"bench\"); import kernels; r = json.load(open(\"$RES/kernels.json\"))[\"llama3\"]; kernels.print_llama3(r); kernels.print_elementwise(r)'"
step model bash -c "[ -f '$MODEL/config.json' ] || $PY bench/load_memory.py --make-llama3-8b '$MODEL' --tokenizer"
step load_memory $PY bench/load_memory.py "$MODEL" --device cuda --json
step decode $PY bench/gpu_decode.py "$MODEL" --device cuda --backends triton,torch --kv auto,int8,int4 \
  --requests 32 --prompt-len 128 --new-tokens 128
echo "failed steps: $fails" | tee "$RES/summary.txt"
exit "$fails"
