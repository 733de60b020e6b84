#!/usr/bin/env bash
# Time to first token of a 1,500-token prompt with the session bank (docs/BENCHMARKS.md, "The
# session bank"), on pycoder unless MODEL says otherwise:
#   1. in one process, side by side: `llmem-bench bank` (cold, RAM hit, a chat's next turn, disk
#      hit in a new engine);
#   2. across processes, each number a new `llmem run` / `llmem chat`: cold (no spill store),
#      disk hit (a store written by an earlier process), and the second turn of a `llmem chat`
#      conversation whose first message is ~1,500 tokens of code.
# Medians of REPS runs (default 5); THREADS threads (default 2).
#
#   bench/bank_ttft.sh [BUILD_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
llmem="$build/llmem"
model=${MODEL:-$here/models/pycoder}
reps=${REPS:-5}
threads=${THREADS:-2}
store=$(mktemp -d)
trap 'rm -rf "$store"' EXIT

median() { sort -n | awk '{v[NR] = $1} END {m = int((NR + 1) / 2); print (NR % 2) ? v[m] : (v[m] + v[m + 1]) / 2}'; }
json_num() { grep -o "\"$1\":[[:space:]]*[-0-9.e]*" | head -1 | awk -F: '{gsub(/[[:space:]]/, "", $2); print $2}'; }

echo "== in one process"
"$build/llmem-bench" bank "$model" --prompt 1500 --reps "$reps" --threads "$threads"
echo

ids=$(seq 0 1499 | awk '{printf "%s%d", (NR > 1 ? "," : ""), 20 + ($1 * 37) % 3900}')
run() { "$llmem" run "$model" --ids "$ids" -n 1 --json --stats --threads "$threads" "$@" 2>/dev/null; }

cold=()
for _ in $(seq "$reps"); do cold+=("$(run --no-spill | json_num ttft_ms)"); done
run --bank-dir "$store" >/dev/null # writes the store
disk=()
for _ in $(seq "$reps"); do
    out=$(run --bank-dir "$store")
    [ "$(echo "$out" | json_num reused_disk_tokens)" = 1488 ] || { echo "no disk hit" >&2; exit 1; }
    disk+=("$(echo "$out" | json_num ttft_ms)")
done

# a chat: ~1,500 tokens of code as the first message, then a short question
line=$(seq 0 118 | awk '{printf "v%d = compute(%d, %d); ", $1, $1, ($1 * 7) % 13}')
chat=()
first=""
for _ in $(seq "$reps"); do
    err=$(printf '%s\nwhat does v3 hold?\n' "$line" |
        "$llmem" chat "$model" --chat-template chatml -n 16 --ignore-eos --stats --no-spill \
            --threads "$threads" 2>&1 >/dev/null | grep '^llmem stats:')
    first=$(echo "$err" | sed -n 1p | sed 's/.*prompt \([0-9]*\) tokens.*/\1/')
    second=$(echo "$err" | sed -n 2p)
    chat+=("$(echo "$second" | sed 's/.*ttft \([0-9.]*\) ms.*/\1/')")
    turn2=$(echo "$second" | sed 's/.*prompt \([0-9]*\) tokens (\([0-9]*\) from the session bank.*/\1 tokens, \2 from the bank/')
done

c=$(printf '%s\n' "${cold[@]}" | median)
d=$(printf '%s\n' "${disk[@]}" | median)
t=$(printf '%s\n' "${chat[@]}" | median)
echo "== across processes (median of $reps, ms)"
printf '  %-58s %8.1f\n' "cold (llmem run --no-spill, 1500 tokens)" "$c"
printf '  %-58s %8.1f  %5.1f %% of cold\n' "disk hit (llmem run, a new process on the store)" "$d" \
    "$(awk -v a="$d" -v b="$c" 'BEGIN {print 100 * a / b}')"
printf '  %-58s %8.1f  %5.1f %% of cold\n' "llmem chat, second turn ($turn2)" \
    "$t" "$(awk -v a="$t" -v b="$c" 'BEGIN {print 100 * a / b}')"
runs() { printf '%s\n' "$@" | awk '{printf "%s%.1f", (NR > 1 ? " " : ""), $1}'; }
echo "  (the chat's first message: $first tokens)"
echo "  runs: cold $(runs "${cold[@]}"); disk $(runs "${disk[@]}"); chat $(runs "${chat[@]}")"
