#!/usr/bin/env bash
# Serving throughput and time to first token (docs/BENCHMARKS.md, "Serving"): `llmem-bench serve`
# on pycoder at 1, 4 and 16 concurrent streaming clients over loopback HTTP, then the prefix
# workload (1024 shared + 128 distinct prompt tokens, 4 clients) against the same lengths with
# nothing shared. Prints the machine and the command first.
#
#   bench/serve.sh [BUILD_DIR] [MODEL] [extra llmem-bench serve options]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
model=${2:-$here/models/pycoder}
shift $(( $# > 2 ? 2 : $# ))
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs," \
     "$(free -g | awk '/Mem:/ {print $2}') GiB; load average $(cut -d' ' -f1-3 /proc/loadavg)"
cmd=("$build/llmem-bench" serve "$model" --clients 1,4,16 --prompt-tokens 128 --max-tokens 128
     --shared-prefix 1024 --prefix-clients 4 "$@")
echo "command: ${cmd[*]#$here/}"
echo
"${cmd[@]}"
