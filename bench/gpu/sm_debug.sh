#!/bin/bash
# One capped matmul run with the controller's budget logged every 0.5 s (-v):
# for finding out why a cap misses. Usage: bash bench/gpu/sm_debug.sh [KIND] [CAP]
KIND=${1:-matmul}; CAP=${2:-25}
. bench/gpu/prelude.sh
start_daemon --sm-limits -v
HAMI_GROUP=dbg CUDA_DEVICE_SM_LIMIT=$CAP python3 bench/gpu/sm_workload.py $KIND --seconds 6 --settle 3 \
    --label cap$CAP > "$OUT/sm.jsonl"
python3 bench/hami.py ps --socket /tmp/h.sock --json > "$OUT/ps.json" 2>&1
kill -TERM $DPID; wait $DPID
python3 -c "
import json; r=json.loads(open('$OUT/sm.jsonl').readline()); print(r['steady'], [(t, round(v)) for t, v in r['windows']])"
grep -E "budget|learned|throttl" "$OUT/daemon.log" | cut -c1-260 | head -60
python3 -c "import json; print(json.load(open('$OUT/ps.json'))['counters'])" 2>&1 | head -5
