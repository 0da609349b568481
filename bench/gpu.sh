#!/usr/bin/env bash
# One prepared run on a lent GPU: bench/gpu_compass.py (environment and ceilings, W4A16 and paged attention in CUDA
# graphs, a float64 check, a random Llama-3-8B-shaped AWQ model through the engine, GPU vs CPU logits, the GPU tests),
# within one deadline, results appended to RESULTS_DIR/results.jsonl as they come and the compass table printed last.
#
#   bash bench/gpu.sh [RESULTS_DIR] [gpu_compass options]   (default: $OUT, else ./gpu_results; e.g. --budget-s 450)
#   bash bench/gpu.sh /tmp/r --dry-run                       (rehearsal on a CPU: Triton interpreter, tiny shapes)
#
# Uses the machine's python3 with its own torch, triton, transformers, safetensors and pytest (nothing is installed;
# the harness puts the repository on sys.path). See bench/gpu_compass.py for the sections and the output files.
set -u
cd "$(dirname "$0")/.."
RES="${OUT:-./gpu_results}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then RES="$1"; shift; fi
exec "${PYTHON:-python3}" bench/gpu_compass.py --out "$RES" "$@"
