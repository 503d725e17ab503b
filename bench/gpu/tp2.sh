#!/bin/bash
# TP=2 with group churn on nvidia-h200-x2 (see tp2_churn.py). Carry .debs .device.
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
bash .device/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* | head -1)
nvidia-smi -L
python3 bench/hami.py run --libcuda "$LIB" --group-by env:HAMI_GROUP --socket /tmp/h.sock \
    --state-dir /tmp/hs > /dev/null 2> "$OUT/daemon.log" &
DPID=$!
for i in $(seq 1 120); do python3 bench/hami.py ps --socket /tmp/h.sock >/dev/null 2>&1 && break; sleep 0.5; done
HAMI_GROUP=tp CUDA_DEVICE_MEMORY_LIMIT=40g CUDA_DEVICE_SM_LIMIT=50 \
  timeout 150 python3 bench/gpu/tp2_churn.py --seconds 25 --socket /tmp/h.sock --out "$OUT" | tee "$OUT/tp2.json"
python3 bench/hami.py events --socket /tmp/h.sock > "$OUT/events.txt" 2>&1
kill -TERM $DPID; wait $DPID; echo "daemon exit $?"
grep -c "compact" "$OUT/events.txt"
