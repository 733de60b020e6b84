#!/usr/bin/env bash
# The 8B-shaped Q4_K_M GGUF on a GPU beside llama.cpp (docs/BENCHMARKS.md, "GPU, GGUF files"):
# writes the random 8B-shaped model and quantizes it with `llmem quantize --type q4_k_m`
# (llama-quantize's mix of types; the same file for both engines), then alternates the two
# engines: prefill 512 and batch-1 decode (`llmem-bench decode` against `llama-bench`), batch 32
# (`llmem-bench serve` against `llama-batched-bench`), and llmem's quantized matrices alone
# (`llmem-bench qmatmul`).
#
#   bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]
#
# BUILD_DIR holds a CUDA build of llmem and llmem-bench; LLAMA_CPP_BIN a CUDA build of
# llama-bench and llama-batched-bench (../shared/peers/README.md says how). MAKE_RANDOM_LLAMA
# overrides ../shared/tools/make_random_llama.py; WORK_DIR (default /tmp/llmem-gguf) needs about
# 15 GB while the bf16 model exists, 4.2 GB after.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]}
llama=${2:?usage: bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]}
work=${3:-/tmp/llmem-gguf}
tools=$here/../shared/tools
py=${PYTHON:-python3}
model=$work/m8b-q4_k_m.gguf
mkdir -p "$work"
if [ ! -f "$model" ]; then
    "$py" "${MAKE_RANDOM_LLAMA:-$tools/make_random_llama.py}" "$work/m8b" --hidden 4096 \
        --intermediate 14336 --layers 32 --heads 32 --kv-heads 8 --head-dim 128 --max-pos 131072 \
        --tokenizer-dir "$here/models/pycoder"
    "$build/llmem" quantize "$work/m8b" "$model" --type q4_k_m
    rm -rf "$work/m8b"
fi
for round in 1 2; do
    echo "== round $round"
    "$build/llmem-bench" decode "$model" --backend cuda --reps "${REPS:-3}"
    "$llama/llama-bench" -m "$model" -p 512 -n 128 -r "${REPS:-3}" -ngl 99
done
"$build/llmem-bench" serve "$model" --backend cuda --clients 32 --max-sequences 32 --requests 32 \
    --shared-prefix 0
"$llama/llama-batched-bench" -m "$model" -c 16384 -npp 128 -ntg 128 -npl 32 -ngl 99
"$build/llmem-bench" qmatmul --rows 1,4,32 --types q4_K,q6_K,q8_0,bf16
