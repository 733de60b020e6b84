#!/usr/bin/env bash
# The 8B-shaped Q4_K_M GGUF on a GPU beside llama.cpp (docs/BENCHMARKS.md, "GPU, GGUF files"):
# writes the random 8B-shaped model, converts it to a bf16 GGUF and quantizes it with llama.cpp's
# llama-quantize (the same file for both engines), then alternates the two engines: prefill 512
# and batch-1 decode (`llmem-bench decode` against `llama-bench`), batch 32 (`llmem-bench serve`
# against `llama-batched-bench`), and llmem's quantized matrices alone (`llmem-bench qmatmul`).
#
#   bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]
#
# BUILD_DIR holds a CUDA build of llmem-bench; LLAMA_CPP_BIN a CUDA build of llama-bench,
# llama-batched-bench and llama-quantize (../shared/peers/README.md says how). The tools come from
# ../shared/tools (MAKE_RANDOM_LLAMA, HF_TO_GGUF and GGUF_PY override them); WORK_DIR (default
# /tmp/llmem-gguf) needs about 30 GB while the bf16 files exist, 4.2 GB after.
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
    "$py" "${HF_TO_GGUF:-$tools/hf_to_gguf_minimal.py}" "$work/m8b" "$work/m8b-bf16.gguf" \
        --gguf-py "${GGUF_PY:-$tools/gguf-py}" --outtype bf16
    rm -rf "$work/m8b"
    "$llama/llama-quantize" "$work/m8b-bf16.gguf" "$model" Q4_K_M "$(nproc)"
    rm -f "$work/m8b-bf16.gguf"
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
