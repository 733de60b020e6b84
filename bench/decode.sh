#!/usr/bin/env bash
# End-to-end prefill and decode speed (docs/BENCHMARKS.md, "Running models"): pycoder and the
# 1B-shaped random-weight Llama, with bf16 weights and an f16 copy, on 1 and 2 threads, each run
# against the read bandwidth probed right before and after it.
#
#   bench/decode.sh [BUILD_DIR] [WORK_DIR]
#
# The 1B model is written by make_random_llama.py (numpy; Debian: python3-numpy) from the shared
# tools when WORK_DIR/llama1b does not exist yet, and converted to f16 by bench/convert_dtype.py
# (PYTHON names an interpreter with numpy when python3 has none).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
work=${2:-/tmp/llmem-bench}
gen=${MAKE_RANDOM_LLAMA:-$here/../shared/tools/make_random_llama.py}
mkdir -p "$work"
if [ ! -f "$work/llama1b/model.safetensors" ]; then
    "${PYTHON:-python3}" "$gen" "$work/llama1b" --tokenizer-dir "$here/models/pycoder"
fi
if [ ! -f "$work/llama1b-f16/model.safetensors" ]; then
    "${PYTHON:-python3}" "$here/bench/convert_dtype.py" "$work/llama1b" "$work/llama1b-f16" --dtype f16
fi
for model in "$here/models/pycoder" "$work/llama1b" "$work/llama1b-f16"; do
    for mode in "" --no-mmap; do
        "$build/llmem-bench" decode "$model" --threads 1,2 --reps "${REPS:-3}" $mode
        echo
    done
done
