#!/usr/bin/env bash
# The library's boundary, checked on a build:
#  - libllmem.so exports exactly the functions include/llmem/ declares with LLMEM_API;
#  - every strong global symbol of libllmem.a is named llmem_* or lives in the C++ namespace
#    llmem_cuda or an anonymous one, so a program linking it statically keeps its names;
#  - no getenv outside src/core/options.c (one table of every option).
# Usage: check-boundary.sh LIBLLMEM_SO LIBLLMEM_A SOURCE_DIR
set -euo pipefail
so=$1 ar=$2 src=$3
fail=0

# a declaration's name may be on the line after LLMEM_API and its return type
declared=$(awk '/^LLMEM_API/ { l = $0; if (l !~ /\(/) { getline n; l = l " " n } print l }' \
    "$src"/include/llmem/*.h |
    sed -E 's/^[^(]*[^a-z0-9_](llmem_[a-z0-9_]+) *\(.*/\1/' | sort -u)
exported=$(nm -D --defined-only "$so" | awk '{print $NF}' | sort -u)
extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
if [ -n "$extra" ]; then
    echo "check-boundary: $so exports symbols that include/llmem/ does not declare with LLMEM_API:"
    echo "$extra" | sed 's/^/  /'
    fail=1
fi
if [ -n "$missing" ]; then
    echo "check-boundary: declared with LLMEM_API but not exported by $so (is the header included"
    echo "where the function is defined?):"
    echo "$missing" | sed 's/^/  /'
    fail=1
fi

unprefixed=$(nm -g --defined-only "$ar" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[TDBRGS]$/ {print $3}' |
    grep -v -e '^llmem_' -e '^_ZN10llmem_cuda' -e '_GLOBAL__N_' | sort -u || true)
if [ -n "$unprefixed" ]; then
    echo "check-boundary: global symbols of $ar without the llmem_ prefix:"
    echo "$unprefixed" | sed 's/^/  /'
    fail=1
fi

readers=$(grep -rnE '\b(secure_)?getenv *\(' "$src/src" "$src/bench" \
    --include='*.c' --include='*.h' --include='*.cu' --include='*.cuh' |
    grep -v "^$src/src/core/options.c:" || true)
if [ -n "$readers" ]; then
    echo "check-boundary: getenv outside src/core/options.c (add the variable to its table):"
    echo "$readers" | sed "s|^$src/|  |"
    fail=1
fi

[ $fail -eq 0 ] && echo "check-boundary: $(echo "$exported" | wc -l) exported symbols, all declared; no stray names"
exit $fail
