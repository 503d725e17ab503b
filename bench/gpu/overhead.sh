#!/bin/bash
# Probe overhead on the GPU, one run: bare, under the daemon (observing), and
# under the daemon with a memory limit in force (admission on every alloc).
# Usage (device tool): bash bench/gpu/overhead.sh   (carry: .debs)
GROUP_BY=pid
. bench/gpu/prelude.sh
python3 bench/gpu/overhead.py bare | tee "$OUT/overhead.jsonl"
start_daemon
python3 bench/gpu/overhead.py observed | tee -a "$OUT/overhead.jsonl"
CUDA_DEVICE_MEMORY_LIMIT=64g python3 bench/gpu/overhead.py limited | tee -a "$OUT/overhead.jsonl"
python3 bench/gpu/overhead.py bare-again-with-daemon | tee -a "$OUT/overhead.jsonl"
stop_daemon
python3 bench/gpu/overhead.py bare-after | tee -a "$OUT/overhead.jsonl"
grep -c "ready" "$OUT/daemon.log"
