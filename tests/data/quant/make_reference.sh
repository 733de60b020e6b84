#!/usr/bin/env bash
# tests/data/quant/make_reference.sh — rewrites the references of test-quant from ggml's own C
# code, then cross-checks ggml's dequantization with gguf-py's numpy reference (gguf/quants.py).
#
#   tests/data/quant/make_reference.sh LLAMA_CPP_SRC [GGUF_PY_DIR]
#
# LLAMA_CPP_SRC: a llama.cpp source tree (ggml/src/ggml-quants.c, ggml-impl.h, ggml-common.h), e.g.
# /work/shared/peers/llama.cpp-src.tar.xz extracted under /tmp. GGUF_PY_DIR (default
# /work/shared/tools/gguf-py): the directory holding the gguf package; numpy must be importable
# by $PYTHON (default python3). ggml-quants.c is compiled as Release builds of llama.cpp compile
# it (NDEBUG: its asserts off) and without FMA contraction or F16C, so its f16 conversions are the
# scalar ones of ggml-impl.h. The references are what ggml does on x86-64 (quant/quantize.c says
# for which inputs C leaves a float-to-int conversion undefined and the hardware decides).
set -euo pipefail
src=${1:?usage: make_reference.sh LLAMA_CPP_SRC [GGUF_PY_DIR]}
gguf_py=${2:-/work/shared/tools/gguf-py}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

flags=(-std=gnu11 -O2 -DNDEBUG -ffp-contract=off -fno-fast-math -I"$src/ggml/include"
       -I"$src/ggml/src" -I"$src/ggml/src/ggml-cpu")
cc "${flags[@]}" -c "$src/ggml/src/ggml-quants.c" -o "$tmp/ggml-quants.o"
cc "${flags[@]}" "$here/make_reference.c" "$tmp/ggml-quants.o" -lm -o "$tmp/make_reference"
"$tmp/make_reference" "$here"
PYTHONPATH="$gguf_py" "${PYTHON:-python3}" "$here/check_gguf_py.py" "$here"
