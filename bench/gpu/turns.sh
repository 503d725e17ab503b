#!/bin/bash
# The premise of SM turns (docs/performance.md): two processes sharing a GPU
# freely vs taking turns by the clock (30%/70% of a period), no hami-bpf.
# Usage: [KINDS="matmul small"] [PERIODS="0.05 0.1 0.2"] bash bench/gpu/turns.sh
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"; R="$OUT/turns.jsonl"; : > "$R"
T=bench/gpu/turns.py; S=${SECONDS_EACH:-6}
at() { python3 -c "import time; print(time.monotonic() + $1)"; }
for kind in ${KINDS:-matmul small}; do
  e=$(at 8); taskset -c 2 python3 $T $kind --epoch $e --seconds $S --label alone >> "$R"
  e=$(at 8); taskset -c 2 python3 $T $kind --epoch $e --seconds $S --label alone30 --period 0.1 --slot 0:0.3 >> "$R"
  e=$(at 8); taskset -c 2 python3 $T $kind --epoch $e --seconds $S --label alone70 --period 0.1 --slot 0.3:1 >> "$R"
  e=$(at 8)
  taskset -c 2 python3 $T $kind --epoch $e --seconds $S --label free-a >> "$R" &
  taskset -c 6 python3 $T $kind --epoch $e --seconds $S --label free-b >> "$R"; wait
  for p in ${PERIODS:-0.05 0.1 0.2}; do
    e=$(at 8)
    taskset -c 2 python3 $T $kind --epoch $e --seconds $S --period $p --slot 0:0.3 --label "turn30@$p" >> "$R" &
    taskset -c 6 python3 $T $kind --epoch $e --seconds $S --period $p --slot 0.3:1 --label "turn70@$p" >> "$R"; wait
  done
done
python3 - "$R" <<'PY'
import json, sys
# Two processes append to one file: a line can run into the next.
rows = [json.loads(l) for l in open(sys.argv[1]).read().replace("}{", "}\n{").splitlines() if l.strip()]
for kind in dict.fromkeys(r["kind"] for r in rows):
    rs = {r["label"]: r["rate"] for r in rows if r["kind"] == kind}
    base = rs.get("alone")
    print(f"{kind}: alone {base:.4g}/s")
    for lab, v in rs.items():
        print(f"  {lab:14s} {100 * v / base:6.1f}% of alone")
PY
