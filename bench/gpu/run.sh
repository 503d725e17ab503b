#!/bin/bash
# One device run: bcc from carried .deb files, the daemon from this checkout
# against the real libcuda, then the accounting and memory-limit workloads.
# Usage (device tool): bash bench/gpu/run.sh   (carry: .debs)
# Results land in $OUT (or ./bench-out).
GROUP_BY=pid
. bench/gpu/prelude.sh
echo "libcuda: $LIB"; nvidia-smi -L || true
SOCK=/tmp/h.sock
start_daemon --oom-action stop-rewrite -v
grep "ready" "$OUT/daemon.log" || { tail -50 "$OUT/daemon.log"; exit 1; }
python3 bench/hami.py doctor --json > "$OUT/doctor.json" 2>&1
for conf in "" "expandable_segments:True" "backend:cudaMallocAsync"; do
  echo "== accounting ${conf:-default}"
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout 120 python3 bench/gpu/torch_accounting.py --socket $SOCK \
      --label "${conf:-default}" | tee -a "$OUT/accounting.jsonl"
done
for conf in "" "expandable_segments:True"; do
  echo "== memlimit 8g ${conf:-default}"
  CUDA_DEVICE_MEMORY_LIMIT=8g PYTORCH_CUDA_ALLOC_CONF=$conf timeout 180 python3 bench/gpu/torch_memlimit.py \
      | tee -a "$OUT/memlimit.jsonl"
done
python3 bench/hami.py events --socket $SOCK --json > "$OUT/events.jsonl" 2>&1
stop_daemon
grep -v "registered\|^hami-bpf: pid" "$OUT/daemon.log" | tail -40
