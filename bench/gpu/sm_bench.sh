#!/bin/bash
# SM limiting on one GPU, one device run: each workload uncapped, then capped
# at 25/50/75 (HAMi's CUDA_DEVICE_SM_LIMIT); two groups at 30/70 side by side;
# host time per launch with no probe vs with the launch probe attached.
# Usage (device tool): bash bench/gpu/sm_bench.sh   (carry: .debs .device)
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
bash .device/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* | head -1)
R="$OUT/sm.jsonl"; : > "$R"
start_daemon() {
  python3 bench/hami.py run --libcuda "$LIB" --group-by env:HAMI_GROUP --socket /tmp/h.sock \
      --state-dir /tmp/hs "$@" > /dev/null 2>> "$OUT/daemon.log" &
  DPID=$!
  for i in $(seq 1 120); do [ -S /tmp/h.sock ] && python3 bench/hami.py ps --socket /tmp/h.sock >/dev/null 2>&1 && break; sleep 0.5; done
}
stop_daemon() { kill -TERM $DPID; wait $DPID; }
W=bench/gpu/sm_workload.py
start_daemon
for kind in matmul small graph; do
  HAMI_GROUP=base-$kind python3 $W $kind --label uncapped | tee -a "$R"
  for cap in 25 50 75; do
    HAMI_GROUP=cap$cap-$kind CUDA_DEVICE_SM_LIMIT=$cap python3 $W $kind --label cap$cap | tee -a "$R"
  done
done
echo "== two groups 30/70 (matmul)"
HAMI_GROUP=g30 CUDA_DEVICE_SM_LIMIT=30 python3 $W matmul --seconds 10 --settle 3 --label pair30 >> "$R" &
A=$!
HAMI_GROUP=g70 CUDA_DEVICE_SM_LIMIT=70 python3 $W matmul --seconds 10 --settle 3 --label pair70 >> "$R" &
B=$!
wait $A $B
echo "== two groups uncapped side by side (matmul)"
HAMI_GROUP=u1 python3 $W matmul --seconds 10 --settle 3 --label pairfree1 >> "$R" &
A=$!
HAMI_GROUP=u2 python3 $W matmul --seconds 10 --settle 3 --label pairfree2 >> "$R" &
B=$!
wait $A $B
python3 bench/hami.py ps --socket /tmp/h.sock --json > "$OUT/ps.json" 2>&1
stop_daemon
python3 bench/gpu/sm_summary.py "$R"
