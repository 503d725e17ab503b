#!/bin/bash
# Probe overhead on the GPU, one run: bare, under the daemon (observing), and
# under the daemon with a memory limit in force (admission on every alloc).
# Usage (device tool): bash bench/gpu/overhead.sh   (carry: .debs .device)
set -u
OUT=${OUT:-$PWD/bench-out}; mkdir -p "$OUT"
bash .device/setup-bcc.sh .debs > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
. /tmp/bccroot/env.sh
LIB=$(ls /usr/local/nvidia/lib64/libcuda.so.*.* | head -1)
python3 bench/gpu/overhead.py bare | tee "$OUT/overhead.jsonl"
python3 bench/hami.py run --libcuda "$LIB" --group-by pid --socket /tmp/h.sock --state-dir /tmp/hs \
    > /dev/null 2> "$OUT/daemon.log" &
DPID=$!
for i in $(seq 1 120); do grep -q ready "$OUT/daemon.log" && break; sleep 0.5; done
python3 bench/gpu/overhead.py observed | tee -a "$OUT/overhead.jsonl"
CUDA_DEVICE_MEMORY_LIMIT=64g python3 bench/gpu/overhead.py limited | tee -a "$OUT/overhead.jsonl"
python3 bench/gpu/overhead.py bare-again-with-daemon | tee -a "$OUT/overhead.jsonl"
kill -TERM $DPID; wait $DPID
python3 bench/gpu/overhead.py bare-after | tee -a "$OUT/overhead.jsonl"
grep -c "ready" "$OUT/daemon.log"
