#!/bin/bash
# One capped matmul run with the controller's budget logged every 0.5 s (-v):
# for finding out why a cap misses. Usage: bash bench/gpu/sm_debug.sh [KIND] [CAP]
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
KIND=${1:-matmul}; CAP=${2:-25}
bash .device/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* | head -1)
python3 bench/hami.py run --libcuda "$LIB" --group-by env:HAMI_GROUP --socket /tmp/h.sock \
    --state-dir /tmp/hs --sm-limits -v > /dev/null 2> "$OUT/daemon.log" &
DPID=$!
for i in $(seq 1 240); do grep -q "ready" "$OUT/daemon.log" && break; sleep 0.25; done
HAMI_GROUP=dbg CUDA_DEVICE_SM_LIMIT=$CAP python3 bench/gpu/sm_workload.py $KIND --seconds 6 --settle 3 \
    --label cap$CAP > "$OUT/sm.jsonl"
python3 bench/hami.py ps --socket /tmp/h.sock --json > "$OUT/ps.json" 2>&1
kill -TERM $DPID; wait $DPID
python3 -c "
import json; r=json.loads(open('$OUT/sm.jsonl').readline()); print(r['steady'], [(t, round(v)) for t, v in r['windows']])"
grep -E "budget|learned|throttl" "$OUT/daemon.log" | cut -c1-260 | head -60
python3 -c "import json; print(json.load(open('$OUT/ps.json'))['counters'])" 2>&1 | head -5
