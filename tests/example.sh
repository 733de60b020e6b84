#!/usr/bin/env bash
# The README's C example, built the way a user builds it: the library installed into a fresh
# prefix, the example compiled against the installed headers and pkg-config file only, then run on
# the embedded model. Usage: example.sh BUILD_DIR SOURCE_DIR CC
set -euo pipefail
build=$1 src=$2 cc=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" >/dev/null
# the block that follows the README's marker line
awk '/^<!-- example: /{want=1; next} want && /^```c$/{on=1; next} on && /^```$/{exit} on{print}' \
    "$src/README.md" >"$work/example.c"
[ -s "$work/example.c" ] || { echo "example.sh: no C block after the marker in README.md"; exit 1; }

pc=$(find "$work/prefix" -name llmem.pc -print -quit)
export PKG_CONFIG_PATH=$(dirname "$pc")
flags=$(pkg-config --cflags --libs llmem)
libdir=$(pkg-config --variable=libdir llmem)
# no -I of the source tree: only what was installed
"$cc" -std=c11 -Wall -Wextra -Werror -Wno-unused-parameter "$work/example.c" $flags \
    -Wl,-rpath,"$libdir" -o "$work/example"

out=$("$work/example" "$src/models/pycoder" 'def main():')
echo "$out"
grep -Eq '^32 tokens; planned footprint [0-9.]+[KMG]i?B?, allocator peak [0-9.]+[KMG]' <<<"$out" || {
    echo "example.sh: the example's last line is not the expected summary"
    exit 1
}
