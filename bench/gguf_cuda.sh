#!/usr/bin/env bash
# The 8B-shaped Q4_K_M GGUF on a GPU beside llama.cpp (docs/BENCHMARKS.md, "GPU, GGUF files"):
# writes the 8B shape's seeded random weights quantized by `llmem quantize --type q4_k_m
# --load-format dummy` from its config.json (llama-quantize's mix of types; the same file for both
# engines), then alternates the two
# engines: prefill 512 and batch-1 decode (`llmem-bench decode` against `llama-bench`), batch 32
# (`llmem-bench serve` against `llama-batched-bench`), and llmem's quantized matrices alone
# (`llmem-bench qmatmul`).
#
#   bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]
#
# BUILD_DIR holds a CUDA build of llmem and llmem-bench; LLAMA_CPP_BIN a CUDA build of
# llama-bench and llama-batched-bench (../shared/peers/README.md says how). WORK_DIR (default
# /tmp/llmem-gguf) needs 4.2 GB.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]}
llama=${2:?usage: bench/gguf_cuda.sh BUILD_DIR LLAMA_CPP_BIN [WORK_DIR]}
work=${3:-/tmp/llmem-gguf}
model=$work/m8b-q4_k_m.gguf
mkdir -p "$work/m8b"
if [ ! -f "$model" ]; then
    cat >"$work/m8b/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
 "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
 "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "tie_word_embeddings": true, "vocab_size": 4096, "bos_token_id": 0, "eos_token_id": 1,
 "torch_dtype": "bfloat16"}
JSON
    cp "$here/models/pycoder/tokenizer.json" "$here/models/pycoder/tokenizer_config.json" \
        "$work/m8b/"
    "$build/llmem" quantize "$work/m8b" "$model" --type q4_k_m --load-format dummy
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
